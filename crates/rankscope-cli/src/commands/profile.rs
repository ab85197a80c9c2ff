//! `rankscope PID profile`: samples a process for a while and writes a flame
//! graph, a speedscope or Chrome trace file, folded stacks, or a top table.
//! The work is `rankscope-profile`'s; this is the command around it.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Result;
use rankscope_profile::formats::{self, Format, WriteOptions};
use rankscope_profile::{sample, SampleOptions};

use super::repl::{SigintCatcher, SIGINT_SEEN};
use crate::client::Probe;
use crate::hint::Hinted;
use crate::outside;

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// Seconds to sample (Ctrl-C ends early and still writes)
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Samples a second
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Native (C, C++, Rust) frames too; pauses each thread briefly at every sample
    #[arg(long)]
    pub native: bool,
    /// Only idle samples (sleeping, or waiting on a lock, I/O or a collective); by default they are kept and marked [idle]
    #[arg(long)]
    pub idle: bool,
    /// Leave idle samples out
    #[arg(long)]
    pub no_idle: bool,
    /// Only samples of threads holding the GIL
    #[arg(long)]
    pub gil: bool,
    /// .svg (flame graph), .speedscope.json, .json (Chrome/Perfetto), .folded or .txt; without it, the top table
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Folded stacks without the `pid;thread;` prefix
    #[arg(long)]
    pub no_prefix: bool,
    /// Frames as function and file, without line numbers
    #[arg(long)]
    pub no_lines: bool,
    /// Rows of the top table
    #[arg(long, default_value_t = 20)]
    pub top: usize,
}

pub fn run(pid: u32, args: ProfileArgs) -> Result<u8> {
    if !(args.duration.is_finite() && args.duration > 0.0) {
        return Err(Hinted::new(
            format!(
                "--duration must be a positive number of seconds, not {}",
                args.duration
            ),
            "e.g. --duration 10",
        )
        .into());
    }
    if !(args.rate.is_finite() && args.rate > 0.0 && args.rate <= 10_000.0) {
        return Err(Hinted::new(
            format!(
                "--rate must be between 1 and 10000 samples a second, not {}",
                args.rate
            ),
            "e.g. --rate 100",
        )
        .into());
    }
    if args.idle && args.no_idle {
        return Err(Hinted::new(
            "--idle and --no-idle contradict each other",
            "--idle keeps only idle samples, --no-idle drops them",
        )
        .into());
    }
    let path = args
        .output
        .as_ref()
        .map(|p| p.to_string_lossy().into_owned());
    if let Some(path) = &path {
        Format::of(path).map_err(|_| {
            Hinted::new(
                format!("cannot tell the format of {path}"),
                "end the name in .svg, .speedscope.json, .json (Chrome/Perfetto), .folded or .txt",
            )
        })?;
    }
    if args.native {
        outside::require_native()?;
    }
    // A probe, where there is one, names the rank; sampling never needs it.
    let rank = Probe::find(pid)
        .ok()
        .flatten()
        .and_then(|probe| probe.meta(Duration::from_millis(500)).ok())
        .and_then(|meta| meta.job_id.map(|_| meta.rank));
    let options = SampleOptions {
        rate_hz: args.rate,
        duration: Duration::from_secs_f64(args.duration),
        native: args.native,
        all_frames: false,
    };
    if args.native {
        eprintln!(
            "note: --native pauses each thread briefly at every sample, to unwind its native stack"
        );
    }
    let tty = std::io::stderr().is_terminal();
    SIGINT_SEEN.store(false, Ordering::SeqCst);
    let catcher = SigintCatcher::install();
    let result = sample(pid, &options, &SIGINT_SEEN, |ticks, elapsed| {
        if tty {
            eprint!(
                "\rsampling PID {pid}: {ticks} samples, {elapsed:.1}/{:.0} s (Ctrl-C ends early) ",
                args.duration
            );
            let _ = std::io::stderr().flush();
        }
    });
    drop(catcher);
    if tty {
        eprintln!();
    }
    let mut profile = result.map_err(|e| {
        let text = e.to_string();
        if text.contains("Permission denied") || text.contains("Operation not permitted") {
            anyhow::Error::from(Hinted::new(
                format!("not allowed to read the memory of PID {pid}"),
                outside::permission_hint(),
            ))
        } else {
            Hinted::new(
                text,
                "is it a running CPython 3.11-3.13 process? `rankscope list` shows the probed ones",
            )
            .into()
        }
    })?;
    profile.rank = rank;
    if args.idle {
        profile.retain(|k| k.idle);
    } else if args.no_idle {
        profile.retain(|k| !k.idle);
    }
    if args.gil {
        profile.retain(|k| k.gil);
    }
    let write = WriteOptions {
        lines: !args.no_lines,
        prefix: !args.no_prefix,
        top: args.top,
    };
    match path {
        Some(path) => {
            let format = formats::write(&profile, &path, &write)?;
            let missed = if profile.missed > 0 {
                format!(
                    ", {} ticks missed (reads slower than the rate)",
                    profile.missed
                )
            } else {
                String::new()
            };
            println!(
                "wrote {path} ({format}): {} samples over {:.1} s{missed}",
                profile.total(),
                profile.duration_s
            );
        }
        None => print!("{}", formats::top(&profile, &write)),
    }
    Ok(0)
}
