//! Running a function on the main thread at its next safe point: between
//! two bytecodes, with the GIL (`Py_AddPendingCall`), where the program is
//! inside no torch op and no backward pass.
//!
//! The tensor scan reads autograd's graph there (`_raw_saved_*`, a node's
//! saved tensors): from a probe thread that read would race with the
//! training thread, which runs ops and backward without the GIL, mutating
//! the very nodes being read (a saved tensor released under the reader, a
//! `grad_fn` replaced by an in-place op) and could crash the program. A
//! main thread that reaches no bytecode in time (blocked in a long C call)
//! is not waited for: the caller gets None and goes without.

use std::ffi::{c_int, c_void};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

enum Job {
    Waiting(Py<PyAny>),
    Running,
    Done(PyResult<Py<PyAny>>),
}

static SLOT: Mutex<Option<Job>> = Mutex::new(None);
static DONE: Condvar = Condvar::new();

fn lock() -> std::sync::MutexGuard<'static, Option<Job>> {
    SLOT.lock().unwrap_or_else(|e| e.into_inner())
}

/// `func()` on the main thread (at once when called there), or None when
/// the main thread reached no safe point within `timeout_s` seconds, or
/// another call is in flight. What `func` raises is raised here.
#[pyfunction]
pub fn on_main_thread(
    py: Python<'_>,
    func: Py<PyAny>,
    timeout_s: f64,
) -> PyResult<Option<Py<PyAny>>> {
    let threading = py.import("threading")?;
    let main = threading
        .call_method0("main_thread")?
        .getattr("ident")?
        .extract::<u64>()?;
    let me = threading.call_method0("get_ident")?.extract::<u64>()?;
    if me == main {
        return func.call0(py).map(Some);
    }
    {
        let mut slot = lock();
        if slot.is_some() {
            return Ok(None);
        }
        *slot = Some(Job::Waiting(func));
    }
    // SAFETY: callable from any thread; `run_job` has the signature wanted.
    if unsafe { pyo3::ffi::Py_AddPendingCall(Some(run_job), std::ptr::null_mut()) } != 0 {
        take_back();
        return Ok(None);
    }
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_s.clamp(0.0, 60.0));
    // Waited for without the GIL: the main thread needs it to run the job.
    let outcome = py.detach(|| {
        let mut slot = lock();
        loop {
            match slot.take() {
                Some(Job::Done(result)) => return Some(result),
                None => return None,
                Some(Job::Waiting(func)) if Instant::now() >= deadline => {
                    // Never started: taken back (the pending call finds nothing).
                    drop(slot);
                    Python::attach(|_| drop(func));
                    return None;
                }
                other => *slot = other,
            }
            // Running, or still waiting: a started job is waited for to its
            // end (the function keeps its own time budget).
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(5));
            slot = DONE
                .wait_timeout(slot, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    });
    outcome.map(|result| result.map(Some)).unwrap_or(Ok(None))
}

fn take_back() {
    let job = lock().take();
    if let Some(job) = job {
        Python::attach(|_| drop(job));
    }
}

/// Runs on the main thread, with the GIL, between two bytecodes.
extern "C" fn run_job(_: *mut c_void) -> c_int {
    let func = {
        let mut slot = lock();
        match slot.take() {
            Some(Job::Waiting(func)) => {
                *slot = Some(Job::Running);
                func
            }
            other => {
                *slot = other;
                return 0;
            }
        }
    };
    // The GIL is held here already; attach only makes that known to PyO3.
    // Always 0: -1 would raise in the program's own code.
    let result = Python::attach(|py| func.call0(py));
    *lock() = Some(Job::Done(result));
    DONE.notify_all();
    0
}
