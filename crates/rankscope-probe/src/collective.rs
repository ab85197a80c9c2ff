//! A recorded collective's own work (collectives.py says what is recorded
//! and where the wrappers go): the group's number, the sizes, the call
//! site, and the row opened in the run store and closed when the call
//! returns or its future completes.
//!
//! Native because it runs on every collective of a job that started with
//! the probe: the Python version cost about 6 us a call (a row of 17 cells
//! made, converted and kept, a dict of rows in flight, two clock reads
//! through `time`), against a gloo `all_reduce` of 25-800 us
//! (docs/performance.md, "Recorded collectives made native"). The wrapper
//! itself stays a Python function, so that torch.compile still traces
//! through it to torch's own collective (its remapping of `dist.all_reduce`
//! to a functional collective goes by the function).
//!
//! A call's row is kept as fixed-size fields (`Call`), its texts by their
//! place in a table of texts made once (the op, the group, a shape, a call
//! site, a thread's name), and its cells are made only when the store asks
//! (`Shared::feed`: before a read of the table, and before each write to
//! disk, on the store's own thread). Right after a gloo call returns, all
//! the recording touches is cold; made at each call, the row's cells, its
//! copy for the calls in flight and the store's maps cost 3.7-3.8 us there
//! on this machine (25-29 us on another), against 2.5-2.6 us now, the same
//! as warm (docs/performance.md, "Recorded collectives, their rows made
//! later").
//!
//! Nothing of the program's changes: the call gets the program's arguments
//! as given, its result or its exception comes back untouched, and a
//! failure to record leaves the call unrecorded (counted in `errors`).
//! Groups are held weakly, so a group the program destroys is freed as
//! without rankscope. No lock is held while Python runs: a future's
//! callback may close a row on another thread at any time.
//!
//! Point-to-point calls (`send`, `recv`, `isend`, `irecv`) get rows too,
//! numbered apart: a send's `seq` is its number among this rank's sends to
//! that peer with that tag on that group, a receive's among its receives
//! from it, so that the k-th send of one rank pairs with the k-th receive
//! of the other (what `cluster bt` compares for a hung pipeline). torch's
//! `send` is made of its `isend` and a wait, and an object collective
//! (`broadcast_object_list`) of two collectives: a call made inside a
//! recorded call on the same thread is not recorded again (the outer row
//! takes the first inner call's number, the same on every rank). Gloo
//! counts point-to-point calls in the group's own number, on the two
//! ranks alone: where a backend does (seen at the first such call), the
//! collectives' numbers leave them out, so that they still agree across
//! the group's ranks; so are the sends and receives that gloo's
//! `monitored_barrier` is made of, more on rank 0 than on the others.

use std::cell::Cell as Flag;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockWriteGuard, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple, PyType, PyWeakrefReference};
use rankscope_store::{Cell, Store};

use crate::store;

const TABLE: &str = "collectives";
/// The cells (counted after ts) that a collective's end changes: state,
/// end_ts and duration_ms.
const STATE: usize = 6;
const END_TS: usize = 11;
const DURATION: usize = 12;
/// A point-to-point call's peer.
const PEER: usize = 16;
/// Caps on what is kept to make the next row cheaper: a program with more
/// call sites, shapes or thread names than this still gets every row, its
/// text its own.
const MAX_SITES: usize = 4096;
const MAX_SHAPES: usize = 1024;
const MAX_THREADS: usize = 1024;
const MAX_TEXTS: usize = 1 << 16;
/// Finished calls kept before they go to the store: the spill thread is
/// woken at half, and past all of them the calling thread hands them over
/// itself (a process without a run directory, or a spill thread that
/// cannot keep up).
const MAX_DONE: usize = 1024;
/// A call in flight this long (seconds) goes to the store as an open row
/// at its next write to disk, which keeps it in the in-flight folder (a
/// hung job's collective, read after it was killed).
const GIVE_AFTER_S: f64 = 0.5;

thread_local! {
    /// Inside a recorded call on this thread: torch's `send` calls its
    /// `isend`, which is one call, not two; `broadcast_object_list` its
    /// two `broadcast`s.
    static IN_CALL: Flag<bool> = const { Flag::new(false) };
}

/// Which way a point-to-point call goes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Way {
    Send,
    Recv,
}

/// What a point-to-point call is given, besides its tensor: where its
/// peer, the peer's rank in the group and its tag are, by position and name.
struct P2p {
    way: Way,
    peer: (Option<usize>, Py<PyString>),
    group_peer: (Option<usize>, Py<PyString>),
    tag: (Option<usize>, Py<PyString>),
}

/// A point-to-point call as given: which way, its peer (a global rank),
/// the peer's rank in the group, and its tag.
struct PeerCall {
    way: Way,
    peer: Option<i64>,
    group_peer: Option<i64>,
    tag: i64,
}

/// How a group is held: weakly, so that the program frees it as without
/// rankscope; one that cannot be referenced weakly is held (as the Python
/// recorder did), so that no other object takes its address.
enum Held {
    Weakly(Py<PyWeakrefReference>),
    Strongly(Py<PyAny>),
}

struct Group {
    of: Held,
    name: String,
    members: String,
    name_text: Text,
    members_text: Text,
    size: i64,
    rank: i64,
    seq: i64,
    count: i64,
    last_op: Option<String>,
    /// (way, peer, tag) -> point-to-point calls made so far.
    p2p: HashMap<(Way, Option<i64>, i64), i64>,
    /// Point-to-point calls that returned (what the backend may have counted).
    p2p_calls: i64,
    /// Whether the backend counts them in the group's number (None: not seen yet).
    p2p_in_seq: Option<bool>,
    /// Calls a recorded collective made on this rank alone, which moved
    /// the group's number further here than on the group's other ranks
    /// (gloo's `monitored_barrier` is sends and receives: 2(W-1) on rank
    /// 0, 2 on each other rank).
    inner_calls: i64,
}

