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
//! The request starves not only before its first bytecode: its own code lets
//! the GIL go too (every file read of an import does) and must win it back
//! each time. So the sign of starving is a request in flight whose thread
//! gets little CPU and waits in `futex`, where a wait for the GIL is. The
//! nudger samples the in-flight threads' CPU clocks; when they ran less
//! than half of a [`NUDGE_AFTER`] window and one waits in `futex`, it asks the
//! main thread, through a pending call (run between two of its bytecodes,
//! where signal handlers run), to step aside. The main thread then releases
//! the GIL and waits while the requests use the time (a tenth of it at
//! least), at most [`PARK_AT_MOST`]; then the nudger lets it run at least as
//! long before it asks again, so a long eval shares the GIL about evenly.
//!
//! A request asleep or reading is never nudged for. One blocked in `futex`
//! on something other than the GIL (a lock of the program's) shows no
//! CPU in the first [`PROBE_WINDOW`] of a step aside: the main
//! thread goes on at once, and the nudger waits twice as long before it asks
//! again, up to [`BACKOFF_AT_MOST`]. A request that gets half the time
//! anyway is never nudged. The program only loses time; nothing else about
//! it changes. A main thread blocked in C holds no GIL, so there is nothing
//! to nudge; one that holds it in C never reaches the pending call.
//!
//! Lock order is the GIL, then `STATE`, never the other way round: no one
//! waits for the GIL while holding `STATE`.

use std::collections::BTreeMap;
use std::os::raw::{c_int, c_void};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

const NUDGE_AFTER: Duration = Duration::from_millis(10);
const PROBE_WINDOW: Duration = Duration::from_millis(5);
const PARK_AT_MOST: Duration = Duration::from_millis(100);
const BACKOFF_AT_MOST: Duration = Duration::from_secs(1);

/// A request between asking for the GIL and being done with it.
struct InFlight {
    /// Its thread's kernel id, to see what it is blocked in.
    tid: libc::pid_t,
    /// Its thread's CPU clock.
    clock: libc::clockid_t,
    /// That clock when the nudger last looked.
    seen: Duration,
}

#[derive(Default)]
struct State {
    next_id: u64,
    in_flight: BTreeMap<u64, InFlight>,
    /// Requests between asking for the GIL and being done with it, those
    /// with no CPU clock to watch included.
    inside: usize,
    /// The probe is stopping: no request starts on Python (see [`close`]).
    closed: bool,
    /// A pending call is queued and has not run yet.
    scheduled: bool,
    /// What the last step aside found: how long the requests ran in it
    /// (zero when they did not run at all).
    last_park: Option<Duration>,
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

fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer; a clock of a thread that is gone fails
    // with EINVAL and reads as zero.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn this_thread_clock() -> Option<libc::clockid_t> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: the calling thread's own handle and a valid out pointer.
    (unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) } == 0).then_some(clock)
}

/// CPU time the in-flight requests used since the last call, and the clocks
/// read again.
fn ran_since_last_look(st: &mut State) -> Duration {
    st.in_flight.values_mut().fold(Duration::ZERO, |sum, r| {
        let now = cpu_time(r.clock);
        let ran = now.saturating_sub(r.seen);
        r.seen = now;
        sum + ran
    })
}

/// Whether the thread is blocked in `futex`, where a wait for the GIL (or
/// any lock) is; a thread that cannot be read counts as waiting, as
/// before this check.
fn waits_on_a_lock(tid: libc::pid_t) -> bool {
    match std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")) {
        Ok(text) => match text.split_whitespace().next().map(str::parse::<i64>) {
            Some(Ok(nr)) => nr == libc::SYS_futex,
            // "running": it has the CPU, so not the GIL's wait.
            _ => false,
        },
        Err(_) => true,
    }
}

