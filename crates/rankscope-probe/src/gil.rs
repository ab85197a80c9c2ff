//! Getting the GIL for a request while the main thread keeps taking it back.
//!
//! A main thread that runs bytecode and often releases the GIL for a moment
//! (a `stat`, a short read, a torch op that drops it) can starve a probe
//! thread for as long as it runs: CPython forces a switch only when the
//! holder has kept the GIL a whole switch interval, and each short release
//! starts the count again, while the releasing thread takes the GIL back
//! before the woken waiter runs. Measured on 3.11: `bt` found no GIL in 30 s
//! against a loop that calls `os.path.exists` every 20,000 iterations.
//!
//! So a request that has waited [`NUDGE_AFTER`] for the GIL asks the main
//! thread, through a pending call (run between two of its bytecodes, where
//! signal handlers run), to step aside: it releases the GIL and waits until
//! the requests in flight are done, at most [`PARK_AT_MOST`], then goes on.
//! The program only loses that time; nothing else about it changes. A main
//! thread blocked in C holds no GIL, so there is nothing to nudge; one that
//! holds it in C never reaches the pending call, as before.
//!
//! Lock order is the GIL, then `STATE`, never the other way round: no one
//! waits for the GIL while holding `STATE`.

use std::os::raw::{c_int, c_void};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use pyo3::prelude::*;

const NUDGE_AFTER: Duration = Duration::from_millis(10);
const PARK_AT_MOST: Duration = Duration::from_millis(200);

#[derive(Default)]
struct State {
    /// Requests waiting for the GIL.
    waiting: usize,
    /// Requests between asking for the GIL and being done with it.
    in_flight: usize,
    /// A pending call is queued and has not run yet.
    scheduled: bool,
    /// The process the nudger thread runs in (a child after fork has none).
    nudger_pid: Option<u32>,
}

fn state() -> &'static (Mutex<State>, Condvar) {
    static STATE: OnceLock<(Mutex<State>, Condvar)> = OnceLock::new();
    STATE.get_or_init(|| (Mutex::new(State::default()), Condvar::new()))
}

fn lock() -> MutexGuard<'static, State> {
    state().0.lock().unwrap_or_else(|e| e.into_inner())
}

/// `Python::try_attach` for a request: the same, but a main thread that
/// keeps the GIL to itself is asked to step aside.
pub fn attach<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> Option<R> {
    {
        let mut st = lock();
        st.waiting += 1;
        st.in_flight += 1;
        let pid = std::process::id();
        if st.nudger_pid != Some(pid) {
            let started = std::thread::Builder::new()
                .name("rankscope-gil".into())
                .spawn(nudger);
            st.nudger_pid = started.is_ok().then_some(pid);
        }
    }
    state().1.notify_all();
    let mut counted = false;
    let result = Python::try_attach(|py| {
        lock().waiting -= 1;
        counted = true;
        f(py)
    });
    {
        let mut st = lock();
        if !counted {
            st.waiting -= 1;
        }
        st.in_flight -= 1;
    }
    state().1.notify_all();
    result
}

fn nudger() {
    let (_, wake) = state();
    let mut st = lock();
    loop {
        st = wake
            .wait_while(st, |s| s.waiting == 0)
            .unwrap_or_else(|e| e.into_inner());
        // The ordinary way first: an idle or fair main thread hands it over.
        let (next, _) = wake
            .wait_timeout_while(st, NUDGE_AFTER, |s| s.waiting > 0)
            .unwrap_or_else(|e| e.into_inner());
        st = next;
        if st.waiting > 0 && !st.scheduled {
            st.scheduled = true;
            drop(st);
            // SAFETY: Py_AddPendingCall may be called from any thread without
            // the GIL; `step_aside` has the signature it wants.
            let queued =
                unsafe { pyo3::ffi::Py_AddPendingCall(Some(step_aside), std::ptr::null_mut()) };
            st = lock();
            if queued != 0 {
                // A full queue (or a finalizing interpreter): try again later.
                st.scheduled = false;
            }
        }
        // Give the main thread time to reach the call before looking again.
        let (next, _) = wake
            .wait_timeout_while(st, NUDGE_AFTER, |s| s.waiting > 0)
            .unwrap_or_else(|e| e.into_inner());
        st = next;
    }
}

/// Runs on the main thread, with the GIL, between two bytecodes.
extern "C" fn step_aside(_: *mut c_void) -> c_int {
    lock().scheduled = false;
    // SAFETY: called by the interpreter with the GIL held on this thread;
    // the thread state is restored below before returning to it.
    let saved = unsafe { pyo3::ffi::PyEval_SaveThread() };
    {
        let st = lock();
        let _ = state()
            .1
            .wait_timeout_while(st, PARK_AT_MOST, |s| s.in_flight > 0);
    }
    // SAFETY: the thread state saved above, on the same thread.
    unsafe { pyo3::ffi::PyEval_RestoreThread(saved) };
    0
}
