pub mod breakpoints;
pub mod cluster;
pub mod crashes;
pub mod dap;
pub mod debug;
pub mod demo;
pub mod inject;
pub mod list;
pub mod memory;
pub mod profile;
pub mod query;
pub mod repl;
pub mod run;
pub mod torch;

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use rankscope_core::protocol::{EvalReply, EvalRequest};

use crate::client::Probe;
use crate::hint::Hinted;
use crate::{outside, stacks_text, Action, BtFormat};

/// The longest wait a flag may ask for: a day (a number past what a
/// `Duration` holds panicked).
pub const MAX_WAIT_S: f64 = 86_400.0;

pub(crate) fn seconds(value: f64, flag: &str) -> Result<Duration> {
    if !(value.is_finite() && value > 0.0 && value <= MAX_WAIT_S) {
        return Err(Hinted::new(
            format!("{flag} must be a positive number of seconds up to {MAX_WAIT_S:.0} (a day), not {value}"),
            format!("e.g. {flag} 5"),
        )
        .into());
    }
    Ok(Duration::from_secs_f64(value))
}

/// How long `bt` waits for a probe before reading from outside instead.
const PROBE_DEADLINE_S: f64 = 1.0;

pub fn on_pid(pid: u32, action: Action) -> Result<u8> {
    if let Action::Bt {
        locals,
        native,
        format,
        timeout,
        all_frames,
    } = action
    {
        let deadline = seconds(timeout.unwrap_or(PROBE_DEADLINE_S), "--timeout")?;
        return bt(pid, locals, native, all_frames, format, deadline);
    }
    if let Action::Profile(args) = action {
        return profile::run(pid, args);
    }
    let probe = Probe::locate(pid)?;
    match action {
        Action::Bt { .. } | Action::Profile(_) => unreachable!("handled above"),
        Action::Eval {
            code,
            file,
            timeout,
            at,
        } => {
            seconds(timeout, "--timeout")?;
            let code = match (code, file) {
                (_, Some(path)) => std::fs::read_to_string(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?,
                (Some(code), None) => code,
                (None, None) => unreachable!("clap requires one of them"),
            };
            let reply = eval_at(
                &probe,
                &EvalRequest::new(code, timeout).at(at.thread, at.frame),
            )?;
            Ok(print_eval(&reply))
        }
        Action::Repl { timeout, at } => {
            if let Some(timeout) = timeout {
                seconds(timeout, "--timeout")?;
            }
            repl::run(&probe, timeout, &at)
        }
        Action::Query {
            sql,
            native,
            format,
            all_frames,
        } => query::run(probe, &sql, native, all_frames, format),
        Action::Break { action } => breakpoints::run(&probe, action),
        Action::Snapshots { format } => breakpoints::snapshots(&probe, format),
        Action::Watch { spec, name, tensor } => breakpoints::watch(&probe, &spec, &name, tensor),
        Action::Attach { thread, wait } => {
            breakpoints::attach(&probe, thread.as_deref(), seconds(wait, "--wait")?)
        }
        Action::Torch { action, format } => torch::run(&probe, action, format),
        Action::Memory {
            action,
            top,
            format,
        } => memory::run(&probe, action, top, format),
    }
}

/// Asks the probe first; without one, or when it does not answer within the
/// deadline (a thread holding the GIL in C blocks it), reads from outside.
fn bt(
    pid: u32,
    locals: bool,
    native: bool,
    all_frames: bool,
    format: BtFormat,
    deadline: Duration,
) -> Result<u8> {
    let probe = Probe::find(pid)?;
    let (meta, stacks, note) = match probe {
        // Only the outside read sees native frames; the probe still names the process.
        Some(probe) if native => {
            let (stacks, version) = outside::read_stacks(pid, locals, true, all_frames)?;
            let meta = probe
                .meta(deadline)
                .unwrap_or_else(|_| outside::meta_from_proc(pid, version));
            (meta, stacks, None)
        }
        Some(probe) => match probe
            .stacks(locals, all_frames, deadline)
            .and_then(|s| Ok((probe.meta(deadline)?, s)))
        {
            Ok((meta, stacks)) => (meta, stacks, None),
            Err(probe_err) => {
                let (stacks, version) = outside::read_stacks(pid, locals, false, all_frames)
                    .map_err(|outside_err| {
                        outside_err.context(format!("and the probe failed too: {probe_err:#}"))
                    })?;
                let note = format!(
                    "note: the probe did not answer ({}); stacks were read from outside the process",
                    first_line(&probe_err)
                );
                (outside::meta_from_proc(pid, version), stacks, Some(note))
            }
        },
        None => {
            let (stacks, version) = outside::read_stacks(pid, locals, native, all_frames)?;
            let note =
                "note: no probe in this process; stacks were read from outside it".to_string();
            (outside::meta_from_proc(pid, version), stacks, Some(note))
        }
    };
    if let Some(note) = &note {
        eprintln!("{note}");
    }
    let mut stdout = std::io::stdout().lock();
    match format {
        BtFormat::Json => writeln!(stdout, "{}", serde_json::to_string_pretty(&stacks)?)?,
        BtFormat::Text => stdout.write_all(stacks_text::render(&meta, &stacks).as_bytes())?,
    }
    Ok(0)
}

/// Runs an eval request; a thread or frame that is not there is a hinted
/// error, and so is a probe too old to know `--thread`/`--frame` (it would
/// have run the code in `__main__`).
pub fn eval_at(probe: &Probe, request: &EvalRequest) -> Result<EvalReply> {
    let reply = probe.eval(request)?;
    if let Some(hint) = &reply.hint {
        return Err(Hinted::new(
            reply.error.clone().unwrap_or_default().trim_end(),
            hint.clone(),
        )
        .into());
    }
    if request.in_frame() && !request.check_only && reply.frame.is_none() {
        return Err(Hinted::new(
            format!("the probe of PID {} does not know --thread and --frame (an older rankscope)", probe.pid),
            "use the rankscope command from the same install as the target's package, or leave out --thread/--frame",
        )
        .into());
    }
    Ok(reply)
}

pub fn first_line(err: &anyhow::Error) -> String {
    err.to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Prints what the code printed, then its value or its traceback. Exit code 1
/// when it raised, so scripts can tell.
pub fn print_eval(reply: &EvalReply) -> u8 {
    print!("{}", reply.stdout);
    eprint!("{}", reply.stderr);
    for note in &reply.notes {
        eprintln!("note: {note}");
    }
    if let Some(value) = &reply.value {
        println!("{value}");
    }
    let _ = std::io::stdout().flush();
    match &reply.error {
        Some(error) => {
            eprint!("{error}");
            if !error.ends_with('\n') {
                eprintln!();
            }
            1
        }
        None => 0,
    }
}
