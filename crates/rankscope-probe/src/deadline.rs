//! Interrupting Python code that runs too long, from outside it.
//!
//! Eval and the reprs of `--locals` run user code on a probe thread. Python
//! code can arm a deadline around such a call; when it passes, a watchdog
//! thread raises an exception asynchronously in that thread
//! (`PyThreadState_SetAsyncExc`), which stops loops in bytecode. Code blocked
//! in C (a `sleep`) is only interrupted when it returns to bytecode, which is
//! why the CLI keeps its own deadline too.
//!
//! An armed eval may carry the client's id for it; [`interrupt`] (the REPL's
//! Ctrl-C) raises `KeyboardInterrupt` in that eval's thread by the same road,
//! so the same disarm withdraws it. Nothing wakes a C call sooner: outside
//! the main thread CPython retries `sleep`, lock waits and `select` on EINTR
//! without looking at async exceptions (measured on 3.11-3.13, with and
//! without a signal sent to the thread), so no signal is sent.
//!
//! Lock order is always GIL, then `STATE`: `arm` and `disarm` are called from
//! Python with the GIL held, and the watchdog drops `STATE` before it attaches.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

struct Entry {
    thread_ident: std::ffi::c_ulong,
    deadline: Instant,
    exception: Py<PyAny>,
    fired: bool,
    eval_id: Option<String>,
}

#[derive(Default)]
struct State {
    next_token: u64,
    entries: BTreeMap<u64, Entry>,
    watchdog_started: bool,
}

fn state() -> &'static (Mutex<State>, Condvar) {
    static STATE: OnceLock<(Mutex<State>, Condvar)> = OnceLock::new();
    STATE.get_or_init(|| (Mutex::new(State::default()), Condvar::new()))
}

/// Arms a deadline for the calling thread; returns a token for [`disarm`].
pub fn arm(seconds: f64, exception: Py<PyAny>, eval_id: Option<String>) -> u64 {
    // SAFETY: plain query of the calling thread's id.
    let thread_ident = unsafe { pyo3::ffi::PyThread_get_thread_ident() };
    let (lock, wake) = state();
    let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
    st.next_token += 1;
    let token = st.next_token;
    let deadline = Instant::now() + Duration::from_secs_f64(seconds.clamp(0.0, 86_400.0));
    st.entries.insert(
        token,
        Entry {
            thread_ident,
            deadline,
            exception,
            fired: false,
            eval_id,
        },
    );
    if !st.watchdog_started {
        let spawned = std::thread::Builder::new()
            .name("rankscope-deadline".into())
            .spawn(watchdog);
        st.watchdog_started = spawned.is_ok();
    }
    wake.notify_one();
    token
}

/// Disarms a deadline; also withdraws an exception that fired but was not
/// raised yet, so it cannot land in whatever this thread runs next.
pub fn disarm(token: u64) -> bool {
    let (lock, _) = state();
    let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
    match st.entries.remove(&token) {
        Some(entry) => {
            if entry.fired {
                // SAFETY: called with the GIL held (from Python); NULL clears.
                unsafe {
                    pyo3::ffi::PyThreadState_SetAsyncExc(
                        entry.thread_ident as _,
                        std::ptr::null_mut(),
                    )
                };
            }
            entry.fired
        }
        None => false,
    }
}

/// Raises `exception` now in the thread of the armed eval named `eval_id`;
/// false when none is armed (it ended) or it was already interrupted.
/// Called with the GIL held, as `SetAsyncExc` requires.
pub fn interrupt(_py: Python<'_>, eval_id: &str, exception: &Bound<'_, PyAny>) -> bool {
    let (lock, _) = state();
    let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
    let Some(entry) = st
        .entries
        .values_mut()
        .find(|e| e.eval_id.as_deref() == Some(eval_id))
    else {
        return false;
    };
    if entry.fired {
        return false;
    }
    entry.fired = true;
    // SAFETY: GIL held (the `_py` token); `exception` outlives the call.
    unsafe { pyo3::ffi::PyThreadState_SetAsyncExc(entry.thread_ident as _, exception.as_ptr()) };
    true
}

/// Raises each armed eval's exception in its thread now: the probe is
/// stopping as the program exits, and an eval still running would be ended
/// where it stands once the interpreter finalizes. Called with the GIL.
pub fn interrupt_all(_py: Python<'_>) -> usize {
    let (lock, _) = state();
    let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
    let mut fired = 0;
    for entry in st.entries.values_mut().filter(|e| !e.fired) {
        entry.fired = true;
        fired += 1;
        // SAFETY: GIL held (the `_py` token); the entry keeps the exception alive.
        unsafe {
            pyo3::ffi::PyThreadState_SetAsyncExc(entry.thread_ident as _, entry.exception.as_ptr())
        };
    }
    fired
}

/// After fork the watchdog thread does not exist in the child.
pub fn forget_after_fork() {
    let (lock, _) = state();
    if let Ok(mut st) = lock.try_lock() {
        // The Py objects are leaked rather than dropped: dropping needs the GIL
        // and this runs in the middle of fork handling.
        for (_, entry) in std::mem::take(&mut st.entries) {
            std::mem::forget(entry.exception);
        }
        st.watchdog_started = false;
    }
}

fn watchdog() {
    let (lock, wake) = state();
    loop {
        let due: Option<u64> = {
            let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                let now = Instant::now();
                let next = st
                    .entries
                    .iter()
                    .filter(|(_, e)| !e.fired)
                    .min_by_key(|(_, e)| e.deadline);
                match next {
                    None => st = wake.wait(st).unwrap_or_else(|e| e.into_inner()),
                    Some((token, e)) if e.deadline <= now => break Some(*token),
                    Some((_, e)) => {
                        let wait = e.deadline - now;
                        st = wake
                            .wait_timeout(st, wait)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
            }
        };
        let Some(token) = due else { continue };
        let attached = crate::gil::attach(|_py| {
            let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = st.entries.get_mut(&token) {
                if !entry.fired {
                    entry.fired = true;
                    // SAFETY: GIL held; the exception type is kept alive by the entry.
                    unsafe {
                        pyo3::ffi::PyThreadState_SetAsyncExc(
                            entry.thread_ident as _,
                            entry.exception.as_ptr(),
                        );
                    }
                }
            }
        });
        if attached.is_none() {
            // The interpreter is going away, or the probe stopping: nothing
            // left to interrupt. A probe started again starts a watchdog.
            lock.lock()
                .unwrap_or_else(|e| e.into_inner())
                .watchdog_started = false;
            return;
        }
    }
}
