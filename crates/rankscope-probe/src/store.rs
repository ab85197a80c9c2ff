//! The probe's side of the run store (`rankscope-store`): rows come in from
//! the torch features' Python code, the CLI reads them back through
//! `GET /v1/table` without the GIL, and the store's own thread spills them
//! to the run directory.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};
use rankscope_store::{Cell, Store, StoreConfig};

static STORE: Mutex<Option<Arc<Store>>> = Mutex::new(None);

/// A whole number of at least `least` from the environment; a value that is not one
/// is said on stderr, once in the process (a child after fork inherits
/// that it was said), and the default kept.
fn env_number(name: &str, least: u64) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    match text.trim().parse::<u64>() {
        Ok(n) if n >= least => Some(n),
        _ => {
            static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
            let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
            if !said.iter().any(|n| n == name) {
                said.push(name.to_string());
                eprintln!("rankscope: {name}={text:?} is not a whole number of at least {least}; the default is kept");
            }
            None
        }
    }
}

/// This process's id, read once and again after a fork: every row goes
/// through `store()`, which tells a child after fork (that must start a
/// store of its own) by its pid, and `getpid` is a system call, about
/// 140 ns here, twice for each collective recorded.
pub(crate) fn this_pid() -> u32 {
    // A flag, not a `Once`: a fork while another thread registers would
    // leave the child a `Once` that never completes.
    static FORK_HOOK: AtomicBool = AtomicBool::new(false);
    extern "C" fn forked() {
        let_go_after_fork();
        PID.store(0, Ordering::Relaxed);
    }
    let pid = PID.load(Ordering::Relaxed);
    if pid != 0 {
        return pid;
    }
    if !FORK_HOOK.swap(true, Ordering::AcqRel) {
        // SAFETY: the handlers take and release this crate's own locks and
        // store to an atomic; they call into no Python.
        unsafe {
            libc::pthread_atfork(
                Some(hold_across_fork),
                Some(let_go_after_fork),
                Some(forked),
            )
        };
    }
    let pid = std::process::id();
    PID.store(pid, Ordering::Relaxed);
    pid
}
static PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// What a fork holds, from just before it to just after, on the forking
/// thread (the child's only thread is that thread's copy, with its
/// thread-locals).
struct ForkHold {
    // Dropped in this order, the reverse of taking.
    _logs: crate::collective::ForkHold,
    _store: std::sync::MutexGuard<'static, Option<Arc<Store>>>,
}

thread_local! {
    static FORK_HOLD: std::cell::RefCell<Option<ForkHold>> = const { std::cell::RefCell::new(None) };
}

/// Before a fork: the locks that the store's spill thread and the probe's
/// readers take without the GIL are taken here, so that no thread holds
/// one when the child is made (it would hold it in the child for good: a
/// DataLoader worker or a `multiprocessing` child then hangs at its first
/// row, collective or exit). They are held for microseconds at a time, so
/// a fork waits for one at most that long. Locks taken only with the GIL
/// held need nothing: the forking thread holds it.
extern "C" fn hold_across_fork() {
    let store = STORE.lock().unwrap_or_else(|e| e.into_inner());
    let logs = crate::collective::hold_for_fork();
    let taken = ForkHold {
        _logs: logs,
        _store: store,
    };
    // (A thread past its thread-locals' end forks unguarded: nothing here may panic.)
    let _ = FORK_HOLD.try_with(|hold| {
        if let Ok(mut hold) = hold.try_borrow_mut() {
            *hold = Some(taken);
        }
    });
}

/// After a fork, in the parent and in the child: what `hold_across_fork` took goes.
extern "C" fn let_go_after_fork() {
    let _ = FORK_HOLD.try_with(|hold| hold.try_borrow_mut().map(|mut h| h.take()));
}