/// Times the main thread stepped aside for a request (for tests and `status`).
static PARKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times the main thread has stepped aside for the probe.
#[pyfunction]
pub fn gil_parks() -> u64 {
    PARKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `Python::try_attach` for a request: the same, but a main thread that
/// keeps the GIL to itself is asked to step aside.
pub fn attach<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> Option<R> {
    let id = {
        let mut st = lock();
        if st.closed {
            return None;
        }
        st.inside += 1;
        st.next_id += 1;
        let id = st.next_id;
        if let Some(clock) = this_thread_clock() {
            st.in_flight.insert(
                id,
                InFlight {
                    // SAFETY: gettid has no preconditions.
                    tid: unsafe { libc::syscall(libc::SYS_gettid) } as libc::pid_t,
                    clock,
                    seen: cpu_time(clock),
                },
            );
        }
        let pid = std::process::id();
        if st.nudger_pid != Some(pid) {
            let started = std::thread::Builder::new()
                .name("rankscope-gil".into())
                .spawn(nudger);
            st.nudger_pid = started.is_ok().then_some(pid);
        }
        id
    };
    state().1.notify_all();
    let result = Python::try_attach(f);
    {
        let mut st = lock();
        st.in_flight.remove(&id);
        st.inside -= 1;
    }
    state().1.notify_all();
    result
}

/// The probe is stopping as the interpreter exits: no request starts on
/// Python from now on, and those already on it get up to `limit` to end.
/// Returns how many are still on it. Once the interpreter finalizes, a
/// thread that takes the GIL back (after an `import`'s file read, a torch
/// call that let it go) is ended by `pthread_exit` where it stands, and
/// the unwind through a C++ destructor there (pybind11's) aborts the whole
/// process: exit code 134 for a program that had ended well.
pub fn close(limit: Duration) -> usize {
    let (_, wake) = state();
    let mut st = lock();
    st.closed = true;
    st = wake
        .wait_timeout_while(st, limit, |s| s.inside > 0)
        .unwrap_or_else(|e| e.into_inner())
        .0;
    st.inside
}

/// Whether [`close`] was called and no start since.
pub fn closed() -> bool {
    lock().closed
}

/// Requests may start on Python again (a probe started after a stop).
pub fn open() {
    lock().closed = false;
}

fn nudger() {
    let (_, wake) = state();
    let mut st = lock();
    let mut wait = NUDGE_AFTER;
    loop {
        if st.in_flight.is_empty() {
            wait = NUDGE_AFTER;
            st = wake
                .wait_while(st, |s| s.in_flight.is_empty())
                .unwrap_or_else(|e| e.into_inner());
            ran_since_last_look(&mut st);
        }
        let looked = Instant::now();
        st = wake
            .wait_timeout_while(st, wait, |s| !s.in_flight.is_empty())
            .unwrap_or_else(|e| e.into_inner())
            .0;
        if st.in_flight.is_empty() {
            continue;
        }
        let ran = ran_since_last_look(&mut st);
        if ran * 2 >= looked.elapsed() || st.scheduled {
            // Running at least half the time, or a nudge already on its way.
            continue;
        }
        if !st.in_flight.values().any(|r| waits_on_a_lock(r.tid)) {
            // Asleep or reading (an eval's `time.sleep`, a socket): the GIL
            // is not what holds it up, and parking the program would only
            // cost the program. A thread waiting for the GIL waits in futex.
            continue;
        }
        st.scheduled = true;
        st.last_park = None;
        drop(st);
        // SAFETY: Py_AddPendingCall may be called from any thread without
        // the GIL; `step_aside` has the signature it wants.
        let queued =
            unsafe { pyo3::ffi::Py_AddPendingCall(Some(step_aside), std::ptr::null_mut()) };
        st = lock();
        if queued != 0 {
            // A full queue (or a finalizing interpreter): try again later.
            st.scheduled = false;
            continue;
        }
        // Until the main thread has stepped aside (or the requests ended):
        // a main thread blocked in C reaches the call only when it returns.
        st = wake
            .wait_while(st, |s| s.scheduled && !s.in_flight.is_empty())
            .unwrap_or_else(|e| e.into_inner());
        wait = match st.last_park {
            Some(Duration::ZERO) => (wait * 2).min(BACKOFF_AT_MOST),
            // The program gets at least as long as the requests had: a long
            // eval shares the GIL about evenly instead of taking it all.
            Some(ran) => ran.max(NUDGE_AFTER),
            None => NUDGE_AFTER,
        };
        ran_since_last_look(&mut st);
    }
}

/// Runs on the main thread, with the GIL, between two bytecodes.
extern "C" fn step_aside(_: *mut c_void) -> c_int {
    // SAFETY: called by the interpreter with the GIL held on this thread;
    // the thread state is restored below before returning to it.
    let saved = unsafe { pyo3::ffi::PyEval_SaveThread() };
    PARKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    {
        let (_, wake) = state();
        let mut st = lock();
        st.scheduled = false;
        ran_since_last_look(&mut st);
        let parked = Instant::now();
        let mut ran_for = Duration::ZERO;
        while !st.in_flight.is_empty() && parked.elapsed() < PARK_AT_MOST {
            let window = Instant::now();
            st = wake
                .wait_timeout_while(st, PROBE_WINDOW, |s| !s.in_flight.is_empty())
                .unwrap_or_else(|e| e.into_inner())
                .0;
            let ran = ran_since_last_look(&mut st);
            if ran * 10 < window.elapsed() {
                // Blocked on something else: the time is the program's.
                break;
            }
            ran_for = parked.elapsed();
        }
        st.last_park = Some(ran_for);
    }
    state().1.notify_all();
    // SAFETY: the thread state saved above, on the same thread.
    unsafe { pyo3::ffi::PyEval_RestoreThread(saved) };
    0
}