/// A text of a recorded call: by its place in `Shared::texts` (made once,
/// shared by every call that has it), or its own (a list's shapes that
/// change from call to call, a call site past `MAX_SITES`).
#[derive(Clone, Default)]
enum Text {
    #[default]
    Null,
    At(u32),
    Own(Box<str>),
}

impl Text {
    fn cell(&self, texts: &[Box<str>]) -> Cell {
        match self {
            Text::Null => Cell::Null,
            Text::At(at) => texts
                .get(*at as usize)
                .map_or(Cell::Null, |t| Cell::Str(t.to_string())),
            Text::Own(text) => Cell::Str(text.to_string()),
        }
    }

    fn text(&self, texts: &[Box<str>]) -> Option<String> {
        match self.cell(texts) {
            Cell::Str(text) => Some(text),
            _ => None,
        }
    }
}

/// A recorded call, as fixed-size fields: its row's cells are made only
/// when the store asks for them (`feed`), off the calling thread where
/// the store spills.
#[derive(Clone)]
struct Call {
    ts: f64,
    seq: Option<i64>,
    op: Text,
    group: Text,
    size: i64,
    rank: i64,
    members: Text,
    state: &'static str,
    shapes: Text,
    dtype: Text,
    bytes: Option<i64>,
    asynchronous: bool,
    end_us: Option<i64>,
    duration_ms: Option<f64>,
    caller: Text,
    thread: Text,
    step: Option<i64>,
    peer: Option<i64>,
    tag: Option<i64>,
    /// Handed to the store as an open row (a read came while it was in
    /// flight): its end goes there as the cells that changed.
    given: bool,
}

impl Call {
    /// The row's cells, in the table's order (after ts).
    fn cells(&self, texts: &[Box<str>]) -> Vec<Cell> {
        let int = |v: Option<i64>| v.map_or(Cell::Null, Cell::Int);
        vec![
            int(self.seq),
            self.op.cell(texts),
            self.group.cell(texts),
            Cell::Int(self.size),
            Cell::Int(self.rank),
            self.members.cell(texts),
            Cell::Str(self.state.to_string()),
            self.shapes.cell(texts),
            self.dtype.cell(texts),
            int(self.bytes),
            Cell::Bool(self.asynchronous),
            int(self.end_us),
            self.duration_ms.map_or(Cell::Null, Cell::Float),
            self.caller.cell(texts),
            self.thread.cell(texts),
            int(self.step),
            int(self.peer),
            int(self.tag),
        ]
    }

    /// The cells that may have changed since the row was opened.
    fn changes(&self) -> Vec<(usize, Cell)> {
        let int = |v: Option<i64>| v.map_or(Cell::Null, Cell::Int);
        vec![
            (0, int(self.seq)),
            (STATE, Cell::Str(self.state.to_string())),
            (END_TS, int(self.end_us)),
            (DURATION, self.duration_ms.map_or(Cell::Null, Cell::Float)),
            (PEER, int(self.peer)),
        ]
    }
}

#[derive(Default)]
struct Calls {
    /// The process these calls are of: a child after fork (a DataLoader
    /// worker) starts with none, not its parent's (see `Shared::calls`).
    pid: u32,
    open: HashMap<u64, Call>,
    done: Vec<(u64, Call)>,
    /// The buffer `done` is swapped with when the store takes the calls,
    /// its room kept: no allocation on the calling thread once warm.
    spare: Vec<(u64, Call)>,
}

/// What the recording shares with the store's spill thread, which makes
/// the rows: nothing of Python's, so that it is read without the GIL.
#[derive(Default)]
struct Shared {
    /// Append-only: a `Text::At` stays valid.
    texts: RwLock<Vec<Box<str>>>,
    calls: Mutex<Calls>,
    /// One hand-over at a time: a call opened in the store by a read must
    /// not be finished there by another hand-over before it is opened.
    feeding: Mutex<()>,
    errors: AtomicU64,
}

/// Every log's shared part (one in a process, but tests and benches make more).
static LOGS: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());
/// The process that started the store's spill thread for these rows (a
/// child after fork has a store of its own).
static FED_IN: AtomicU32 = AtomicU32::new(0);

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The recording's locks, held across a fork (`store::hold_across_fork`):
/// a child has only the thread that forked, so a lock the spill thread
/// held in the middle of a feed would stay held in it for good, and the
/// child's first collective, or its store's first feed, would wait forever.
pub(crate) struct ForkHold {
    // Dropped in this order: the logs' locks, then the list's.
    _held: Vec<HeldLog>,
    _logs: MutexGuard<'static, Vec<Weak<Shared>>>,
}

struct HeldLog {
    // Declared before `_shared`, so dropped while what they borrow lives.
    _feeding: MutexGuard<'static, ()>,
    _calls: MutexGuard<'static, Calls>,
    _texts: RwLockWriteGuard<'static, Vec<Box<str>>>,
    _shared: Arc<Shared>,
}

/// Takes every log's locks in the order the feed takes them (the list,
/// then each log's `feeding`, `calls`, `texts`); no holder of one of them
/// waits for the GIL, which the forking thread may hold.
pub(crate) fn hold_for_fork() -> ForkHold {
    let logs = locked(&LOGS);
    let held = logs
        .iter()
        .filter_map(Weak::upgrade)
        .map(|shared| {
            // SAFETY: the `Shared` lives while `_shared` does, and the
            // guards that borrow it are dropped before `_shared` is.
            let at: &'static Shared = unsafe { &*Arc::as_ptr(&shared) };
            HeldLog {
                _feeding: locked(&at.feeding),
                _calls: locked(&at.calls),
                _texts: at.texts.write().unwrap_or_else(|e| e.into_inner()),
                _shared: shared,
            }
        })
        .collect();
    ForkHold {
        _held: held,
        _logs: logs,
    }
}

