//! `rankscope._native`: the part of the probe that must be native.
//!
//! It owns the server thread and the deadline watchdog. Everything that reads
//! Python state lives in plain Python (`rankscope._probe`), called from here
//! with the GIL held only for the duration of that call.

mod collective;
mod crash_hook;
mod deadline;
mod debug_wait;
mod finite;
mod frame_trace;
mod gc_walk;
mod gil;
mod grad_read;
mod handler;
mod injected;
mod memory;
mod meta;
mod nan_arm;
mod on_main;
mod profile_self;
mod pyjson;
mod quiet_edit;
mod registry;
mod stand_in;
mod step_clock;
mod store;
mod tensor_scan;
mod torch_abi;

use std::sync::{Arc, Mutex};

/// The probe's own heap, apart from the program's. Its allocations are made
/// on the program's threads (a torch row is built on the training thread);
/// from glibc's heap they changed how it hands memory back and forth with
/// torch's per-step tensors: one row a step cost the loop about 50 page
/// faults and tens of microseconds (bench/bench_torch_trace.py). mimalloc
/// keeps them in its own mapped segments, in small pages (`no_thp`: see
/// Cargo.toml).
#[global_allocator]
static PROBE_HEAP: mimalloc::MiMalloc = mimalloc::MiMalloc;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rankscope_core::paths;
use rankscope_server::{Server, ServerConfig, TcpConfig};

struct Running {
    server: Server,
    handler: Arc<handler::ProbeHandler>,
    dir: std::path::PathBuf,
    pid: u32,
}

static RUNNING: Mutex<Option<Running>> = Mutex::new(None);

fn lock_running() -> std::sync::MutexGuard<'static, Option<Running>> {
    RUNNING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the probe's server; returns where it listens. Starting twice is a
/// no-op that returns the same endpoint.
#[pyfunction]
#[pyo3(signature = (python_version, listen=None))]
fn start<'py>(
    py: Python<'py>,
    python_version: &str,
    listen: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut running = lock_running();
    if running.is_none() {
        gil::open();
        *running = Some(start_server(python_version, listen)?);
    }
    let r = running.as_ref().expect("set above");
    let info = PyDict::new(py);
    info.set_item("socket", r.server.socket_path().display().to_string())?;
    info.set_item("tcp", r.server.tcp_addr().map(|a| a.to_string()))?;
    info.set_item(
        "token_file",
        r.server
            .tcp_addr()
            .map(|_| paths::token_path(&r.dir, r.pid).display().to_string()),
    )?;
    Ok(info)
}

fn start_server(python_version: &str, listen: Option<&str>) -> PyResult<Running> {
    let err = |e: String| PyRuntimeError::new_err(e);
    let dir = paths::endpoint_dir();
    paths::ensure_private_dir(&dir).map_err(|e| err(e.to_string()))?;
    let pid = std::process::id();
    let tcp = match listen {
        None => None,
        Some(spec) => Some(TcpConfig {
            addr: rankscope_server::parse_listen(spec).map_err(|e| err(e.to_string()))?,
            token_file: paths::token_path(&dir, pid),
        }),
    };
    let config = ServerConfig {
        socket_path: paths::socket_path(&dir, pid),
        tcp,
    };
    let handler = Arc::new(handler::ProbeHandler::default());
    let server = Server::start(config, handler.clone()).map_err(|e| err(e.to_string()))?;
    let tcp_url = server.tcp_addr().map(|a| format!("tcp://{a}"));
    let meta = meta::collect(python_version, tcp_url);
    let meta_json = serde_json::to_string(&meta).map_err(|e| err(e.to_string()))?;
    handler.set_meta(meta_json.clone());
    let token_file = server
        .tcp_addr()
        .map(|_| paths::token_path(&dir, pid).display().to_string());
    let socket = server.socket_path().display().to_string();
    if let Err(e) = registry::register(&meta_json, &socket, token_file.as_deref()) {
        // The probe answers anyway; only `cluster` commands miss this rank.
        eprintln!("rankscope: not registered in the job: {e}");
    }
    memory::start_sampler();
    Ok(Running {
        server,
        handler,
        dir,
        pid,
    })
}

fn write_meta_file(dir: &std::path::Path, pid: u32, meta_json: &str) -> Result<(), String> {
    let meta_file = paths::meta_path(dir, pid);
    let tmp = meta_file.with_extension("json.tmp");
    std::fs::write(&tmp, meta_json)
        .and_then(|_| std::fs::rename(&tmp, &meta_file))
        .map_err(|e| format!("cannot write {}: {e}", meta_file.display()))
}

