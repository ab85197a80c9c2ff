//! `rankscope PID repl`: line editing and history here, execution there.
//!
//! Pasted lines: rustyline reads the terminal through a buffer, and without
//! its `buffer-redux` feature that buffer is dropped when `readline` returns,
//! so the lines after the first of a paste were lost; the feature keeps them
//! for the next `readline`. A terminal with bracketed paste hands the whole
//! paste over as one edit, which runs as one block on Enter.
//!
//! Ctrl-C: while a line is edited the terminal is raw and rustyline reads
//! Ctrl-C as a key. While an eval runs the terminal is cooked, so Ctrl-C is a
//! SIGINT, caught here; it asks the probe to raise `KeyboardInterrupt` in the
//! eval's thread. A call blocked in C there (a `sleep`, a lock, I/O) cannot be
//! woken from outside the main thread, so the exception lands when it
//! returns; a second Ctrl-C stops waiting for it and gives the prompt back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Result;
use rankscope_core::protocol::{EvalReply, EvalRequest};
use rustyline::error::ReadlineError;
use rustyline::DefaultEditor;

use crate::client::Probe;
use crate::FrameArgs;

/// Without `--timeout`, an input runs until it ends or Ctrl-C stops it, as in
/// Python's own REPL; the probe's watchdog accepts at most a day.
const NO_TIMEOUT_S: f64 = 86_400.0;
const CHECK_TIMEOUT_S: f64 = 3.0;
/// How long an interrupted eval may take to answer before we say that it is
/// blocked in C.
const INTERRUPT_GRACE: Duration = Duration::from_millis(700);

fn history_file() -> Option<std::path::PathBuf> {
    std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".rankscope_history"))
}

pub fn run(probe: &Probe, timeout_s: Option<f64>, at: &FrameArgs) -> Result<u8> {
    let timeout_s = timeout_s.unwrap_or(NO_TIMEOUT_S);
    let meta = probe.meta(Duration::from_secs(5))?;
    let request = |code: String, timeout_s: f64| {
        EvalRequest::new(code, timeout_s).at(at.thread.clone(), at.frame)
    };
    let place = match request(String::new(), CHECK_TIMEOUT_S) {
        // Nothing runs; a thread or frame that is not there ends the session
        // before it starts, and one that is says where it is.
        empty if empty.in_frame() => super::eval_at(probe, &empty)?.frame.unwrap_or_default(),
        _ => "its __main__".to_string(),
    };
    println!(
        "rankscope repl in PID {} (Python {}, rank {}); code runs in {place}. Ctrl-C interrupts, Ctrl-D leaves.",
        meta.pid, meta.python_version, meta.rank
    );
    let mut editor = DefaultEditor::new()?;
    let history = history_file();
    if let Some(path) = &history {
        let _ = editor.load_history(path);
    }
    let _sigint = SigintCatcher::install();
    let mut evals = 0u64;
    let mut buffer = String::new();
    loop {
        let prompt = if buffer.is_empty() { ">>> " } else { "... " };
        match editor.readline(prompt) {
            Ok(line) => {
                if buffer.is_empty() && line.trim().is_empty() {
                    continue;
                }
                // As Python's own REPL: these leave. Sent, `exit()` would
                // close the target's sys.stdin (site's Quitter does).
                if buffer.is_empty() && matches!(line.trim(), "exit()" | "quit()" | "exit" | "quit")
                {
                    break;
                }
                if !buffer.is_empty() {
                    buffer.push('\n');
                }
                buffer.push_str(&line);
                // Only codeop runs for this: a short wait, so that a target whose GIL
                // is held cannot hang the prompt (Ctrl-C is caught here).
                let check = EvalRequest {
                    check_only: true,
                    ..request(buffer.clone(), CHECK_TIMEOUT_S)
                };
                let check = match probe.eval(&check) {
                    Ok(check) => check,
                    Err(err) if !rankscope_core::paths::pid_alive(probe.pid) => return Err(err),
                    Err(err) => {
                        crate::hint::report(&err);
                        buffer.clear();
                        continue;
                    }
                };
                if check.incomplete {
                    continue;
                }
                let _ = editor.add_history_entry(buffer.trim_end());
                evals += 1;
                let id = format!("repl-{}-{evals}", std::process::id());
                let request = EvalRequest {
                    id: Some(id),
                    ..request(std::mem::take(&mut buffer), timeout_s)
                };
                match eval_interruptibly(probe, request) {
                    Ok(Some(reply)) => {
                        super::print_eval(&reply);
                    }
                    Ok(None) => {}
                    Err(err) => {
                        crate::hint::report(&err);
                    }
                }
            }
            Err(ReadlineError::Interrupted) => {
                buffer.clear();
                println!("KeyboardInterrupt");
            }
            Err(ReadlineError::Eof) => break,
            Err(err) => return Err(err.into()),
        }
    }
    if let Some(path) = &history {
        let _ = editor.save_history(path);
    }
    Ok(0)
}