/// The store of this process; made with the first row. A child after
/// `fork` gets a fresh one: the parent's rows and thread are not its own.
pub(crate) fn store() -> Arc<Store> {
    if let Some(store) = existing() {
        return store;
    }
    // Read without the store's lock held: set_rank takes them the other way round.
    let rank = crate::current_rank();
    let mut slot = STORE.lock().unwrap_or_else(|e| e.into_inner());
    let pid = this_pid();
    if let Some(store) = slot.as_ref().filter(|s| s.pid() == pid) {
        return store.clone();
    }
    // RANKSCOPE_STORE=0 keeps the rows in memory only.
    let spill = std::env::var("RANKSCOPE_STORE")
        .map(|v| v != "0")
        .unwrap_or(true);
    let run_dir = spill.then(rankscope_core::crash::run_dir);
    let mut config = StoreConfig::new(pid, rankscope_core::host::hostname(), run_dir);
    if let Some(rows) =
        env_number("RANKSCOPE_TABLE_ROWS", 1).or_else(|| env_number("RANKSCOPE_TORCH_ROWS", 1))
    {
        config.ring_rows = rows as usize;
        // The user's number is every table's.
        config.table_rows.clear();
    }
    if let Ok(text) = std::env::var("RANKSCOPE_STORE_FLUSH_S") {
        match text.trim().parse::<f64>() {
            Ok(seconds) if seconds.is_finite() && seconds > 0.0 => {
                config.flush_every = std::time::Duration::from_secs_f64(seconds.min(3600.0));
            }
            _ => eprintln!(
                "rankscope: RANKSCOPE_STORE_FLUSH_S={text:?} is not a number of seconds above 0; the default is kept"
            ),
        }
    }
    if let Some(mb) = env_number("RANKSCOPE_STORE_MAX_MB", 0) {
        config.max_bytes = mb.saturating_mul(1 << 20);
    }
    let store = Store::new(config);
    store.set_rank(rank);
    store.set_feed(Arc::new(feed_all));
    *slot = Some(store.clone());
    store
}

/// The store if any row was ever added (reads must not make one).
fn existing() -> Option<Arc<Store>> {
    let slot = STORE.lock().unwrap_or_else(|e| e.into_inner());
    slot.as_ref().filter(|s| s.pid() == this_pid()).cloned()
}

pub fn set_rank(rank: Option<i64>) {
    if let Some(store) = existing() {
        store.set_rank(rank);
    }
}

fn cell(value: &Bound<'_, PyAny>) -> Cell {
    // The exact types first: nearly every value is one, and each check is
    // a pointer comparison.
    if value.is_none() {
        return Cell::Null;
    }
    if value.is_exact_instance_of::<PyFloat>() {
        if let Ok(f) = value.extract::<f64>() {
            return Cell::Float(f);
        }
    } else if value.is_exact_instance_of::<PyInt>() {
        if let Ok(i) = value.extract::<i64>() {
            return Cell::Int(i);
        }
    } else if value.is_exact_instance_of::<PyString>() {
        if let Ok(text) = value.cast::<PyString>() {
            if let Ok(text) = text.to_str() {
                return Cell::Str(text.to_string());
            }
        }
    }
    if value.is_instance_of::<PyBool>() {
        Cell::Bool(value.is_truthy().unwrap_or(false))
    } else if value.is_instance_of::<PyInt>() {
        value
            .extract::<i64>()
            .map(Cell::Int)
            .or_else(|_| value.extract::<f64>().map(Cell::Float))
            .unwrap_or(Cell::Null)
    } else if value.is_instance_of::<PyFloat>() {
        value
            .extract::<f64>()
            .map(Cell::Float)
            .unwrap_or(Cell::Null)
    } else if let Ok(text) = value.cast::<PyString>() {
        text.to_str()
            .map(|s| Cell::Str(s.to_string()))
            .unwrap_or(Cell::Null)
    } else if let Ok(map) = value.cast::<PyDict>() {
        // A map column (a snapshot's locals): keys and values as text.
        Cell::Map(
            map.iter()
                .map(|(k, v)| (text_of(&k), text_of(&v)))
                .collect(),
        )
    } else {
        value
            .str()
            .ok()
            .and_then(|s| s.to_str().ok().map(|s| Cell::Str(s.to_string())))
            .unwrap_or(Cell::Null)
    }
}

fn text_of(value: &Bound<'_, PyAny>) -> String {
    match value.cast::<PyString>() {
        Ok(text) => text.to_string_lossy().into_owned(),
        Err(_) => value
            .str()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    }
}

