//! The memory timeline (`python.memory`): a thread of the probe's own reads
//! the process's memory from `/proc` every `RANKSCOPE_MEMORY_INTERVAL_S`
//! seconds (1 by default; 0 turns it off) and adds a row to the run store,
//! without the GIL, tagged with the last torch step the step clock saw. So a
//! process the kernel's OOM killer ends leaves its timeline on disk.
//! Python adds rows of its own (`memory_row`) where it knows more: at each
//! `memory` look, and at torch steps where CUDA's allocator is in use.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use rankscope_memory::ProcMemory;
use rankscope_store::Cell;

const NO_STEP: i64 = i64::MIN;
/// One interval sample in this many reads USS and PSS too.
const USS_EVERY: u64 = 10;
static STEP: AtomicI64 = AtomicI64::new(NO_STEP);
/// The sampler's thread, and whether it should end (`stop_sampler`).
static SAMPLER: ThreadSlot = Mutex::new(None);
static STOPPING: Mutex<bool> = Mutex::new(false);
static WAKE: Condvar = Condvar::new();
/// The CUDA watcher's thread (see `memory_watch_cuda`), per process.
static WATCHER: ThreadSlot = Mutex::new(None);
static WATCHING: AtomicBool = AtomicBool::new(false);
/// Moves on at each stop: a watcher told to end that has not woken yet
/// must not carry on after a quick restart.
static GENERATION: AtomicU64 = AtomicU64::new(0);
/// When the last row with CUDA's figures was written (ms since the epoch).
static LAST_CUDA_ROW_MS: AtomicU64 = AtomicU64::new(0);
/// A watcher that found no CUDA in use through torch asks again after this
/// many intervals.
const CUDA_BACKOFF: u32 = 10;

fn mb(bytes: u64) -> Cell {
    Cell::Float(bytes as f64 / (1 << 20) as f64)
}

fn step_cell() -> Cell {
    match STEP.load(Ordering::Relaxed) {
        NO_STEP => Cell::Null,
        step => Cell::Int(step),
    }
}

/// The row's cells after `ts`, with what Python knows (CUDA, tracemalloc) or nulls.
fn cells(source: &str, proc: &ProcMemory, python: [Cell; 6]) -> Vec<Cell> {
    // USS and PSS are 0 when only /proc/PID/status was read: null then.
    let private = |bytes: u64| if proc.uss == 0 { Cell::Null } else { mb(bytes) };
    let mut out = vec![
        step_cell(),
        Cell::Str(source.to_string()),
        mb(proc.rss),
        mb(proc.rss_peak),
        private(proc.uss),
        private(proc.pss),
        mb(proc.swap),
    ];
    out.extend(python);
    out
}

fn now() -> f64 {
    rankscope_core::host::now_seconds()
}

fn interval() -> Option<Duration> {
    let seconds = std::env::var("RANKSCOPE_MEMORY_INTERVAL_S")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(1.0);
    // A day at most: a number past what a `Duration` holds panicked, in
    // the program's `site` import, and the program never ran.
    (seconds.is_finite() && seconds > 0.0)
        .then(|| Duration::from_secs_f64(seconds.clamp(0.01, 86_400.0)))
}

/// Waits one interval; false when the probe stops.
fn wait_interval(interval: Duration) -> bool {
    let stopping = STOPPING.lock().unwrap_or_else(|e| e.into_inner());
    let (stopping, _) = WAKE
        .wait_timeout_while(stopping, interval, |stop| !*stop)
        .unwrap_or_else(|e| e.into_inner());
    !*stopping
}

/// Whether the CUDA driver is loaded in this process (no GIL, no file
/// read: the loader's own list, under its lock).
fn cuda_driver_loaded() -> bool {
    let handle = unsafe {
        libc::dlopen(
            c"libcuda.so.1".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        )
    };
    if handle.is_null() {
        return false;
    }
    unsafe { libc::dlclose(handle) };
    true
}

/// A probe thread of this module, with the process that started it.
type Owned = Option<(u32, JoinHandle<()>)>;
type ThreadSlot = Mutex<Owned>;

