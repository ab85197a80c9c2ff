//! The way in for `rankscope inject`: the one symbol the CLI calls, through
//! ptrace, on a thread it borrowed from a process that never imported us.
//!
//! That thread must be given back at once, and it may be in any state, so
//! the entry only copies its argument and starts a native thread. The native
//! thread asks the interpreter to run the bootstrap at its next safe point
//! on the main thread (`Py_AddPendingCall`: between bytecodes, with the GIL,
//! never in a signal handler). A main thread that runs no bytecode (asleep
//! in a long C call that released the GIL) would never get there, so after
//! a short wait the native thread runs the bootstrap itself under
//! `PyGILState_Ensure`. Whoever takes the directory first runs it.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use rankscope_core::paths;

/// The directory that holds the `rankscope` package, until a bootstrap takes it.
static PENDING: Mutex<Option<String>> = Mutex::new(None);

const MAIN_THREAD_WAIT: Duration = Duration::from_millis(200);

/// # Safety
/// `package_dir` is a NUL-terminated path (the CLI writes it into the
/// target's memory). Returns 0 when the bootstrap thread started.
#[no_mangle]
pub unsafe extern "C" fn rankscope_inject_start(package_dir: *const c_char) -> c_int {
    if package_dir.is_null() {
        return 1;
    }
    // SAFETY: the caller passes a NUL-terminated string that lives for this call.
    let dir = unsafe { CStr::from_ptr(package_dir) }
        .to_string_lossy()
        .into_owned();
    *PENDING.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir);
    match std::thread::Builder::new()
        .name("rankscope-inject".into())
        .spawn(bootstrap_thread)
    {
        Ok(_) => 0,
        Err(_) => 2,
    }
}

fn take_pending() -> Option<String> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner()).take()
}

fn bootstrap_thread() {
    // SAFETY: documented as callable from any thread without the GIL.
    let queued =
        unsafe { pyo3::ffi::Py_AddPendingCall(Some(run_pending), std::ptr::null_mut()) } == 0;
    let deadline = Instant::now() + MAIN_THREAD_WAIT;
    while queued && Instant::now() < deadline {
        if PENDING.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    if let Some(dir) = take_pending() {
        Python::attach(|py| bootstrap(py, &dir));
    }
}

extern "C" fn run_pending(_: *mut c_void) -> c_int {
    if let Some(dir) = take_pending() {
        // The GIL is held here already; attach only makes that known to PyO3.
        Python::attach(|py| bootstrap(py, &dir));
    }
    0
}

const BOOTSTRAP: &CStr = c"
import sys
had_threading = 'threading' in sys.modules
sys.path.insert(0, package_dir)
try:
    import rankscope
    rankscope._start_injected()
finally:
    try:
        sys.path.remove(package_dir)
    except ValueError:
        pass
    sys.path_importer_cache.pop(package_dir, None)
    if not had_threading and 'threading' in sys.modules:
        from rankscope._probe import mainthread
        mainthread.repair()
rankscope._native.publish()
";

/// Imports and starts the probe, leaving `sys.path` (and its importer
/// cache) as they were. Starting imports nothing outside rankscope, so
/// `threading` never gets a probe thread for its main thread from here; the
/// repair is for a probe that someday does. A failure goes to `<pid>.inject-error` in
/// the endpoint directory, where the waiting CLI reads it; the target never
/// sees an exception from here.
fn bootstrap(py: Python<'_>, package_dir: &str) {
    let result = (|| -> PyResult<()> {
        let scope = PyDict::new(py);
        scope.set_item("package_dir", package_dir)?;
        py.run(BOOTSTRAP, Some(&scope), None)
    })();
    if let Err(err) = result {
        let text = err.to_string();
        let dir = paths::endpoint_dir();
        let _ = std::fs::write(paths::inject_error_path(&dir, std::process::id()), text);
    }
}
