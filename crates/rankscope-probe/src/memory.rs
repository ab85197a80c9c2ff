//! The memory timeline (`python.memory`): a thread of the probe's own reads
//! the process's memory from `/proc` every `RANKSCOPE_MEMORY_INTERVAL_S`
//! seconds (1 by default; 0 turns it off) and adds a row to the run store,
//! without the GIL, tagged with the last torch step the step clock saw. So a
//! process the kernel's OOM killer ends leaves its timeline on disk.
//! Python adds rows of its own (`memory_row`) where it knows more: at each
//! `memory` look, and at torch steps where CUDA's allocator is in use.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use rankscope_memory::ProcMemory;
use rankscope_store::Cell;

const NO_STEP: i64 = i64::MIN;
static STEP: AtomicI64 = AtomicI64::new(NO_STEP);
static STARTED: AtomicBool = AtomicBool::new(false);

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
    let mut out = vec![step_cell(), Cell::Str(source.to_string()), mb(proc.rss), mb(proc.rss_peak), mb(proc.uss), mb(proc.pss), mb(proc.swap)];
    out.extend(python);
    out
}

fn now() -> f64 {
    rankscope_core::host::now_seconds()
}

/// Starts the sampler once per process (a child after fork starts none
/// until it starts a probe of its own).
pub fn start_sampler() {
    let seconds = std::env::var("RANKSCOPE_MEMORY_INTERVAL_S").ok().and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(1.0);
    if !(seconds.is_finite() && seconds > 0.0) || STARTED.swap(true, Ordering::SeqCst) {
        return;
    }
    let interval = Duration::from_secs_f64(seconds.max(0.01));
    let pid = std::process::id();
    let _ = std::thread::Builder::new().name("rankscope-memory".into()).spawn(move || loop {
        std::thread::sleep(interval);
        if std::process::id() != pid {
            return;
        }
        if let Ok(proc) = rankscope_memory::read_process(pid) {
            let nulls = [Cell::Null, Cell::Null, Cell::Null, Cell::Null, Cell::Null, Cell::Null];
            let _ = crate::store::append_row("memory", now(), cells("interval", &proc, nulls));
        }
    });
}

/// The torch step the clock is in (rows are tagged with it).
#[pyfunction]
pub fn set_step(step: i64) {
    STEP.store(step, Ordering::Relaxed);
}

/// The process's memory now, in bytes, from /proc.
#[pyfunction]
pub fn memory_now<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let proc = py.detach(|| rankscope_memory::read_process(std::process::id())).map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
    let out = PyDict::new(py);
    out.set_item("rss", proc.rss)?;
    out.set_item("rss_peak", proc.rss_peak)?;
    out.set_item("uss", proc.uss)?;
    out.set_item("pss", proc.pss)?;
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
    let source = source.to_string();
    py.detach(move || {
        let proc = rankscope_memory::read_process(std::process::id()).map_err(|e| e.to_string())?;
        crate::store::append_row("memory", now(), cells(&source, &proc, python))
    })
    .map_err(pyo3::exceptions::PyOSError::new_err)
}
