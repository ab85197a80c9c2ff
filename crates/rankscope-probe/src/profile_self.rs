//! `POST /v1/profile`: the probe samples its own process and answers with
//! the fold. The CLI samples a process from outside where it runs on the
//! same machine; a rank on another machine is reached only through its
//! probe's TCP endpoint, so there the probe does the sampling, with the
//! same sampler (py-spy's reader, non-blocking: no thread of the program
//! stops, and the GIL is never taken). It runs on the connection's own
//! thread, which the sampler leaves out as one of rankscope's.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rankscope_core::http::Response;
use rankscope_profile::{sample, wire, SampleOptions};
use serde_json::{json, Value};

/// Longer samplings are a mistake more often than a wish, and hold a
/// connection (and a thread) of the probe for as long.
const MAX_DURATION_S: f64 = 600.0;

fn answer(value: Value) -> Response {
    Response::json(200, value.to_string())
}

fn refuse(message: String, hint: &str) -> Response {
    answer(json!({"error": message, "hint": hint}))
}

/// Samplings in progress, by the `id` their requester gave them (if any),
/// with the flag that ends each early.
type Samplings = Vec<(Option<u64>, Arc<AtomicBool>)>;
static RUNNING: Mutex<Samplings> = Mutex::new(Vec::new());
/// Samplings whose answer is not written yet (see `Answering`).
static ANSWERING: AtomicUsize = AtomicUsize::new(0);

/// Held from a sampling's request until its answer is written.
pub struct Answering;

pub fn answering() -> Answering {
    ANSWERING.fetch_add(1, Ordering::SeqCst);
    Answering
}

impl Drop for Answering {
    fn drop(&mut self) {
        ANSWERING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The probe stops (the program exits, or `rankscope.stop()`): each
/// sampling ends at its next tick and answers with what it has, within
/// `wait`, rather than its requester losing it all with the connection.
pub fn end_all(wait: Duration) {
    for (_, stop) in lock_running().iter() {
        stop.store(true, Ordering::SeqCst);
    }
    let deadline = std::time::Instant::now() + wait;
    while ANSWERING.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One sampling's place in `RUNNING`, taken out when it ends.
struct Running {
    id: Option<u64>,
    stop: Arc<AtomicBool>,
}

impl Running {
    fn new(id: Option<u64>) -> Running {
        let stop = Arc::new(AtomicBool::new(false));
        lock_running().push((id, stop.clone()));
        Running { id, stop }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        lock_running().retain(|(i, stop)| !(*i == self.id && Arc::ptr_eq(stop, &self.stop)));
    }
}

fn lock_running() -> std::sync::MutexGuard<'static, Samplings> {
    RUNNING.lock().unwrap_or_else(|e| e.into_inner())
}

/// `POST /v1/profile/stop` `{"id": N}`: the sampling of that id ends at its
/// next tick and answers with what it has; `stopped` says whether one ran.
pub fn stop(body: &[u8]) -> Response {
    let Some(id) = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["id"].as_u64())
    else {
        return Response::error(400, "a stop request is JSON: {\"id\": N}");
    };
    let mut stopped = false;
    for (_, stop) in lock_running().iter().filter(|(i, _)| *i == Some(id)) {
        stop.store(true, Ordering::SeqCst);
        stopped = true;
    }
    answer(json!({"ok": {"stopped": stopped}}))
}

pub fn handle(body: &[u8], meta: Option<String>, gone: &dyn Fn() -> bool) -> Response {
    let _answering = answering();
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return Response::error(
            400,
            "a profile request is JSON: {\"duration_s\": 10, \"rate_hz\": 100}",
        );
    };
    let duration = request["duration_s"].as_f64().unwrap_or(f64::NAN);
    let rate = request["rate_hz"].as_f64().unwrap_or(f64::NAN);
    if !(duration > 0.0 && duration <= MAX_DURATION_S) {
        return refuse(
            format!("duration_s must be between 0 and {MAX_DURATION_S} seconds"),
            "e.g. --duration 10",
        );
    }
    if !(rate > 0.0 && rate <= 10_000.0) {
        return refuse(
            "rate_hz must be between 1 and 10000 samples a second".into(),
            "e.g. --rate 100",
        );
    }
    // The torch step, where the probe keeps one, and the rank: its own
    // metadata says.
    let meta = meta.and_then(|m| serde_json::from_str::<Value>(&m).ok());
    let step_address = meta.as_ref().and_then(|m| m["step_address"].as_u64());
    let rank = meta
        .as_ref()
        .filter(|m| !m["job_id"].is_null())
        .and_then(|m| m["rank"].as_i64());
    let options = SampleOptions {
        rate_hz: rate,
        duration: Duration::from_secs_f64(duration),
        native: false,
        all_frames: false,
        step_address,
    };
    // Ends with its duration, when its requester says stop (Ctrl-C), or
    // when it hangs up (a CLI killed), seen at the sampler's progress
    // calls, five a second.
    let running = Running::new(request["id"].as_u64());
    let stop = running.stop.clone();
    let watch = |_, _| {
        if gone() {
            stop.store(true, Ordering::SeqCst);
        }
    };
    match sample(std::process::id(), &options, &running.stop, watch) {
        Ok(mut profile) => {
            profile.rank = rank;
            // Kept where this process's own tables go, as the CLI keeps
            // the profiles it takes itself; a failure costs only that.
            let run_dir = rankscope_core::crash::run_dir_of(|name| std::env::var(name).ok());
            let _ = rankscope_profile::table::keep(
                &profile,
                &run_dir,
                &rankscope_core::host::hostname(),
            );
            answer(json!({"ok": wire::to_json(&profile)}))
        }
        Err(e) => refuse(
            format!("the probe could not sample its own process: {e}"),
            "sample it from its own machine with `rankscope PID profile`",
        ),
    }
}