/// The interval, and `slot` locked, when the sampler is on and this process
/// has no thread in the slot yet (a child after fork has none).
fn vacant(slot: &'static ThreadSlot) -> Option<(Duration, MutexGuard<'static, Owned>)> {
    let interval = interval()?;
    let guard = slot.lock().unwrap_or_else(|e| e.into_inner());
    if guard
        .as_ref()
        .is_some_and(|(owner, _)| *owner == std::process::id())
    {
        return None;
    }
    Some((interval, guard))
}

/// Starts the sampler (once; again after `stop_sampler`). A child after
/// fork has no thread: it starts one with a probe of its own.
pub fn start_sampler() {
    let Some((interval, mut sampler)) = vacant(&SAMPLER) else {
        return;
    };
    let pid = std::process::id();
    *STOPPING.lock().unwrap_or_else(|e| e.into_inner()) = false;
    let spawned = std::thread::Builder::new()
        .name("rankscope-memory".into())
        .spawn(move || {
            for sample in 0u64.. {
                if !wait_interval(interval) {
                    return;
                }
                // A program on CUDA gets CUDA's figures in its timeline
                // without asking (the watcher takes the GIL for them).
                if !WATCHING.load(Ordering::Relaxed) && cuda_driver_loaded() {
                    start_watcher();
                }
                // RSS every time (/proc/PID/status, ~20 µs); USS and PSS one
                // sample in ten: smaps_rollup walks every mapping under the
                // process's mmap lock, milliseconds for a process with torch.
                let read = if sample % USS_EVERY == 0 {
                    rankscope_memory::read_process(pid)
                } else {
                    rankscope_memory::read_status(pid)
                };
                if let Ok(proc) = read {
                    let nulls = [
                        Cell::Null,
                        Cell::Null,
                        Cell::Null,
                        Cell::Null,
                        Cell::Null,
                        Cell::Null,
                    ];
                    let _ =
                        crate::store::append_row("memory", now(), cells("interval", &proc, nulls));
                }
            }
        });
    if let Ok(handle) = spawned {
        *sampler = Some((pid, handle));
    }
}

/// The CUDA watcher: on each interval in which no row with CUDA's figures
/// was written (the step clock writes them while it runs), it takes the
/// GIL and has `rankscope._probe.memory.interval_row` write one. Its own
/// thread, so that a GIL held for long stalls it and not the sampler, whose
/// rows need no GIL. Once per process.
fn start_watcher() {
    let Some((interval, mut watcher)) = vacant(&WATCHER) else {
        return;
    };
    let pid = std::process::id();
    WATCHING.store(true, Ordering::Relaxed);
    let generation = GENERATION.load(Ordering::Relaxed);
    let spawned = std::thread::Builder::new()
        .name("rankscope-cuda-memory".into())
        .spawn(move || {
            let mut skip = 0u32;
            while wait_interval(interval) && GENERATION.load(Ordering::Relaxed) == generation {
                let since = ((now() * 1000.0) as u64)
                    .saturating_sub(LAST_CUDA_ROW_MS.load(Ordering::Relaxed));
                if skip > 0 || since < interval.as_millis() as u64 {
                    skip = skip.saturating_sub(1);
                    continue;
                }
                let in_use = Python::try_attach(|py| {
                    py.import("rankscope._probe.memory")
                        .and_then(|m| m.call_method0("interval_row"))
                        .and_then(|r| r.extract::<bool>())
                        .unwrap_or(false)
                });
                match in_use {
                    None => return,
                    Some(false) => skip = CUDA_BACKOFF,
                    Some(true) => {}
                }
            }
        });
    if let Ok(handle) = spawned {
        *watcher = Some((pid, handle));
    }
}

/// `memory_watch_cuda()`: Python found CUDA in use (a look, a step): the
/// watcher starts, if the sampler runs.
#[pyfunction]
pub fn memory_watch_cuda() {
    if SAMPLER
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|(owner, _)| *owner == std::process::id())
    {
        start_watcher();
    }
}