impl Shared {
    fn calls(&self) -> std::sync::MutexGuard<'_, Calls> {
        let mut calls = locked(&self.calls);
        let pid = store::this_pid();
        if calls.pid != pid {
            calls.pid = pid;
            calls.open.clear();
            calls.done.clear();
        }
        calls
    }

    fn text(&self, text: &str) -> Text {
        let mut texts = self.texts.write().unwrap_or_else(|e| e.into_inner());
        if texts.len() >= MAX_TEXTS {
            return Text::Own(text.into());
        }
        texts.push(text.into());
        Text::At((texts.len() - 1) as u32)
    }

    /// Hands the finished calls to the store, and, where `reading`, the
    /// ones in flight as open rows.
    fn feed(&self, store: &Arc<Store>, reading: bool) {
        let _one = locked(&self.feeding);
        let (mut done, opened) = {
            let mut calls = self.calls();
            let spare = std::mem::take(&mut calls.spare);
            let done = std::mem::replace(&mut calls.done, spare);
            // A read shows every call in flight; the disk gets the ones
            // in flight for a while (a hang), as the store writes them.
            let before = if reading {
                f64::INFINITY
            } else {
                now_s() - GIVE_AFTER_S
            };
            let opened: Vec<(u64, Call)> = if calls.open.is_empty() {
                Vec::new()
            } else {
                calls
                    .open
                    .iter_mut()
                    .filter(|(_, c)| !c.given && c.ts <= before)
                    .map(|(key, call)| {
                        call.given = true;
                        (*key, call.clone())
                    })
                    .collect()
            };
            (done, opened)
        };
        if done.is_empty() && opened.is_empty() {
            return;
        }
        let mut rows = Vec::with_capacity(done.len());
        {
            let texts = self.texts.read().unwrap_or_else(|e| e.into_inner());
            for (key, call) in done.drain(..) {
                if call.given {
                    match store.finish_row(TABLE, key, call.changes()) {
                        Ok(true) => continue,
                        // Dropped from the store's open rows (thousands in
                        // flight at once): the row goes in whole.
                        Ok(false) => {}
                        Err(_) => {
                            self.errors.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                    }
                }
                rows.push((call.ts, call.cells(&texts)));
            }
            let mut opened = opened;
            opened.sort_by_key(|(key, _)| *key);
            for (key, call) in opened {
                if store
                    .open_row(TABLE, key, call.ts, call.cells(&texts))
                    .is_err()
                {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let count = rows.len() as u64;
        if !rows.is_empty() && store.append_rows(TABLE, rows).is_err() {
            self.errors.fetch_add(count, Ordering::Relaxed);
        }
        // The emptied buffer, its room kept, is the next spare.
        let mut calls = self.calls();
        if calls.spare.capacity() < done.capacity() {
            calls.spare = done;
        }
    }
}

/// The store's `Feed` (store.rs sets it): every log's calls, for a read
/// of `python.collectives` or a write to disk.
pub(crate) fn feed_all(store: &Arc<Store>, table: Option<&'static str>, reading: bool) {
    if table.is_some_and(|t| t != TABLE) {
        return;
    }
    let logs: Vec<Arc<Shared>> = {
        let mut logs = locked(&LOGS);
        logs.retain(|l| l.strong_count() > 0);
        logs.iter().filter_map(Weak::upgrade).collect()
    };
    for log in logs {
        log.feed(store, reading);
    }
}

/// A cache of texts, each with the object it came from held.
type Kept<K> = HashMap<K, (Py<PyAny>, Text)>;

#[derive(Default)]
struct State {
    groups: HashMap<usize, Group>,
    /// The groups' addresses in the order first seen (what `torch
    /// collectives` lists).
    order: Vec<usize>,
    /// (code object's address, instruction) -> "func (file:line)"; the
    /// code object is kept, so that its address is not reused.
    sites: Kept<(usize, i64)>,
    /// A thread's name (the str object `threading` keeps, held so that its
    /// address is not reused) -> its text.
    threads: Kept<usize>,
    /// How many groups each name was given to: torch names a default group
    /// made again (after `destroy_process_group`) "0" again, and numbers
    /// its collectives from 1 again.
    names: HashMap<String, u32>,
}

/// `CollectiveLog(group_info, tensors, shape_of, thread_name, step)`:
/// what every recorded collective shares. The callables are collectives.py's:
/// `group_info(group)` -> (name, members, size, rank) for a group seen for
/// the first time (None: the default group); `tensors(first)` -> (shapes,
/// dtype, bytes) of a first argument that is not a tensor; `shape_of(t)`
/// -> (shapes, dtype, bytes an item) of a tensor shape not seen before;
/// `thread_name()`; `step()`: the torch step or None.
/// What `groups()` says of a group: (name, size, rank, members, count,
/// last seq, last op).
type GroupSeen = (String, i64, i64, String, i64, i64, Option<String>);
/// What `in_flight()` says of a call: (group, op, seq, start ts, caller,
/// peer).
type Flying = (
    Option<String>,
    Option<String>,
    Option<i64>,
    f64,
    Option<String>,
    Option<i64>,
);

#[pyclass(module = "rankscope._native", frozen)]
pub struct CollectiveLog {
    on: AtomicBool,
    errors: AtomicU64,
    keys: AtomicU64,
    group_info: Py<PyAny>,
    tensors: Py<PyAny>,
    shape_of: Py<PyAny>,
    thread_name: Py<PyAny>,
    step: Py<PyAny>,
    /// (shape, dtype) -> (shapes' text, dtype's text, bytes an item), the
    /// texts by their place in `shared.texts` (-1: none).
    shapes: Py<PyDict>,
    /// Set by `start`: `distributed_c10d.GroupMember` (whose `WORLD` is the
    /// default group) and `torch.Tensor`.
    /// (The same two objects for the process's life: set once.)
    torch: OnceLock<(Py<PyAny>, Py<PyType>)>,
    state: Mutex<State>,
    shared: Arc<Shared>,
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl CollectiveLog {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The group a call goes to (the default one for None), and its entry
    /// in `groups`, made on first sight.
    fn group<'py>(
        &self,
        py: Python<'py>,
        group: Option<Bound<'py, PyAny>>,
        member: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, usize)> {
        let group = match group.filter(|g| !g.is_none()) {
            Some(group) => group,
            // The default group, without c10d's checks on every call; a
            // new default group (after destroy_process_group) is a new
            // object. Not made yet: group_info raises as the call would.
            None => member.getattr(intern!(py, "WORLD"))?,
        };
        let at = group.as_ptr() as usize;
        let known = {
            let state = self.state();
            state.groups.get(&at).is_some_and(|g| match &g.of {
                // A new group at a freed one's address is not taken for it.
                Held::Weakly(of) => of.bind(py).upgrade().is_some_and(|o| o.is(&group)),
                Held::Strongly(of) => of.bind(py).is(&group),
            })
        };
        if !known {
            let (name, members, size, rank): (String, String, i64, i64) =
                self.group_info.bind(py).call1((&group,))?.extract()?;
            let of = match PyWeakrefReference::new(&group) {
                Ok(weak) => Held::Weakly(weak.unbind()),
                Err(_) => Held::Strongly(group.clone().unbind()),
            };
            let mut state = self.state();
            // A name given before is told apart ("0#2"), the same way on
            // every rank (each makes its groups again in the same order), so
            // that the old group's rows are not taken for the new one's.
            let uses = state.names.entry(name.clone()).or_insert(0);
            *uses += 1;
            let name = if *uses > 1 {
                format!("{name}#{uses}")
            } else {
                name
            };
            let name_text = self.shared.text(&name);
            let members_text = self.shared.text(&members);
            state.order.retain(|&a| a != at);
            state.order.push(at);
            let old = state.groups.insert(
                at,
                Group {
                    of,
                    name,
                    members,
                    name_text,
                    members_text,
                    size,
                    rank,
                    seq: 0,
                    count: 0,
                    last_op: None,
                    p2p: HashMap::new(),
                    p2p_calls: 0,
                    p2p_in_seq: None,
                    inner_calls: 0,
                },
            );
            // The lock first: the group let go may be freed, and run code.
            drop(state);
            drop(old);
        }
        Ok((group, at))
    }

    /// (shapes, dtype, bytes) of what the call moves: its first argument.
    fn sizes<'py>(
        &self,
        py: Python<'py>,
        first: Option<Bound<'py, PyAny>>,
        tensor: &Bound<'py, PyType>,
    ) -> PyResult<(Text, Text, Option<i64>)> {
        let Some(first) = first else {
            return Ok((Text::Null, Text::Null, None));
        };
        // type(), not isinstance(): an object list's items may be anything.
        if !first.get_type().is_subclass(tensor)? {
            let (shapes, dtype, size): (Option<String>, Option<String>, Option<i64>) =
                self.tensors.bind(py).call1((&first,))?.extract()?;
            let own = |t: Option<String>| t.map_or(Text::Null, |t| Text::Own(t.into()));
            return Ok((own(shapes), own(dtype), size));
        }
        let key = PyTuple::new(
            py,
            [
                first.getattr(intern!(py, "shape"))?,
                first.getattr(intern!(py, "dtype"))?,
            ],
        )?;
        let shapes = self.shapes.bind(py);
        let at = |i: i64| u32::try_from(i).map_or(Text::Null, Text::At);
        let (shape_text, dtype_text, item) = match shapes.get_item(&key)? {
            Some(known) => {
                let (shape, dtype, item): (i64, i64, i64) = known.extract()?;
                (at(shape), at(dtype), item)
            }
            None => {
                // A loop sends the same shape again and again: its texts are
                // made once.
                let (text, dtype, item): (Option<String>, Option<String>, i64) =
                    self.shape_of.bind(py).call1((&first,))?.extract()?;
                // Past the cap the texts are the call's own: made again at
                // each call, they would fill the table of texts.
                let keep = shapes.len() < MAX_SHAPES;
                let made = |t: Option<String>| match t {
                    None => Text::Null,
                    Some(t) if keep => self.shared.text(&t),
                    Some(t) => Text::Own(t.into()),
                };
                let (text, dtype) = (made(text), made(dtype));
                let place = |t: &Text| match t {
                    Text::At(at) => Some(i64::from(*at)),
                    _ => None,
                };
                if let (Some(shape_at), Some(dtype_at)) = (place(&text), place(&dtype)) {
                    shapes.set_item(&key, (shape_at, dtype_at, item))?;
                }
                (text, dtype, item)
            }
        };
        let numel: i64 = first.call_method0(intern!(py, "numel"))?.extract()?;
        Ok((shape_text, dtype_text, Some(numel * item)))
    }

    /// "func (file:line)" of the program's line that called the wrapper.
    fn caller(&self, py: Python<'_>) -> PyResult<Text> {
        // SAFETY: the GIL is held; the frame is borrowed, and owned (with
        // a new reference) before anything else runs.
        let wrapper = unsafe {
            Bound::from_borrowed_ptr_or_opt(
                py,
                pyo3::ffi::PyEval_GetFrame() as *mut pyo3::ffi::PyObject,
            )
        };
        // The running frame is the Python wrapper's; the program's is the one before.
        let Some(mut frame) = wrapper
            .map(|w| w.getattr(intern!(py, "f_back")))
            .transpose()?
            .filter(|f| !f.is_none())
        else {
            return Ok(Text::Null);
        };
        // A call torch.distributed makes itself (`batch_isend_irecv`'s
        // sends, an object collective's parts) is the program's call where
        // the program made it: torch's frames are walked past, each kept
        // in the cache as one to pass (a `Null` site).
        let mut passed = 0;
        let (code, file, key) = loop {
            let code = frame.getattr(intern!(py, "f_code"))?;
            // By instruction, not line: a line number is looked up in the
            // code's line table, which costs more than the rest of the site.
            let lasti: i64 = frame.getattr(intern!(py, "f_lasti"))?.extract()?;
            let key = (code.as_ptr() as usize, lasti);
            let kept = self.state().sites.get(&key).map(|(_, site)| site.clone());
            let internal = match kept {
                Some(Text::Null) => true,
                Some(site) => return Ok(site),
                None => false,
            };
            // Lossy: a file name that is not valid UTF-8 (a directory named
            // in latin-1) still gives a row.
            let file = if internal {
                String::new()
            } else {
                code.getattr(intern!(py, "co_filename"))?
                    .str()?
                    .to_string_lossy()
                    .into_owned()
            };
            let back = frame.getattr(intern!(py, "f_back"))?;
            if (internal || file.contains("/torch/distributed/")) && !back.is_none() && passed < 8 {
                if !internal && self.state().sites.len() < MAX_SITES {
                    self.state().sites.insert(key, (code.unbind(), Text::Null));
                }
                passed += 1;
                frame = back;
                continue;
            }
            if internal {
                // (Past the frames it may walk: named as torch's own.)
                return Ok(Text::Null);
            }
            break (code, file, key);
        };
        let name = code
            .getattr(intern!(py, "co_name"))?
            .str()?
            .to_string_lossy()
            .into_owned();
        let line = frame.getattr(intern!(py, "f_lineno"))?;
        let base = std::path::Path::new(&file)
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or(file);
        let site = format!("{name} ({base}:{line})");
        Ok(self.keep(|s| &mut s.sites, MAX_SITES, key, code.unbind(), &site))
    }

    /// `text` made once and kept under `key` in the cache `of` picks, with
    /// the object it came from held (so that its address is not reused);
    /// past `cap` entries, the call's own.
    fn keep<K: std::hash::Hash + Eq>(
        &self,
        of: fn(&mut State) -> &mut Kept<K>,
        cap: usize,
        key: K,
        held: Py<PyAny>,
        text: &str,
    ) -> Text {
        if of(&mut self.state()).len() >= cap {
            return Text::Own(text.into());
        }
        let made = self.shared.text(text);
        of(&mut self.state()).insert(key, (held, made.clone()));
        made
    }

    /// The calling thread's name, as `threading` has it now: the same str
    /// object call after call, so that its text is made once.
    fn thread(&self, py: Python<'_>) -> PyResult<Text> {
        let name = self.thread_name.bind(py).call0()?;
        if name.is_none() {
            return Ok(Text::Null);
        }
        let at = name.as_ptr() as usize;
        if let Some((_, text)) = self.state().threads.get(&at) {
            return Ok(text.clone());
        }
        let Ok(text) = name.extract::<String>() else {
            return Ok(Text::Null);
        };
        Ok(self.keep(|s| &mut s.threads, MAX_THREADS, at, name.unbind(), &text))
    }

    /// Opens the call's row: its key and start, the group, and torch's
    /// number of the group before the call.
    #[allow(clippy::type_complexity)]
    fn enter<'py>(
        &self,
        py: Python<'py>,
        op: (&str, &Text),
        group: Option<Bound<'py, PyAny>>,
        asynchronous: bool,
        first: Option<Bound<'py, PyAny>>,
        p2p: Option<PeerCall>,
    ) -> PyResult<(u64, Instant, Bound<'py, PyAny>, Option<i64>)> {
        let Some((member, tensor)) = self.torch.get() else {
            return Err(PyException::new_err("collectives: not started"));
        };
        let (group, at) = self.group(py, group, member.bind(py))?;
        // torch's own number, which counts every collective of the group
        // (DDP's too) alike on every rank, and is what Flight Recorder says.
        let torch_seq = match group.call_method0(intern!(py, "_get_sequence_number_for_group")) {
            Ok(seq) => seq.extract::<i64>().ok(),
            Err(e) if e.is_instance_of::<PyException>(py) => None,
            Err(e) => return Err(e),
        };
        let (shapes, dtype, bytes) = self.sizes(py, first, tensor.bind(py))?;
        let caller = self.caller(py)?;
        let thread = self.thread(py)?;
        let step = self.step.bind(py).call0()?;
        let step: Option<i64> = (!step.is_none()).then(|| step.extract().ok()).flatten();
        let key = self.keys.fetch_add(1, Ordering::Relaxed);
        let ts = now_s();
        let call = {
            let mut state = self.state();
            let Some(info) = state.groups.get_mut(&at) else {
                return Err(PyException::new_err("collectives: group forgotten"));
            };
            info.count += 1;
            let (seq, peer, tag) = match p2p {
                Some(call) => {
                    // The peer as a global rank, as `dst`/`src` are given.
                    let peer = call.peer.or_else(|| {
                        let at = usize::try_from(call.group_peer?).ok()?;
                        info.members.split(',').nth(at)?.trim().parse().ok()
                    });
                    let count = info.p2p.entry((call.way, peer, call.tag)).or_insert(0);
                    *count += 1;
                    (*count, peer, Some(call.tag))
                }
                None => {
                    // Point-to-point calls the backend counted, on this rank
                    // alone, are left out (gloo's), and a backend without its
                    // own number is counted here.
                    let p2p = if info.p2p_in_seq == Some(true) {
                        info.p2p_calls
                    } else {
                        0
                    };
                    info.seq = torch_seq
                        .map(|s| s + 1 - p2p - info.inner_calls)
                        .unwrap_or(info.seq + 1);
                    if info.last_op.as_deref() != Some(op.0) {
                        info.last_op = Some(op.0.to_string());
                    }
                    (info.seq, None, None)
                }
            };
            Call {
                ts,
                seq: Some(seq),
                op: op.1.clone(),
                group: info.name_text.clone(),
                size: info.size,
                rank: info.rank,
                members: info.members_text.clone(),
                state: "in flight",
                shapes,
                dtype,
                bytes,
                asynchronous,
                end_us: None,
                duration_ms: None,
                caller,
                thread,
                step,
                peer,
                tag,
                given: false,
            }
        };
        if FED_IN.load(Ordering::Relaxed) != store::this_pid() {
            // The first call of this process: the store made now, with its
            // feed, so that a first call that hangs is read as in flight.
            self.begin();
        }
        self.shared.calls().open.insert(key, call);
        Ok((key, Instant::now(), group, torch_seq))
    }

    /// After a point-to-point call returned: counted, and whether the
    /// backend counts such calls in the group's number learnt at the first.
    fn p2p_returned(&self, py: Python<'_>, group: &Bound<'_, PyAny>, before: Option<i64>) {
        let at = group.as_ptr() as usize;
        let unknown = self
            .state()
            .groups
            .get(&at)
            .is_some_and(|g| g.p2p_in_seq.is_none());
        let counted = match (unknown, before) {
            (true, Some(before)) => group
                .call_method0(intern!(py, "_get_sequence_number_for_group"))
                .and_then(|s| s.extract::<i64>())
                .ok()
                .map(|after| after > before),
            _ => None,
        };
        let mut state = self.state();
        if let Some(info) = state.groups.get_mut(&at) {
            info.p2p_calls += 1;
            if info.p2p_in_seq.is_none() {
                info.p2p_in_seq = counted.or(Some(false));
            }
        }
    }

    /// After a `monitored_barrier` (returned or failed): it moved the
    /// group's number by two on a rank other than 0, and Flight Recorder's
    /// number by two on every rank; what it moved it by past two (rank 0's
    /// further sends and receives) is left out from now on, so that the
    /// numbers agree across the group and with Flight Recorder's.
    fn inner_calls_made(&self, py: Python<'_>, group: &Bound<'_, PyAny>, before: Option<i64>) {
        let Some(before) = before else { return };
        let Ok(after) = group
            .call_method0(intern!(py, "_get_sequence_number_for_group"))
            .and_then(|s| s.extract::<i64>())
        else {
            return;
        };
        if after - before > 2 {
            if let Some(info) = self.state().groups.get_mut(&(group.as_ptr() as usize)) {
                info.inner_calls += after - before - 2;
            }
        }
    }

    fn close(&self, key: u64, began: Instant, state: &'static str) {
        self.close_with(key, began, state, |_| {});
    }

    /// A receive from any rank (`recv(t)` with no `src`) returned `src`:
    /// its row is numbered among the receives from that rank (it was among
    /// those from none), so that it pairs with the send it took.
    fn received_from(&self, group: &Bound<'_, PyAny>, key: u64, src: i64, tag: i64) {
        let at = group.as_ptr() as usize;
        let count = {
            let mut state = self.state();
            let Some(info) = state.groups.get_mut(&at) else {
                return;
            };
            if let Some(unknown) = info.p2p.get_mut(&(Way::Recv, None, tag)) {
                *unknown = unknown.saturating_sub(1);
            }
            let count = info.p2p.entry((Way::Recv, Some(src), tag)).or_insert(0);
            *count += 1;
            *count
        };
        if let Some(call) = self.shared.calls().open.get_mut(&key) {
            call.seq = Some(count);
            call.peer = Some(src);
        }
    }

    /// The call `key` ended (`state`), `change` made to its row: it goes to
    /// the finished ones, which the store takes in a batch.
    fn close_with(
        &self,
        key: u64,
        began: Instant,
        state: &'static str,
        change: impl FnOnce(&mut Call),
    ) {
        let end_us = (now_s() * 1e6).round() as i64;
        let duration_ms = began.elapsed().as_secs_f64() * 1e3;
        let waiting = {
            let mut calls = self.shared.calls();
            let Some(mut call) = calls.open.remove(&key) else {
                return;
            };
            call.state = state;
            call.end_us = Some(end_us);
            call.duration_ms = Some(duration_ms);
            change(&mut call);
            if calls.done.capacity() == 0 {
                calls.done.reserve(MAX_DONE);
            }
            calls.done.push((key, call));
            calls.done.len()
        };
        if waiting == MAX_DONE / 2 || waiting >= MAX_DONE {
            self.hand_over(waiting);
        }
    }

    /// The store of this process made (with its feed), and its spill
    /// thread started, which takes the calls from then on.
    fn begin(&self) {
        let store = store::store();
        FED_IN.store(store::this_pid(), Ordering::Relaxed);
        if store.spills() {
            store.spill_soon(std::time::Duration::from_secs(1));
        }
    }

    /// The finished calls go to the store: the spill thread is woken to
    /// take them at half the room; with no spill thread, or none that
    /// kept up, this thread hands them over itself.
    fn hand_over(&self, waiting: usize) {
        let store = store::store();
        if waiting >= MAX_DONE || !store.spills() {
            if waiting >= MAX_DONE {
                self.shared.feed(&store, false);
            }
            return;
        }
        store.spill_soon(std::time::Duration::ZERO);
    }

    /// After the call returned: an `async_op` call is closed when its
    /// work's future completes, where the backend gives one.
    /// An error that is not an `Exception` (KeyboardInterrupt from the
    /// program's signal handler) goes on to the program, as it went
    /// through the Python recorder; the row is then closed as issued.
    fn leave(
        slf: &Bound<'_, Self>,
        key: u64,
        began: Instant,
        asynchronous: bool,
        result: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let me = slf.get();
        if !asynchronous {
            me.close(key, began, "done");
            return Ok(());
        }
        let py = slf.py();
        let waited = (|| -> PyResult<bool> {
            let Some(get) = result.getattr_opt(intern!(py, "get_future"))? else {
                return Ok(false);
            };
            let future = get.call0()?;
            let end = Py::new(
                py,
                CollectiveEnd {
                    log: slf.clone().unbind(),
                    key,
                    began,
                },
            )?;
            future.call_method1(intern!(py, "add_done_callback"), (end,))?;
            Ok(true)
        })();
        match waited {
            Ok(true) => Ok(()),
            Ok(false) => {
                // A backend without futures: closed as issued.
                me.close(key, began, "issued");
                Ok(())
            }
            Err(e) => {
                me.close(key, began, "issued");
                if e.is_instance_of::<PyException>(py) {
                    Ok(())
                } else {
                    Err(e)
                }
            }
        }
    }
}

#[pymethods]
impl CollectiveLog {
    #[new]
    fn new(
        py: Python<'_>,
        group_info: Py<PyAny>,
        tensors: Py<PyAny>,
        shape_of: Py<PyAny>,
        thread_name: Py<PyAny>,
        step: Py<PyAny>,
    ) -> Self {
        CollectiveLog {
            on: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            keys: AtomicU64::new(1),
            group_info,
            tensors,
            shape_of,
            thread_name,
            step,
            shapes: PyDict::new(py).unbind(),
            torch: OnceLock::new(),
            state: Mutex::new(State::default()),
            shared: {
                let shared = Arc::new(Shared::default());
                locked(&LOGS).push(Arc::downgrade(&shared));
                shared
            },
        }
    }

    /// Records from now on: `group_member` is `distributed_c10d.GroupMember`,
    /// `tensor` is `torch.Tensor`.
    fn start(&self, group_member: Py<PyAny>, tensor: Py<PyType>) {
        // A second start gives the same two objects: they stay as set.
        let _ = self.torch.set((group_member, tensor));
        self.on.store(true, Ordering::Release);
    }

    fn stop(&self) {
        self.on.store(false, Ordering::Release);
    }

    #[getter]
    fn on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    #[getter]
    fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed) + self.shared.errors.load(Ordering::Relaxed)
    }

    /// Each group seen: (name, size, rank, members, count, last seq, last op).
    fn groups(&self) -> Vec<GroupSeen> {
        let state = self.state();
        state
            .order
            .iter()
            .filter_map(|at| state.groups.get(at))
            .map(|g| {
                (
                    g.name.clone(),
                    g.size,
                    g.rank,
                    g.members.clone(),
                    g.count,
                    g.seq,
                    g.last_op.clone(),
                )
            })
            .collect()
    }

    /// Each call in flight: (group, op, seq, start ts, caller, peer), the
    /// oldest first.
    fn in_flight(&self) -> Vec<Flying> {
        let mut open: Vec<(u64, Call)> = self
            .shared
            .calls()
            .open
            .iter()
            .map(|(key, call)| (*key, call.clone()))
            .collect();
        open.sort_by_key(|(key, _)| *key);
        let texts = self.shared.texts.read().unwrap_or_else(|e| e.into_inner());
        open.into_iter()
            .map(|(_, c)| {
                (
                    c.group.text(&texts),
                    c.op.text(&texts),
                    c.seq,
                    c.ts,
                    c.caller.text(&texts),
                    c.peer,
                )
            })
            .collect()
    }
}

