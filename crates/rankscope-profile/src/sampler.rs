//! Reading a process's stacks at a fixed rate, from outside.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use py_spy::config::LockingStrategy;
use py_spy::{Config, PythonSpy};

use remoteprocess::ProcessMemory;

use crate::profile::{FrameRef, Profile};
use crate::ProfileError;

#[derive(Debug, Clone)]
pub struct SampleOptions {
    pub rate_hz: f64,
    pub duration: Duration,
    /// Native frames too: py-spy pauses each thread to unwind it.
    pub native: bool,
    /// rankscope's own threads and frames stay in (they are left out otherwise).
    pub all_frames: bool,
    /// Where the target's probe keeps the torch step (its metadata's
    /// `step_address`): read at each sample, 8 bytes, without stopping it.
    pub step_address: Option<u64>,
}

/// rankscope's own threads (the probe's server, its store and sampler)
/// are named `rankscope-*`; they are not the user's program.
pub fn is_probe_thread(pid: u32, tid: Option<u64>) -> bool {
    let Some(tid) = tid else { return false };
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .is_ok_and(|name| name.starts_with("rankscope-"))
}

/// The probe's Python, and (with `--native`) its native library's frames:
/// a torch feature's stand-in runs the model's `forward` from there.
fn is_own_frame(file: &str, module: Option<&str>) -> bool {
    match module {
        Some(library) => library.contains("/rankscope/_native."),
        None => file.contains("/rankscope/_probe/"),
    }
}

/// Samples `pid` until `options.duration` has passed, `stop` is set, or the
/// process is gone; `progress(ticks, elapsed)` is called about five times a
/// second.
pub fn sample(
    pid: u32,
    options: &SampleOptions,
    stop: &AtomicBool,
    mut progress: impl FnMut(u64, f64),
) -> Result<Profile, ProfileError> {
    let config = Config {
        native: options.native,
        // Non-blocking: the target never stops for a sample (a read may
        // see a stack that changes under it, rarely: such a read fails or
        // is slightly off, and is counted as it is).
        blocking: if options.native {
            LockingStrategy::Lock
        } else {
            LockingStrategy::NonBlocking
        },
        include_idle: true,
        collect_thread_names: true,
        full_filenames: true,
        ..Config::default()
    };
    let mut spy = PythonSpy::new(pid as py_spy::Pid, &config).map_err(|e| ProfileError::Read {
        pid,
        message: crate::reasons(e.as_ref()),
    })?;
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut profile = Profile::new(pid, options.rate_hz, wall);
    let interval = Duration::from_secs_f64(1.0 / options.rate_hz.max(0.001));
    let catch_up = (interval * 20).max(Duration::from_millis(100));
    let start = Instant::now();
    let mut next = start;
    let mut last_progress = start;
    // Whether each thread is the probe's: read from /proc once per thread,
    // not at every tick (at 1 kHz over 9 threads that was 9,000 file reads
    // a second, and a fifth of the ticks missed).
    let mut probe_threads: std::collections::HashMap<u64, bool> = Default::default();
    // Each Python thread id's OS thread, to see an id the system gave again
    // to a new thread: py-spy keeps names by the Python id, and would give
    // the new thread the old one's name.
    let mut os_threads: std::collections::HashMap<u64, u64> = Default::default();
    while start.elapsed() < options.duration && !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let end = start + options.duration;
        if next >= end {
            // The next tick falls past the end (a low rate): the duration
            // asked for is waited out, not a whole interval more.
            std::thread::sleep(end.saturating_duration_since(now));
            break;
        }
        if next > now {
            std::thread::sleep(next - now);
        } else if now - next > catch_up {
            // Reads fell far behind: those ticks are not taken, and said
            // so. A shorter lag (the sampler waited for a core) is made up
            // by reading without sleeping, as py-spy record does.
            let behind = ((now - next).as_secs_f64() / interval.as_secs_f64()) as u64;
            profile.missed += behind;
            next += interval * behind as u32;
        }
        next += interval;
        let at = start.elapsed().as_secs_f64();
        if let Some(address) = options.step_address {
            // i64::MIN: the probe knows no step now (its torch clock is off).
            let step = spy.process.copy_struct::<i64>(address as usize).ok();
            profile.set_step(step.filter(|&s| s != i64::MIN), at);
        }
        match spy.get_stack_traces() {
            Ok(traces) => {
                profile.ticks += 1;
                for trace in traces {
                    // A thread with no frame at this tick runs no Python
                    // code: one being started (which has its creator's
                    // Python id until it runs, so it read as a second,
                    // empty sample of its creator), one ending, or a
                    // native thread that once called into Python (gloo's
                    // loop). It has no stack to show.
                    if trace.frames.is_empty() {
                        continue;
                    }
                    if !options.all_frames {
                        let tid = trace.os_thread_id;
                        let ours = *probe_threads
                            .entry(tid.unwrap_or(trace.thread_id))
                            .or_insert_with(|| is_probe_thread(pid, tid));
                        if ours {
                            continue;
                        }
                    }
                    let mut name = trace.thread_name.clone().unwrap_or_default();
                    if let Some(os) = trace.os_thread_id {
                        if os_threads
                            .insert(trace.thread_id, os)
                            .is_some_and(|was| was != os)
                        {
                            // Its name is read again at the next tick.
                            spy.python_thread_names.remove(&trace.thread_id);
                            name.clear();
                        }
                    }
                    let thread =
                        profile.thread(trace.os_thread_id.unwrap_or(trace.thread_id), &name);
                    let frames: Vec<FrameRef<'_>> = trace
                        .frames
                        .iter()
                        .rev()
                        .filter(|f| {
                            options.all_frames || !is_own_frame(&f.filename, f.module.as_deref())
                        })
                        .map(|f| FrameRef {
                            func: &f.name,
                            file: &f.filename,
                            line: i64::from(f.line),
                        })
                        .collect();
                    profile.add_sample(thread, &frames, !trace.active, trace.owns_gil, at);
                }
            }
            Err(_) if gone(pid) => break,
            Err(_) => profile.errors += 1,
        }
        if last_progress.elapsed() >= Duration::from_millis(200) {
            progress(profile.ticks, start.elapsed().as_secs_f64());
            last_progress = Instant::now();
        }
    }
    profile.finish(start.elapsed().as_secs_f64());
    progress(profile.ticks, profile.duration_s);
    Ok(profile)
}

/// Whether the process has ended: no `/proc/PID`, or a zombie (it exited
/// and its parent has not reaped it yet), whose entry stays.
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's closing parenthesis.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| matches!(state, 'Z' | 'X')),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::{gone, is_own_frame};

    #[test]
    fn a_process_that_exited_is_gone_before_it_is_reaped() {
        assert!(!gone(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // Not reaped yet: a zombie, whose /proc entry stays.
        while !gone(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never ended"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        child.wait().unwrap();
        assert!(gone(pid));
    }

    #[test]
    fn the_probes_python_and_native_frames_are_its_own() {
        let lib = "/venv/lib/python3.13/site-packages/rankscope/_native.abi3.so";
        assert!(is_own_frame(
            "/venv/site-packages/rankscope/_probe/torch/timed.py",
            None
        ));
        assert!(is_own_frame(lib, Some(lib)));
        assert!(!is_own_frame("/job/train.py", None));
        let torch = "/venv/site-packages/torch/lib/libtorch_cpu.so";
        assert!(!is_own_frame(torch, Some(torch)));
        // A native frame is judged by its library, not its source file.
        assert!(!is_own_frame("/src/rankscope/_probe/x.c", Some(torch)));
    }
}