/// Ends the sampler's thread and waits for it (the probe stops). The
/// watcher is told to end but not waited for: it may be waiting for the
/// GIL, which the caller may hold.
pub fn stop_sampler() {
    let taken = SAMPLER.lock().unwrap_or_else(|e| e.into_inner()).take();
    let watcher = WATCHER.lock().unwrap_or_else(|e| e.into_inner()).take();
    WATCHING.store(false, Ordering::Relaxed);
    GENERATION.fetch_add(1, Ordering::Relaxed);
    if taken.is_some() || watcher.is_some() {
        *STOPPING.lock().unwrap_or_else(|e| e.into_inner()) = true;
        WAKE.notify_all();
    }
    if let Some((pid, handle)) = taken {
        if pid == std::process::id() {
            let _ = handle.join();
        }
    }
}

/// The torch step the clock is in (rows are tagged with it).
#[pyfunction]
pub fn set_step(step: i64) {
    STEP.store(step, Ordering::Relaxed);
}

/// Where the step lives in this process: a profiler outside reads it there
/// at each sample (`ProcessMeta::step_address`). A static, so the address
/// holds for the process's life; an aligned i64, so a read never tears.
pub fn step_address() -> u64 {
    &STEP as *const AtomicI64 as u64
}

/// The process's memory now, in bytes, from /proc.
#[pyfunction]
#[pyo3(signature = (full=true))]
pub fn memory_now<'py>(py: Python<'py>, full: bool) -> PyResult<Bound<'py, PyDict>> {
    let pid = std::process::id();
    let proc = py
        .detach(|| {
            if full {
                rankscope_memory::read_process(pid)
            } else {
                rankscope_memory::read_status(pid)
            }
        })
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
    let out = PyDict::new(py);
    out.set_item("rss", proc.rss)?;
    out.set_item("rss_peak", proc.rss_peak)?;
    if full {
        out.set_item("uss", proc.uss)?;
        out.set_item("pss", proc.pss)?;
    }
    out.set_item("swap", proc.swap)?;
    Ok(out)
}

/// Adds a `python.memory` row: /proc read now, plus what Python knows
/// (MB, or None): tracemalloc's traced size, CUDA's allocated, reserved
/// and peak, its allocation retries and OOMs.
#[pyfunction]
#[pyo3(signature = (source, python_traced_mb=None, cuda_allocated_mb=None, cuda_reserved_mb=None, cuda_peak_mb=None, cuda_alloc_retries=None, cuda_ooms=None))]
#[allow(clippy::too_many_arguments)]
pub fn memory_row(
    py: Python<'_>,
    source: &str,
    python_traced_mb: Option<f64>,
    cuda_allocated_mb: Option<f64>,
    cuda_reserved_mb: Option<f64>,
    cuda_peak_mb: Option<f64>,
    cuda_alloc_retries: Option<i64>,
    cuda_ooms: Option<i64>,
) -> PyResult<()> {
    let float = |v: Option<f64>| v.map(Cell::Float).unwrap_or(Cell::Null);
    let int = |v: Option<i64>| v.map(Cell::Int).unwrap_or(Cell::Null);
    let python = [
        float(python_traced_mb),
        float(cuda_allocated_mb),
        float(cuda_reserved_mb),
        float(cuda_peak_mb),
        int(cuda_alloc_retries),
        int(cuda_ooms),
    ];
    if cuda_allocated_mb.is_some() {
        LAST_CUDA_ROW_MS.store((now() * 1000.0) as u64, Ordering::Relaxed);
    }
    let source = source.to_string();
    py.detach(move || {
        // A look reads USS and PSS too; the rows of the timeline, written on
        // the training thread at steps, only what /proc/PID/status has
        // (smaps_rollup costs milliseconds in a process with torch).
        let pid = std::process::id();
        let proc = if source == "look" {
            rankscope_memory::read_process(pid)
        } else {
            rankscope_memory::read_status(pid)
        }
        .map_err(|e| e.to_string())?;
        crate::store::append_row("memory", now(), cells(&source, &proc, python))
    })
    .map_err(pyo3::exceptions::PyOSError::new_err)
}