/// `CollectiveCall(log, op, original, group_at, async_at)(args, kwargs)`:
/// one collective function, recorded; called by its Python wrapper with
/// the program's arguments as they came.
#[pyclass(module = "rankscope._native", frozen)]
pub struct CollectiveCall {
    log: Py<CollectiveLog>,
    op: String,
    /// The op's text in the log's.
    op_text: Text,
    original: Py<PyAny>,
    group_at: Option<usize>,
    async_at: Option<usize>,
    /// The name of the op's first parameter (`tensor_list` for
    /// `all_gather`, `output` for `reduce_scatter_tensor`): given by
    /// keyword, the same argument is read as given by position, so that a
    /// call's `bytes` does not depend on how it was written.
    first_name: Option<Py<PyString>>,
    /// A point-to-point call's way and where its peer and tag are given.
    p2p: Option<P2p>,
}

/// Resets the thread's flag when the call ends, however.
struct InCall;

impl Drop for InCall {
    fn drop(&mut self) {
        IN_CALL.with(|f| f.set(false));
    }
}

#[pymethods]
impl CollectiveCall {
    /// `p2p`: for a point-to-point call, (way, (peer's position, name),
    /// (the group peer's position, name), (tag's position, name)), way
    /// being "send" or "recv".
    #[new]
    #[pyo3(signature = (log, op, original, group_at=None, async_at=None, first_name=None, p2p=None))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn new(
        py: Python<'_>,
        log: Py<CollectiveLog>,
        op: String,
        original: Py<PyAny>,
        group_at: Option<usize>,
        async_at: Option<usize>,
        first_name: Option<&str>,
        p2p: Option<(
            String,
            (Option<usize>, String),
            (Option<usize>, String),
            (Option<usize>, String),
        )>,
    ) -> PyResult<Self> {
        let name = |n: &str| PyString::intern(py, n).unbind();
        let p2p = match p2p {
            None => None,
            Some((way, peer, group_peer, tag)) => Some(P2p {
                way: match way.as_str() {
                    "send" => Way::Send,
                    "recv" => Way::Recv,
                    other => {
                        return Err(pyo3::exceptions::PyValueError::new_err(format!(
                            "a point-to-point call sends or receives, not {other:?}"
                        )))
                    }
                },
                peer: (peer.0, name(&peer.1)),
                group_peer: (group_peer.0, name(&group_peer.1)),
                tag: (tag.0, name(&tag.1)),
            }),
        };
        let op_text = log.bind(py).get().shared.text(&op);
        Ok(CollectiveCall {
            log,
            op,
            op_text,
            original,
            group_at,
            async_at,
            // Interned: a keyword call's lookup hashes no new string.
            first_name: first_name.map(name),
            p2p,
        })
    }

    fn __call__<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let original = self.original.bind(py);
        let kw = (!kwargs.is_empty()).then_some(kwargs);
        let log = self.log.bind(py);
        if !log.get().on.load(Ordering::Acquire) || IN_CALL.with(|f| f.get()) {
            return original.call(args, kw);
        }
        let entry = match self.arguments(py, args, kwargs) {
            Ok((group, asynchronous, first)) => {
                // isend and irecv are async without being asked.
                let asynchronous = asynchronous || (self.p2p.is_some() && self.op.starts_with('i'));
                let p2p = match &self.p2p {
                    Some(p2p) => match self.peer_call(py, p2p, args, kwargs) {
                        Ok(call) => Some(call),
                        Err(e) if e.is_instance_of::<PyException>(py) => None,
                        Err(e) => return Err(e),
                    },
                    None => None,
                };
                if self.p2p.is_some() && p2p.is_none() {
                    None
                } else {
                    // A blocking receive from any rank: its peer is what it returns.
                    let any_source = p2p
                        .as_ref()
                        .filter(|c| {
                            self.op == "recv"
                                && c.way == Way::Recv
                                && c.peer.is_none()
                                && c.group_peer.is_none()
                        })
                        .map(|c| c.tag);
                    match log.get().enter(
                        py,
                        (&self.op, &self.op_text),
                        group,
                        asynchronous,
                        first,
                        p2p,
                    ) {
                        Ok(opened) => Some((opened, asynchronous, any_source)),
                        Err(e) if e.is_instance_of::<PyException>(py) => None,
                        Err(e) => return Err(e),
                    }
                }
            }
            Err(e) if e.is_instance_of::<PyException>(py) => None,
            Err(e) => return Err(e),
        };
        if entry.is_none() {
            // The call goes on unrecorded.
            log.get().errors.fetch_add(1, Ordering::Relaxed);
        }
        let result = {
            let _inside = entry.is_some().then(|| {
                IN_CALL.with(|f| f.set(true));
                InCall
            });
            original.call(args, kw)
        };
        if let Some(((key, began, group, before), asynchronous, any_source)) = entry {
            if self.op == "monitored_barrier" {
                log.get().inner_calls_made(py, &group, before);
            }
            match &result {
                Ok(out) => {
                    if self.p2p.is_some() {
                        log.get().p2p_returned(py, &group, before);
                    }
                    match (any_source, out.extract::<i64>()) {
                        (Some(tag), Ok(src)) => {
                            log.get().received_from(&group, key, src, tag);
                            log.get().close(key, began, "done");
                        }
                        _ => CollectiveLog::leave(log, key, began, asynchronous, out)?,
                    }
                }
                Err(_) => {
                    // Refused before it reached the group (a bad argument):
                    // torch's number did not move, and the row takes none,
                    // which the next call takes.
                    let unmoved = self.p2p.is_none()
                        && before.is_some()
                        && group
                            .call_method0(intern!(py, "_get_sequence_number_for_group"))
                            .and_then(|s| s.extract::<i64>())
                            .ok()
                            == before;
                    log.get().close_with(key, began, "failed", |call| {
                        if unmoved {
                            call.seq = None;
                        }
                    });
                }
            }
        }
        result
    }

    #[getter]
    fn op(&self) -> &str {
        &self.op
    }
}