/// Writes the metadata file next to the socket. Its presence tells
/// `rankscope list` and a waiting `inject` that the probe is ready, so it
/// comes last, once start-up (the inject's bootstrap included) has left the
/// program's world as it was.
#[pyfunction]
fn publish() -> PyResult<()> {
    let running = lock_running();
    let Some(r) = running.as_ref() else {
        return Err(PyRuntimeError::new_err("the probe is not running"));
    };
    let meta_json = r.handler.meta().unwrap_or_default();
    write_meta_file(&r.dir, r.pid, &meta_json).map_err(PyRuntimeError::new_err)
}

/// The rank and world size as `torch.distributed` assigned them, once it is
/// initialised: they replace what the launcher's environment said.
/// Returns the new metadata as JSON, or None when the probe is not running.
#[pyfunction]
fn set_rank(rank: i64, world_size: i64) -> PyResult<Option<String>> {
    let running = lock_running();
    let Some(r) = running.as_ref() else {
        return Ok(None);
    };
    let Some(current) = r.handler.meta() else {
        return Ok(None);
    };
    let mut meta: serde_json::Value =
        serde_json::from_str(&current).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    meta["rank"] = rank.into();
    meta["world_size"] = world_size.into();
    // torch.distributed made this process a rank (mp.spawn's workers).
    meta::BYSTANDER.store(false, std::sync::atomic::Ordering::Relaxed);
    let meta_json = meta.to_string();
    r.handler.set_meta(meta_json.clone());
    write_meta_file(&r.dir, r.pid, &meta_json).map_err(PyRuntimeError::new_err)?;
    registry::update(&meta_json).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    drop(running);
    // Rows from now on carry the rank torch.distributed gave (none for a
    // group of one outside a job, as `list` shows it).
    store::set_rank(current_rank());
    Ok(Some(meta_json))
}

/// The rank in the probe's metadata (the launcher's, or torch's once set);
/// None for a process that is no rank (`meta::BYSTANDER`).
pub(crate) fn current_rank() -> Option<i64> {
    if meta::BYSTANDER.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let running = lock_running();
    let meta: rankscope_core::protocol::ProcessMeta =
        serde_json::from_str(&running.as_ref()?.handler.meta()?).ok()?;
    meta.job_rank()
}

/// How long a stopping probe waits for the requests on Python to end,
/// before and after interrupting its evals.
const QUIET_AT_STOP: std::time::Duration = std::time::Duration::from_secs(2);

/// Stops the server, removes the socket and metadata. The GIL is released
/// while the server thread is joined, so requests in flight can finish.
#[pyfunction]
fn stop(py: Python<'_>) -> bool {
    let Some(running) = lock_running().take() else {
        return false;
    };
    let Running {
        server, dir, pid, ..
    } = running;
    py.detach(move || {
        // A profile being taken answers with what it has (its sampler
        // needs no GIL), before the connection goes with the process.
        profile_self::end_all(std::time::Duration::from_millis(1500));
        registry::leave();
        server.stop();
        // No request may be on Python when the interpreter finalizes (see
        // `gil::close`). An eval still running is interrupted, as its
        // deadline would; one blocked in C past that is left to its fate.
        if gil::close(QUIET_AT_STOP) > 0 {
            let fired = Python::attach(deadline::interrupt_all);
            if fired > 0 {
                gil::close(QUIET_AT_STOP / 2);
            }
        }
        paths::remove_endpoint_files(&dir, pid);
        // No thread of the probe's outlives it: the sampler ends, and the
        // store writes what waits and ends its writer (a later row starts
        // it again).
        memory::stop_sampler();
        store::close();
    });
    true
}

/// Whether the probe is stopping (an eval interrupted now was interrupted
/// for that, not by its deadline).
#[pyfunction]
fn stopping() -> bool {
    gil::closed()
}

/// The socket path while running, else None.
#[pyfunction]
fn endpoint() -> Option<String> {
    lock_running()
        .as_ref()
        .map(|r| r.server.socket_path().display().to_string())
}

/// In a forked child the server thread does not exist and the socket is the
/// parent's: forget both without touching them.
#[pyfunction]
fn forget_after_fork() {
    if let Ok(mut running) = RUNNING.try_lock() {
        if let Some(r) = running.take() {
            std::mem::forget(r.server);
        }
    }
    registry::forget_after_fork();
    deadline::forget_after_fork();
}

