"""The native half of the probe (Rust, built by maturin)."""

__version__: str

def start(python_version: str, listen: str | None = None) -> dict[str, str | None]: ...
def stop() -> bool: ...
def stopping() -> bool: ...
def endpoint() -> str | None: ...
def forget_after_fork() -> None: ...
def arm_deadline(seconds: float, exception: type[BaseException]) -> int: ...
def disarm_deadline(token: int) -> bool: ...
def trace_frames(state: list) -> bool:
    """Traces the frames `state[2:]` of one thread: `state[1](frame)` at each
    of their line events, while `state[0]` is True (CPython 3.11 only)."""
    ...
def set_rank(rank: int, world_size: int) -> str | None:
    """Replaces the rank and world size in the probe's metadata (what
    torch.distributed assigned); returns the new metadata JSON."""
    ...
def edit_unless_running(current_frames, code, sets: list, dels: list) -> bool:
    """Sets `(dict, key, value)` and deletes `(dict, key)` items, unless a
    thread's stack holds a frame of `code` (then nothing, and False);
    checked and done without running bytecode in between."""
    ...
def table_append(name: str, row: list) -> None:
    """Adds a row (ts in seconds first) to a table of the run store."""
    ...
def table_extend(name: str, rows: list) -> None: ...
def store_describe() -> str: ...
def table_tail(name: str, n: int) -> str:
    """The last `n` rows of a table in memory, as JSON text ({"columns", "rows"})."""
def store_flush() -> None: ...
def snapshot_rows(head: list, locals: list, spill_within: float) -> None:
    """A breakpoint hit's `python.snapshots` row (`head`: ts, id, bp_id, hit,
    thread, func, file, lineno, log) and its locals' `[name, repr, type]`."""
    ...
def gc_tracked() -> int:
    """How many objects the collector tracks (`len(gc.get_objects())`)."""
    ...
def memory_watch_cuda() -> None:
    """CUDA is in use: its figures join the memory timeline on the
    sampler's interval (a thread that takes the GIL for them)."""
    ...
def gc_instances(types: type | tuple[type, ...]) -> list:
    """The objects the collector tracks whose type is one of `types` (or a
    subclass), found without `gc.get_objects()`'s list of every object."""
    ...

class TensorScan:
    """A `python.tensors` scan's tables, 16 bytes a tensor: every live object
    of type `kind`, held until its row is handed out."""

    def __init__(self, kind: type) -> None: ...
    def __len__(self) -> int: ...
    def key(self, budget_s: float, address=None) -> bool:
        """Each tensor's storage key (`address(tensor)`, torch's
        `_storage_address`, where given); False if the budget ran out first."""
        ...
    def group(self, names: dict, containers: list) -> None:
        """One tensor per storage, preferring one in `names` (keyed by id)
        or an item of `containers`."""
        ...
    def largest_unnamed(self, n: int, size) -> list: ...
    def __iter__(self) -> TensorScan: ...
    def __next__(self) -> tuple:
        """(tensor, views, None or (container index, item index or key))."""
        ...

class FiniteCheck:
    """`FiniteCheck((float32, float64, float16, bfloat16))`; `check(tensors)`
    reads contiguous CPU tensors in place: whether every element is finite,
    or None where a tensor is not one it reads."""

    def __init__(self, dtypes: tuple) -> None: ...
    def check(self, tensors) -> bool | None: ...
    def check_grads(self, params, loss) -> bool | None: ...

class NanStep:
    """What the NaN watch keeps of the step in progress (nan_arm.rs)."""

    model: object
    args: object
    kwargs: object
    rng: object
    cuda_rng: object
    loss: object
    output: object
    loss_call: object
    def clear(self) -> None: ...

class NanArm:
    """`NanArm(finite_check, torch.Tensor, full_every)`: the armed NaN watch's
    state that the root stand-ins and the step clock read (nan_arm.rs)."""

    step: NanStep
    armed: bool
    searching: bool
    slow: bool
    loss_modules: bool
    checked_steps: int
    steps_seen: int
    sentinel_params: object
    models_seen: object
    def __init__(self, finite: FiniteCheck, tensor: type, full_every: int) -> None: ...
    def counted(self, step: int) -> None: ...

class CollectiveLog:
    """What every recorded collective shares (collective.rs): its groups,
    call sites, shapes and the rows in flight."""

    on: bool
    errors: int
    def __init__(self, group_info, tensors, shape_of, thread_name, step) -> None: ...
    def start(self, group_member: object, tensor: type) -> None: ...
    def stop(self) -> None: ...
    def groups(self) -> list[tuple[str, int, int, str, int, int, str | None]]:
        """(name, size, rank, members, count, last seq, last op) of each group seen."""
        ...
    def in_flight(self) -> list[tuple[str | None, str | None, int | None, float, str | None]]:
        """(group, op, seq, start ts, caller) of each call in flight."""
        ...

class CollectiveCall:
    """One collective function, recorded: called as `(args, kwargs)` by its
    Python wrapper."""

    op: str
    def __init__(self, log: CollectiveLog, op: str, original, group_at: int | None = None, async_at: int | None = None) -> None: ...
    def __call__(self, args: tuple, kwargs: dict): ...