impl CollectiveCall {
    /// A point-to-point call's peer, group peer and tag, as given.
    fn peer_call<'py>(
        &self,
        py: Python<'py>,
        p2p: &P2p,
        args: &Bound<'py, PyTuple>,
        kwargs: &Bound<'py, PyDict>,
    ) -> PyResult<PeerCall> {
        let given = |(at, name): &(Option<usize>, Py<PyString>)| -> PyResult<Option<i64>> {
            let value = match (!kwargs.is_empty())
                .then(|| kwargs.get_item(name.bind(py)))
                .transpose()?
                .flatten()
            {
                Some(value) => Some(value),
                None => at
                    .filter(|&i| i < args.len())
                    .and_then(|i| args.get_item(i).ok()),
            };
            match value {
                Some(value) if !value.is_none() => Ok(Some(value.extract()?)),
                _ => Ok(None),
            }
        };
        Ok(PeerCall {
            way: p2p.way,
            peer: given(&p2p.peer)?,
            group_peer: given(&p2p.group_peer)?,
            tag: given(&p2p.tag)?.unwrap_or(0),
        })
    }

    /// (group, async_op, first argument) as the call was given them.
    #[allow(clippy::type_complexity)]
    fn arguments<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: &Bound<'py, PyDict>,
    ) -> PyResult<(Option<Bound<'py, PyAny>>, bool, Option<Bound<'py, PyAny>>)> {
        // Bounds first: a missing argument must not cost an IndexError made and dropped.
        let at = |i: Option<usize>| {
            i.filter(|&i| i < args.len())
                .and_then(|i| args.get_item(i).ok())
        };
        let by_name = |name: &Bound<'py, PyString>| -> PyResult<Option<Bound<'py, PyAny>>> {
            if kwargs.is_empty() {
                Ok(None)
            } else {
                kwargs.get_item(name)
            }
        };
        let group = match by_name(intern!(py, "group"))? {
            Some(group) => Some(group),
            None => at(self.group_at),
        };
        let asynchronous = match by_name(intern!(py, "async_op"))? {
            Some(flag) => flag.is_truthy()?,
            None => at(self.async_at)
                .map(|f| f.is_truthy())
                .transpose()?
                .unwrap_or(false),
        };
        let first = match (!args.is_empty()).then(|| args.get_item(0).ok()).flatten() {
            Some(first) => Some(first),
            // No argument at all: nothing to look for by name.
            None if kwargs.is_empty() => None,
            None => match &self.first_name {
                Some(name) => by_name(name.bind(py))?,
                None => None,
            },
        };
        Ok((group, asynchronous, first))
    }
}

/// A future's done-callback: closes the row of an `async_op` call.
#[pyclass(module = "rankscope._native", frozen)]
pub struct CollectiveEnd {
    log: Py<CollectiveLog>,
    key: u64,
    began: Instant,
}

#[pymethods]
impl CollectiveEnd {
    fn __call__(&self, py: Python<'_>, _future: &Bound<'_, PyAny>) {
        self.log.bind(py).get().close(self.key, self.began, "done");
    }
}