/// The crash recorder wrote a record: the registry entry ends as "crashed".
#[pyfunction]
fn mark_crashed() {
    registry::mark_crashed();
}

/// Where this process's crash records, logs and registry entry go.
#[pyfunction]
fn run_dir() -> String {
    rankscope_core::crash::run_dir().display().to_string()
}

/// Milliseconds since the Unix epoch, for file names (the probe does not
/// import `time` into a program that has not).
#[pyfunction]
fn wall_ms() -> u64 {
    (rankscope_core::host::now_seconds() * 1000.0) as u64
}

#[pyfunction]
#[pyo3(signature = (seconds, exception, eval_id=None))]
fn arm_deadline(seconds: f64, exception: Py<PyAny>, eval_id: Option<String>) -> u64 {
    deadline::arm(seconds, exception, eval_id)
}

#[pyfunction]
fn disarm_deadline(token: u64) -> bool {
    deadline::disarm(token)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", rankscope_core::VERSION)?;
    m.add_function(wrap_pyfunction!(start, m)?)?;
    m.add_function(wrap_pyfunction!(stop, m)?)?;
    m.add_function(wrap_pyfunction!(stopping, m)?)?;
    m.add_function(wrap_pyfunction!(endpoint, m)?)?;
    m.add_function(wrap_pyfunction!(forget_after_fork, m)?)?;
    m.add_function(wrap_pyfunction!(arm_deadline, m)?)?;
    m.add_function(wrap_pyfunction!(disarm_deadline, m)?)?;
    m.add_function(wrap_pyfunction!(frame_trace::trace_frames, m)?)?;
    m.add_function(wrap_pyfunction!(set_rank, m)?)?;
    m.add_function(wrap_pyfunction!(mark_crashed, m)?)?;
    m.add_function(wrap_pyfunction!(publish, m)?)?;
    m.add_function(wrap_pyfunction!(run_dir, m)?)?;
    m.add_function(wrap_pyfunction!(wall_ms, m)?)?;
    m.add_function(wrap_pyfunction!(crash_hook::enable_crash_hook, m)?)?;
    m.add_function(wrap_pyfunction!(quiet_edit::edit_unless_running, m)?)?;
    m.add_function(wrap_pyfunction!(store::table_append, m)?)?;
    m.add_function(wrap_pyfunction!(store::table_extend, m)?)?;
    m.add_function(wrap_pyfunction!(store::table_rows_waiting, m)?)?;
    m.add_function(wrap_pyfunction!(store::trace_plan, m)?)?;
    m.add_function(wrap_pyfunction!(store::step_row, m)?)?;
    m.add_function(wrap_pyfunction!(store::torch_rows_kept, m)?)?;
    m.add_function(wrap_pyfunction!(store::torch_rows_refused, m)?)?;
    m.add_function(wrap_pyfunction!(store::trace_keep, m)?)?;
    m.add_function(wrap_pyfunction!(memory::set_step, m)?)?;
    m.add_function(wrap_pyfunction!(memory::memory_now, m)?)?;
    m.add_function(wrap_pyfunction!(memory::memory_row, m)?)?;
    m.add_function(wrap_pyfunction!(store::store_describe, m)?)?;
    m.add_function(wrap_pyfunction!(store::table_tail, m)?)?;
    m.add_function(wrap_pyfunction!(store::store_flush, m)?)?;
    m.add_function(wrap_pyfunction!(store::snapshot_rows, m)?)?;
    m.add_function(wrap_pyfunction!(debug_wait::debug_posted, m)?)?;
    m.add_function(wrap_pyfunction!(gil::gil_parks, m)?)?;
    m.add_function(wrap_pyfunction!(gc_walk::gc_instances, m)?)?;
    m.add_function(wrap_pyfunction!(gc_walk::gc_tracked, m)?)?;
    m.add_function(wrap_pyfunction!(memory::memory_watch_cuda, m)?)?;
    m.add_class::<tensor_scan::TensorScan>()?;
    m.add_class::<finite::FiniteCheck>()?;
    m.add_class::<step_clock::StepClock>()?;
    m.add_class::<stand_in::StandIn>()?;
    m.add_class::<nan_arm::NanArm>()?;
    m.add_class::<nan_arm::NanStep>()?;
    m.add_class::<collective::CollectiveLog>()?;
    m.add_class::<collective::CollectiveCall>()?;
    m.add_class::<collective::CollectiveEnd>()?;
    m.add_function(wrap_pyfunction!(on_main::on_main_thread, m)?)?;
    m.add_class::<grad_read::GradRead>()?;
    Ok(())
}