/// Adds a row (`ts` in seconds first, then the table's columns) to a table
/// of the run store.
#[pyfunction]
pub fn table_append(name: &str, row: &Bound<'_, PyAny>) -> PyResult<()> {
    let (ts, cells) = ts_and_cells(row)?;
    store()
        .append(name, ts, cells)
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Adds several rows to one table in one call (the torch features hand
/// their rows over in batches): the call, the store lookup and the lock
/// are paid once.
#[pyfunction]
pub fn table_extend(name: &str, rows: &Bound<'_, PyAny>) -> PyResult<()> {
    let rows = rows
        .try_iter()?
        .map(|row| ts_and_cells(&row?))
        .collect::<PyResult<Vec<_>>>()?;
    store()
        .append_rows(name, rows)
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The step clock's `torch_steps` rows, one a step, kept as cells until
/// the store asks for them (`feed_all`: before a read, and at each of its
/// writes to disk, on its own thread). A row made by the short way never
/// becomes a Python object: a tuple of eleven values made at every step
/// and converted at the hand-over cost about 3 us a step on a small MLP's
/// 1.5 ms step, most of what a step the trace does not sample paid beyond
/// the clock (docs/performance.md, "Sampled steps by the short way"); and
/// the rows are made on the store's thread, not the program's: handing
/// 166 steps of rows over on the training thread cost it 0.6 ms with the
/// trace's forward rows (docs/performance.md, "The trace's rows made off
/// the training thread").
static STEP_ROWS: Mutex<Vec<(f64, Vec<Cell>)>> = Mutex::new(Vec::new());

/// The sampled steps' trace counters, `(plan, ts, step, acc)`, kept until
/// the store asks (as `STEP_ROWS`), which then makes their rows.
static TRACE_STEPS: Mutex<Vec<TraceStep>> = Mutex::new(Vec::new());
type TraceStep = (TracePlan, f64, i64, Vec<i64>);

/// One feed at a time: two batches taken by two threads would otherwise
/// reach the store in either order.
static FEEDING: Mutex<()> = Mutex::new(());

/// Rows kept past this many (a store that writes nothing to disk, and
/// that no one reads) go to the store from the thread that keeps them.
const KEPT_MAX: usize = 4096;

/// How soon the store's thread takes the first row kept after its last
/// feed: what a SIGKILL may lose, as the store's own writes go.
const KEPT_FOR: Duration = Duration::from_secs(1);

/// What the store's feed does with a count of rows kept just now.
fn kept(count: usize) {
    if count == 1 {
        // The first since the last feed: the store's thread, started here
        // if no row started it before, takes them within KEPT_FOR.
        store().spill_soon(KEPT_FOR);
    } else if count >= KEPT_MAX {
        feed_torch(&store(), None);
    }
}

/// Keeps one `torch_steps` row until the store asks for it.
pub(crate) fn keep_step_row(ts: f64, cells: Vec<Cell>) {
    let count = {
        let mut rows = STEP_ROWS.lock().unwrap_or_else(|e| e.into_inner());
        rows.push((ts, cells));
        rows.len()
    };
    kept(count);
}

/// `step_row(row)`: a `torch_steps` row made in Python (a sampled step's,
/// by the long way), kept with the others. A row of the wrong length is
/// refused here, where the caller hears of it.
#[pyfunction]
pub fn step_row(row: &Bound<'_, PyAny>) -> PyResult<()> {
    let (ts, cells) = ts_and_cells(row)?;
    let columns = rankscope_core::tables::TORCH_STEPS.columns.len();
    if cells.len() != columns {
        return Err(PyValueError::new_err(format!(
            "a torch_steps row has {} values after ts, not {}",
            cells.len(),
            columns
        )));
    }
    keep_step_row(ts, cells);
    Ok(())
}

/// How many `torch_steps` rows and sampled steps' trace counters wait
/// for the store.
#[pyfunction]
pub fn torch_rows_kept() -> (usize, usize) {
    let steps = STEP_ROWS.lock().unwrap_or_else(|e| e.into_inner()).len();
    let traced = TRACE_STEPS.lock().unwrap_or_else(|e| e.into_inner()).len();
    (steps, traced)
}

/// Part of the store's feed (`feed_all`): the kept `torch_steps` rows and
/// the `torch_trace` rows of the kept counters, for a read of `table` or
/// (None) a write to disk. A row the store refuses is counted, not raised:
/// this runs on the store's thread or a reader's.
fn feed_torch(store: &Arc<Store>, table: Option<&'static str>) {
    let _one = FEEDING.lock().unwrap_or_else(|e| e.into_inner());
    if table.is_none_or(|t| t == "torch_steps") {
        let rows = std::mem::take(&mut *STEP_ROWS.lock().unwrap_or_else(|e| e.into_inner()));
        let count = rows.len() as u64;
        if count > 0 && store.append_rows("torch_steps", rows).is_err() {
            ROWS_REFUSED.fetch_add(count, Ordering::Relaxed);
        }
    }
    if table.is_none_or(|t| t == "torch_trace") {
        let steps = std::mem::take(&mut *TRACE_STEPS.lock().unwrap_or_else(|e| e.into_inner()));
        if steps.is_empty() {
            return;
        }
        let rows = trace_rows(steps);
        let count = rows.len() as u64;
        if count > 0 && store.append_rows("torch_trace", rows).is_err() {
            ROWS_REFUSED.fetch_add(count, Ordering::Relaxed);
        }
    }
}

/// Rows the store refused from the feed (none should be: their cells are
/// made here, to the tables' shapes).
static ROWS_REFUSED: AtomicU64 = AtomicU64::new(0);

#[pyfunction]
pub fn torch_rows_refused() -> u64 {
    ROWS_REFUSED.load(Ordering::Relaxed)
}

/// The store's `Feed`: the probe's producers that keep rows their own way.
pub(crate) fn feed_all(store: &Arc<Store>, table: Option<&'static str>, reading: bool) {
    crate::collective::feed_all(store, table, reading);
    feed_torch(store, table);
}

/// The trace's timed modules, by plan: the cells of their rows that do
/// not change from step to step (module, type, depth, stage), or None for
/// a module timed for the step's figures only. A plan is made when the
/// stand-ins go on and kept while its rows may still come; the last few
/// are enough.
/// Per timed module: its fixed cells, or None (timed for the step only).
type TracePlan = Arc<Vec<Option<[Cell; 4]>>>;
static TRACE_PLANS: Mutex<Vec<(u64, TracePlan)>> = Mutex::new(Vec::new());
static NEXT_PLAN: AtomicU64 = AtomicU64::new(1);
const TRACE_PLANS_KEPT: usize = 8;

/// `plan`: per timed module, `(module, type, depth, stage)` or None.
#[pyfunction]
pub fn trace_plan(plan: &Bound<'_, PyAny>) -> PyResult<u64> {
    let mut fixed = Vec::new();
    for entry in plan.try_iter()? {
        let entry = entry?;
        if entry.is_none() {
            fixed.push(None);
            continue;
        }
        let (module, type_name, depth, stage): (String, String, i64, String) = entry.extract()?;
        fixed.push(Some([
            Cell::Str(module),
            Cell::Str(type_name),
            Cell::Int(depth),
            Cell::Str(stage),
        ]));
    }
    let id = NEXT_PLAN.fetch_add(1, Ordering::Relaxed);
    let mut plans = TRACE_PLANS.lock().unwrap_or_else(|e| e.into_inner());
    if plans.len() >= TRACE_PLANS_KEPT {
        plans.remove(0);
    }
    plans.push((id, Arc::new(fixed)));
    Ok(id)
}

/// Keeps a sampled step's trace counters, `acc` (each timed module's
/// nanoseconds and calls side by side, in the plan's order), until the
/// store asks for their rows.
pub(crate) fn keep_trace_step(plan: u64, ts: f64, step: i64, acc: Vec<i64>) -> PyResult<()> {
    let fixed = {
        let plans = TRACE_PLANS.lock().unwrap_or_else(|e| e.into_inner());
        match plans.iter().find(|(id, _)| *id == plan) {
            Some((_, fixed)) => fixed.clone(),
            None => return Err(PyValueError::new_err(format!("no trace plan {plan}"))),
        }
    };
    let count = {
        let mut steps = TRACE_STEPS.lock().unwrap_or_else(|e| e.into_inner());
        steps.push((fixed, ts, step, acc));
        steps.len()
    };
    kept(count);
    Ok(())
}

/// `trace_keep(plan, steps)`: the long way's sampled steps, each
/// `(ts, step, acc)`, kept as `keep_trace_step` keeps the short way's.
#[pyfunction]
pub fn trace_keep(plan: u64, steps: &Bound<'_, PyAny>) -> PyResult<()> {
    for entry in steps.try_iter()? {
        let (ts, step, acc): (f64, i64, Vec<i64>) = entry?.extract()?;
        keep_trace_step(plan, ts, step, acc)?;
    }
    Ok(())
}

/// `python.torch_trace` rows of kept sampled steps: a module with no call
/// that step has none. Building the rows here, not as Python lists, is
/// most of what a sampled step's rows cost, and it is the store's thread
/// that builds them.
fn trace_rows(steps: Vec<TraceStep>) -> Vec<(f64, Vec<Cell>)> {
    let mut rows = Vec::new();
    for (fixed, ts, step, acc) in steps {
        for (i, cells) in fixed.iter().enumerate() {
            let (Some(cells), Some(&ns), Some(&calls)) =
                (cells, acc.get(2 * i), acc.get(2 * i + 1))
            else {
                continue;
            };
            if calls <= 0 {
                continue;
            }
            let mut row = Vec::with_capacity(10);
            row.push(Cell::Int(step));
            row.extend(cells.iter().cloned());
            row.push(Cell::Int(calls));
            row.push(Cell::Float(ns as f64 / 1e6));
            row.extend([Cell::Null, Cell::Null, Cell::Null]);
            rows.push((ts, row));
        }
    }
    rows
}

/// The Python side holds rows it has not handed over yet
/// (`rankscope._probe.torch.tables`): a reader asks it for them first.
static ROWS_IN_PYTHON: AtomicBool = AtomicBool::new(false);
/// A hand-over asked by a reader is under way.
static FLUSHING: AtomicBool = AtomicBool::new(false);
/// How long a reader waits for the Python side to hand its rows over.
const FLUSH_WAIT: Duration = Duration::from_millis(200);

/// Said by the Python side when its first row waits, and when none does.
#[pyfunction]
pub fn table_rows_waiting(waiting: bool) {
    ROWS_IN_PYTHON.store(waiting, Ordering::Release);
}

/// Before a read: the rows the Python side still holds are handed over,
/// when the GIL can be had within [`FLUSH_WAIT`]. A stuck interpreter (a
/// thread holding the GIL) costs the reader that wait, once: the hand-over
/// then goes on in its own thread and the reader answers with what the
/// store has.
pub fn take_rows_from_python() {
    if !ROWS_IN_PYTHON.load(Ordering::Acquire) {
        return;
    }
    if FLUSHING.swap(true, Ordering::AcqRel) {
        return;
    }
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("rankscope-rows".into())
        .spawn(move || {
            crate::gil::attach(|py| {
                // Only a module the program has loaded is asked.
                let loaded = py
                    .import("sys")
                    .and_then(|sys| sys.getattr("modules"))
                    .and_then(|modules| modules.get_item("rankscope._probe.torch.tables"));
                if let Ok(tables) = loaded {
                    let _ = tables.call_method0("flush");
                }
            });
            FLUSHING.store(false, Ordering::Release);
            let _ = done.send(());
        });
    if spawned.is_err() {
        FLUSHING.store(false, Ordering::Release);
        return;
    }
    let _ = wait.recv_timeout(FLUSH_WAIT);
}

fn ts_and_cells(row: &Bound<'_, PyAny>) -> PyResult<(f64, Vec<Cell>)> {
    let mut values = row.try_iter()?;
    let ts = match values.next() {
        Some(ts) => ts?.extract::<f64>()?,
        None => return Err(PyValueError::new_err("a row starts with ts")),
    };
    let cells = values
        .map(|v| v.map(|v| cell(&v)))
        .collect::<PyResult<Vec<Cell>>>()?;
    Ok((ts, cells))
}

/// Writes what waits and ends the store's thread (the probe stops).
pub fn close() {
    if let Some(store) = existing() {
        store.close();
    }
}

/// A row from Rust (the memory sampler), without the GIL.
pub fn append_row(name: &str, ts: f64, cells: Vec<Cell>) -> Result<(), String> {
    store().append(name, ts, cells).map_err(|e| e.to_string())
}

/// The last `n` rows of a table in memory, as JSON text (`{"columns",
/// "rows"}`, ts first, in seconds): what a crash record keeps of the memory
/// timeline. Empty where the store has not started.
#[pyfunction]
pub fn table_tail(py: Python<'_>, name: &str, n: usize) -> PyResult<String> {
    let Some(store) = existing() else {
        return Ok(r#"{"columns": [], "rows": []}"#.to_string());
    };
    let mut reply = py
        .detach(|| store.read_json(name, None, &[], false))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    if let Some(rows) = reply["rows"].as_array_mut() {
        let skip = rows.len().saturating_sub(n);
        rows.drain(..skip);
    }
    Ok(reply.to_string())
}

/// What the store holds and where it spills, as JSON text.
#[pyfunction]
pub fn store_describe() -> String {
    match existing() {
        Some(store) => store.describe().to_string(),
        None => {
            let rows: serde_json::Map<String, serde_json::Value> =
                rankscope_core::tables::PROBE_TABLES
                    .iter()
                    .map(|t| (t.name.to_string(), 0.into()))
                    .collect();
            serde_json::json!({"rows": rows, "spill": null}).to_string()
        }
    }
}

/// A breakpoint hit's rows, made here in one call: `head` is `[ts, id,
/// bp_id, hit, thread, func, file, lineno, log]` (a `python.snapshots` row
/// without its locals) and `locals` the hit frame's `[name, repr, type]`
/// lists, which become its locals map and one `python.snapshot_locals` row
/// each. They reach the disk within `spill_within` seconds. One call, and
/// the rows built here: a hit is on the program's thread.
#[pyfunction]
pub fn snapshot_rows(
    head: &Bound<'_, PyAny>,
    locals: &Bound<'_, PyAny>,
    spill_within: f64,
) -> PyResult<()> {
    let (ts, mut cells) = ts_and_cells(head)?;
    if cells.len() < 3 {
        return Err(PyValueError::new_err(
            "a snapshot row starts with ts, id, bp_id, hit",
        ));
    }
    let key = cells[..3].to_vec();
    let mut map = Vec::new();
    let mut local_rows = Vec::new();
    for local in locals.try_iter()? {
        let local = local?;
        let field = |i: usize| local.get_item(i).map(|v| text_of(&v)).unwrap_or_default();
        let (name, repr, ty) = (field(0), field(1), field(2));
        map.push((name.clone(), repr.clone()));
        let mut row = key.clone();
        row.extend([Cell::Str(name), Cell::Str(repr), Cell::Str(ty)]);
        local_rows.push((ts, row));
    }
    cells.push(Cell::Map(map));
    let store = store();
    let fail = |e: rankscope_store::StoreError| PyValueError::new_err(e.to_string());
    store.append("snapshots", ts, cells).map_err(fail)?;
    if !local_rows.is_empty() {
        store
            .append_rows("snapshot_locals", local_rows)
            .map_err(fail)?;
    }
    store.spill_soon(Duration::from_secs_f64(spill_within.clamp(0.0, 3600.0)));
    Ok(())
}

/// Writes the rows waiting for the disk now (at exit), without the GIL.
#[pyfunction]
pub fn store_flush(py: Python<'_>) {
    if let Some(store) = existing() {
        py.detach(move || store.flush());
    }
}

/// `GET /v1/table?name=...`: answered from the store, without the GIL,
/// written to `out` as it is made. An `Err` is for the client's ears when
/// nothing was written yet.
pub fn write_json(
    name: &str,
    columns: Option<&str>,
    filters: Option<&str>,
    count: bool,
    out: &mut dyn std::io::Write,
) -> Result<(), String> {
    if rankscope_store::store_table(name).is_none() {
        return Err(format!("no table {name} in this probe"));
    }
    let columns: Option<Vec<String>> = columns.map(|c| {
        c.split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    });
    let filters: Vec<(String, String, serde_json::Value)> = match filters {
        Some(text) => serde_json::from_str(text).map_err(|e| format!("bad filter: {e}"))?,
        None => Vec::new(),
    };
    let store = match existing() {
        Some(store) => store,
        // No row yet: an empty table, without making a store.
        None => Store::new(StoreConfig::new(std::process::id(), String::new(), None)),
    };
    store
        .write_json(name, columns.as_deref(), &filters, count, out)
        .map_err(|e| e.to_string())
}