/// Runs one eval on a thread of its own while this one watches for Ctrl-C.
/// `None` when the user stopped waiting for an eval blocked in C.
fn eval_interruptibly(probe: &Probe, request: EvalRequest) -> Result<Option<EvalReply>> {
    let id = request.id.clone().unwrap_or_default();
    let (sender, replies) = mpsc::channel();
    let worker = probe.clone();
    SIGINT_SEEN.store(false, Ordering::SeqCst);
    std::thread::Builder::new()
        .name("rankscope-eval".into())
        .spawn(move || {
            // SIGINT goes to the watching thread, never interrupts this read.
            block_sigint_here();
            let _ = sender.send(super::eval_at(&worker, &request));
        })?;
    let mut interrupted_at: Option<Instant> = None;
    let mut told_blocked = false;
    loop {
        match replies.recv_timeout(Duration::from_millis(20)) {
            Ok(reply) => return reply.map(Some),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                anyhow::bail!("the eval's thread ended without an answer")
            }
        }
        if SIGINT_SEEN.swap(false, Ordering::SeqCst) {
            if interrupted_at.is_some() {
                eprintln!(
                    "stopped waiting; in process {} the eval stops with KeyboardInterrupt once its call into C returns (its output is dropped)",
                    probe.pid
                );
                return Ok(None);
            }
            interrupted_at = Some(Instant::now());
            match probe.interrupt_eval(&id, Duration::from_secs(2)) {
                Ok(_) => {}
                Err(err) => {
                    told_blocked = true;
                    eprintln!(
                        "cannot interrupt the eval: {}; press Ctrl-C again to stop waiting for it",
                        super::first_line(&err)
                    );
                }
            }
        }
        if let Some(at) = interrupted_at {
            if !told_blocked && at.elapsed() >= INTERRUPT_GRACE {
                told_blocked = true;
                eprintln!(
                    "KeyboardInterrupt sent; the code is blocked in a call into C (time.sleep, a lock, I/O), which Python \
                     cannot interrupt outside the main thread: it stops when that call returns. Ctrl-C again stops waiting."
                );
            }
        }
    }
}

pub(crate) static SIGINT_SEEN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    SIGINT_SEEN.store(true, Ordering::SeqCst);
}

/// Catches SIGINT for the REPL's lifetime (rustyline swaps in its own handler
/// during each `readline` and puts this one back), and restores the previous
/// disposition when dropped.
pub(crate) struct SigintCatcher {
    previous: libc::sigaction,
    /// SIGTERM's, where it is caught too (`with_sigterm`).
    previous_term: Option<libc::sigaction>,
}

impl SigintCatcher {
    pub(crate) fn install() -> SigintCatcher {
        SigintCatcher {
            previous: catch(libc::SIGINT),
            previous_term: None,
        }
    }

    /// SIGTERM too (`timeout`, a job scheduler ending the command): a
    /// profile ends early and still writes what it has, as on Ctrl-C.
    pub(crate) fn with_sigterm() -> SigintCatcher {
        SigintCatcher {
            previous: catch(libc::SIGINT),
            previous_term: Some(catch(libc::SIGTERM)),
        }
    }
}

fn catch(signal: libc::c_int) -> libc::sigaction {
    // SAFETY: sigaction with a handler that only stores to an atomic.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        let mut previous: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, &action, &mut previous);
        previous
    }
}

impl Drop for SigintCatcher {
    fn drop(&mut self) {
        // SAFETY: restores what `install` saved.
        unsafe {
            libc::sigaction(libc::SIGINT, &self.previous, std::ptr::null_mut());
            if let Some(term) = &self.previous_term {
                libc::sigaction(libc::SIGTERM, term, std::ptr::null_mut());
            }
        }
    }
}

fn block_sigint_here() {
    // SAFETY: changes only the calling thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}
