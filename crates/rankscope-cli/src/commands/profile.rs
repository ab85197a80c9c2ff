//! `rankscope PID profile`: samples a process for a while and writes a flame
//! graph, a speedscope or Chrome trace file, folded stacks, or a top table.
//! `rankscope cluster profile` does the same for every rank of a job at
//! once: from outside for the ranks on this machine, through their probes
//! (`POST /v1/profile`) for those on others. The work is `rankscope-profile`'s; these are the
//! commands around it.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use rankscope_profile::formats::{self, Format, WriteOptions};
use rankscope_profile::{sample, JobProfile, Profile, SampleOptions};

use super::cluster;
use super::repl::{SigintCatcher, SIGINT_SEEN};
use crate::client::Probe;
use crate::hint::Hinted;
use crate::outside;

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// Seconds to sample (Ctrl-C ends early and still writes)
    #[arg(long, default_value_t = 10.0, allow_negative_numbers = true)]
    pub duration: f64,
    /// Samples a second
    #[arg(long, default_value_t = 100.0, allow_negative_numbers = true)]
    pub rate: f64,
    /// Native (C, C++, Rust) frames too; pauses each thread briefly at every sample
    #[arg(long)]
    pub native: bool,
    /// Only idle samples (sleeping, or waiting on a lock, I/O or a collective); by default they are kept and marked [idle]
    #[arg(long)]
    pub idle: bool,
    /// Leave idle samples out (but those of a thread that waits holding the GIL, which stalls the others)
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
    /// Have the process's probe sample it (where reading its memory from
    /// outside is not allowed); taken on its own when that read is refused
    #[arg(long)]
    pub inside: bool,
}

/// The longest profile asked for (30 days): past it a deadline no longer
/// fits the clock's arithmetic.
const MAX_DURATION_S: f64 = 30.0 * 86_400.0;

impl ProfileArgs {
    /// Checks the options; the output's format, where one is named.
    fn check(&self) -> Result<Option<String>> {
        if !(self.duration.is_finite() && self.duration > 0.0) {
            return Err(Hinted::new(
                format!(
                    "--duration must be a positive number of seconds, not {}",
                    self.duration
                ),
                "e.g. --duration 10",
            )
            .into());
        }
        if self.duration > MAX_DURATION_S {
            return Err(Hinted::new(
                format!(
                    "--duration must be at most {MAX_DURATION_S:.0} seconds (30 days), not {}",
                    self.duration
                ),
                "to sample until you stop it, give a long one and press Ctrl-C: the profile so far is written",
            )
            .into());
        }
        // Below one a second, a tick would be further apart than a Ctrl-C
        // is waited for, and a short --duration would get no sample.
        if !(self.rate.is_finite() && self.rate >= 1.0 && self.rate <= 10_000.0) {
            return Err(Hinted::new(
                format!(
                    "--rate must be between 1 and 10000 samples a second, not {}",
                    self.rate
                ),
                "e.g. --rate 100",
            )
            .into());
        }
        if self.idle && self.no_idle {
            return Err(Hinted::new(
                "--idle and --no-idle contradict each other",
                "--idle keeps only idle samples, --no-idle drops them",
            )
            .into());
        }
        let path = self
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
        if let Some(output) = &self.output {
            // Said now, not after the whole duration was sampled for nothing.
            writable_folder(output)?;
        }
        if self.native && self.inside {
            return Err(Hinted::new(
                "--native and --inside do not go together",
                "the probe samples its own process without native frames; leave one out",
            )
            .into());
        }
        if self.native {
            outside::require_native()?;
        }
        Ok(path)
    }

    /// Says so on stderr when the filters left no sample of `before`.
    fn note_if_filtered_out(&self, before: u64, after: u64) {
        if before == 0 || after > 0 {
            return;
        }
        let filters: Vec<&str> = [
            (self.gil, "--gil"),
            (self.idle, "--idle"),
            (self.no_idle, "--no-idle"),
        ]
        .into_iter()
        .filter_map(|(on, flag)| on.then_some(flag))
        .collect();
        let why = if self.gil && self.idle {
            ": no thread held the GIL while idle (only C code that blocks without releasing it does)"
        } else {
            ""
        };
        eprintln!(
            "note: {} left none of the {before} samples{why}",
            filters.join(" ")
        );
    }

    fn sample_options(&self) -> SampleOptions {
        SampleOptions {
            rate_hz: self.rate,
            duration: Duration::from_secs_f64(self.duration),
            native: self.native,
            all_frames: false,
            step_address: None,
        }
    }

    fn write_options(&self) -> WriteOptions {
        WriteOptions {
            lines: !self.no_lines,
            prefix: !self.no_prefix,
            top: self.top,
        }
    }

    /// `--idle`, `--no-idle` and `--gil`.
    fn filter(&self, profile: &mut Profile) {
        if self.idle {
            profile.retain(|k| k.idle);
        } else if self.no_idle {
            // A thread that waits holding the GIL (a C call that blocks
            // without letting it go) stalls every other Python thread: it
            // is what a user looks for, not what --no-idle leaves out.
            profile.retain(|k| !k.idle || k.gil);
        }
        if self.gil {
            profile.retain(|k| k.gil);
        }
    }
}

/// `-o`'s folder exists and may be written into.
fn writable_folder(output: &std::path::Path) -> Result<()> {
    let folder = output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !folder.is_dir() {
        return Err(Hinted::new(
            format!(
                "there is no folder {} to write {} into",
                folder.display(),
                output.display()
            ),
            format!(
                "create it first (`mkdir -p {}`), or name another -o",
                folder.display()
            ),
        )
        .into());
    }
    // Opened now as it will be then, and taken away again if it was not
    // there: a folder that refuses new files (/proc), a directory of that
    // name or a file that may not be written all fail here.
    let existed = output.symlink_metadata().is_ok();
    match std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(output)
    {
        Ok(_) => {
            if !existed {
                let _ = std::fs::remove_file(output);
            }
            Ok(())
        }
        Err(e) => Err(Hinted::new(
            format!("cannot write {}: {e}", output.display()),
            "name an -o you may write to",
        )
        .into()),
    }
}

/// A sampling error in words a user can act on.
fn explain(pid: u32, e: rankscope_profile::ProfileError) -> anyhow::Error {
    if refused(&e) {
        Hinted::new(
            format!("not allowed to read the memory of PID {pid}"),
            outside::permission_hint(),
        )
        .into()
    } else {
        Hinted::new(
            e.to_string(),
            "is it a running CPython 3.11-3.13 process? `rankscope list` shows the probed ones",
        )
        .into()
    }
}

/// What the samples leave out: ticks missed, and reads that failed (a
/// stack read mid-change, a process that went on through `exec`).
fn missed_note(missed: u64, errors: u64) -> String {
    let mut note = String::new();
    if missed > 0 {
        note += &format!(", {missed} ticks missed (reads slower than the rate)");
    }
    if errors > 0 {
        note += &format!(", {errors} failed reads");
    }
    note
}

/// Keeps the profile in the sampled process's run store (`python.profile`),
/// where that process's own tables go: its run directory from its
/// environment at start. A failure is only a note: the profile is out.
/// Returns the table's folder and the run directory.
fn keep(profile: &Profile, run_dir: &std::path::Path) -> Result<(PathBuf, PathBuf), String> {
    rankscope_profile::table::keep(profile, run_dir, &rankscope_core::host::hostname())
        .map(|table_dir| (table_dir, run_dir.to_path_buf()))
        .map_err(|e| format!("python.profile not kept in {}: {e}", run_dir.display()))
}

/// The process's run directory, from its environment at start: read
/// before sampling, since a process that exits meanwhile has none to read
/// (its profile went to the default run directory instead of its own).
fn run_dir_of(pid: u32) -> PathBuf {
    let vars = crate::outside::initial_environ(pid);
    rankscope_core::crash::run_dir_of(|name| vars.get(name).cloned())
}

/// The process's probe's metadata, where it has a probe that answers soon.
fn probe_meta(pid: u32) -> Option<rankscope_core::protocol::ProcessMeta> {
    Probe::find(pid)
        .ok()
        .flatten()
        .and_then(|probe| probe.meta(Duration::from_millis(500)).ok())
}

pub fn run(pid: u32, args: ProfileArgs) -> Result<u8> {
    let path = args.check()?;
    // No such process: said in the words every command uses.
    Probe::find(pid)?;
    if args.native && outside::stopped(pid) {
        return Err(outside::stopped_native(pid).into());
    }
    // A probe, where there is one, names the rank and where the torch step
    // is kept; sampling never needs it.
    let meta = probe_meta(pid);
    let rank = meta
        .as_ref()
        .and_then(|m| m.job_id.as_ref().map(|_| m.rank));
    let options = SampleOptions {
        step_address: meta.as_ref().and_then(|m| m.step_address),
        ..args.sample_options()
    };
    if args.native {
        eprintln!(
            "note: --native pauses each thread briefly at every sample, to unwind its native stack"
        );
    }
    if args.inside {
        return inside(pid, rank, &args, path);
    }
    let run_dir = run_dir_of(pid);
    let tty = std::io::stderr().is_terminal();
    SIGINT_SEEN.store(false, Ordering::SeqCst);
    let catcher = SigintCatcher::with_sigterm();
    let result = sample(pid, &options, &SIGINT_SEEN, |ticks, elapsed| {
        if tty {
            eprint!(
                "\rsampling PID {pid}: {ticks} ticks, {elapsed:.1}/{} s (Ctrl-C ends early) ",
                args.duration
            );
            let _ = std::io::stderr().flush();
        }
    });
    drop(catcher);
    if tty {
        eprintln!();
    }
    let mut profile = match result {
        Ok(profile) => profile,
        // Its probe could sample it, but without the native frames asked for.
        Err(e) if refused(&e) && meta.is_some() && args.native => {
            return Err(Hinted::new(
                format!("not allowed to read the memory of PID {pid}, which --native needs"),
                format!(
                    "leave out --native to have its probe sample it (Python frames only); or: {}",
                    outside::permission_hint()
                ),
            )
            .into());
        }
        Err(e) if refused(&e) && meta.is_some() => {
            eprintln!("note: reading PID {pid} from outside is not allowed here: its probe samples it instead");
            return inside(pid, rank, &args, path);
        }
        Err(e) => return Err(explain(pid, e)),
    };
    profile.rank = rank;
    let before = profile.total();
    args.filter(&mut profile);
    args.note_if_filtered_out(before, profile.total());
    match keep(&profile, &run_dir) {
        Ok((table_dir, run_dir)) => eprintln!(
            "python.profile: kept in {} (`{}`)",
            table_dir.display(),
            kept_query(pid, meta.is_some(), &run_dir)
        ),
        Err(e) => eprintln!("note: {e}"),
    }
    output(profile, &args, path)
}

/// The command that reads a kept profile back: `PID query` needs a probe
/// that answers, so without one it is `query --run` over the run directory.
fn kept_query(pid: u32, probed: bool, run_dir: &std::path::Path) -> String {
    const SQL: &str = "SELECT func, sum(samples) FROM python.profile";
    const BY_FUNC: &str = "GROUP BY 1 ORDER BY 2 DESC";
    if probed {
        return format!("rankscope {pid} query \"{SQL} {BY_FUNC}\"");
    }
    // The run store keeps every profile taken: the last is the newest ts.
    format!(
        "rankscope query --run {} \"{SQL} WHERE pid = {pid} AND ts = (SELECT max(ts) FROM python.profile WHERE pid = {pid}) {BY_FUNC}\"",
        shell_word(&run_dir.to_string_lossy())
    )
}

/// `word` as one word for a POSIX shell: as it is where that is safe, else
/// single-quoted.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+=:,@%".contains(&b));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

fn refused(e: &rankscope_profile::ProfileError) -> bool {
    let text = e.to_string();
    text.contains("Permission denied") || text.contains("Operation not permitted")
}

/// The process's probe samples it (`POST /v1/profile`) and answers with the
/// fold; it keeps the profile in its run store itself.
fn inside(pid: u32, rank: Option<i64>, args: &ProfileArgs, path: Option<String>) -> Result<u8> {
    let probe = Probe::locate(pid)?;
    eprintln!(
        "sampling PID {pid} through its probe for {:.1} s (Ctrl-C ends early)",
        args.duration
    );
    SIGINT_SEEN.store(false, Ordering::SeqCst);
    let catcher = SigintCatcher::with_sigterm();
    let answer = probe.profile(args.duration, args.rate, &SIGINT_SEEN);
    drop(catcher);
    let answer = answer?;
    let mut profile = rankscope_profile::wire::from_json(&answer)?;
    profile.rank = rank;
    let before = profile.total();
    args.filter(&mut profile);
    args.note_if_filtered_out(before, profile.total());
    eprintln!("python.profile: kept by the probe in its run store");
    output(profile, args, path)
}

fn output(profile: Profile, args: &ProfileArgs, path: Option<String>) -> Result<u8> {
    let write = args.write_options();
    match path {
        Some(path) => {
            let format = formats::write(&profile, &path, &write)?;
            println!(
                "wrote {path} ({format}): {} samples over {:.1} s{}",
                profile.total(),
                profile.duration_s,
                missed_note(profile.missed, profile.errors)
            );
        }
        None => print!("{}", formats::top(&profile, &write)),
    }
    Ok(0)
}

/// `rankscope cluster profile`: every rank of the job on this machine
/// sampled at once, one thread each, from outside; each folds its own
/// samples, and the folds are merged here.
pub fn cluster(
    job: Option<&str>,
    run_dir: Option<PathBuf>,
    ranks: Option<&str>,
    diff: Option<i64>,
    args: ProfileArgs,
) -> Result<u8> {
    let path = args.check()?;
    let failed = |e: rankscope_profile::ProfileError| -> anyhow::Error {
        match e {
            rankscope_profile::ProfileError::Diff(text) => Hinted::new(
                format!("--diff: {text}"),
                "--diff needs the rank and at least one other with samples, and writes .svg, .folded or .txt",
            )
            .into(),
            other => other.into(),
        }
    };
    let found = cluster::local_ranks(job, run_dir, ranks)?;
    for (rank, why) in &found.not_here {
        eprintln!("note: rank {rank} is not profiled ({why})");
    }
    if found.here.is_empty() && found.remote.is_empty() {
        return Err(Hinted::new(
            format!(
                "no rank of job {} runs on this machine",
                found.job_id
            ),
            "run `rankscope cluster profile` on the machine its ranks run on; `rankscope cluster list` shows where they are",
        )
        .into());
    }
    let profiled: Vec<i64> = found
        .here
        .iter()
        .map(|(r, _)| *r)
        .chain(found.remote.iter().map(|(r, _, _)| *r))
        .collect();
    if let Some(rank) = diff {
        if !profiled.contains(&rank) {
            return Err(Hinted::new(
                format!("--diff {rank}: that rank is not among those profiled here"),
                format!(
                    "ranks profiled here: {}",
                    profiled
                        .iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            )
            .into());
        }
        if profiled.len() < 2 {
            return Err(Hinted::new(
                "--diff needs at least two ranks",
                "leave --ranks out, or name more ranks",
            )
            .into());
        }
        if let Some(Format::Speedscope | Format::Chrome) =
            path.as_deref().and_then(|p| Format::of(p).ok())
        {
            return Err(Hinted::new(
                "--diff writes .svg, .folded or .txt",
                "a rank against the others is a flame graph (.svg), its stacks (.folded) or a table (.txt)",
            )
            .into());
        }
    }
    if args.native {
        eprintln!(
            "note: --native pauses each thread briefly at every sample, to unwind its native stack"
        );
    }
    if !found.remote.is_empty() {
        let hosts: std::collections::BTreeSet<&str> =
            found.remote.iter().map(|(_, h, _)| h.as_str()).collect();
        eprintln!(
            "note: ranks {} (on {}) are sampled by their own probes{}",
            rankscope_core::ranks::compress(found.remote.iter().map(|(r, _, _)| *r)),
            hosts.into_iter().collect::<Vec<_>>().join(", "),
            if args.native {
                ", without native frames"
            } else {
                ""
            }
        );
    }
    if args.inside && !found.here.is_empty() {
        eprintln!(
            "note: ranks {} are sampled by their own probes (--inside)",
            rankscope_core::ranks::compress(found.here.iter().map(|(r, _)| *r)),
        );
    }
    let tty = std::io::stderr().is_terminal();
    let options = args.sample_options();
    let ticks: Vec<AtomicU64> = found.here.iter().map(|_| AtomicU64::new(0)).collect();
    // Read before sampling: a rank that exits meanwhile has none to read.
    let run_dirs: Vec<PathBuf> = found.here.iter().map(|&(_, pid)| run_dir_of(pid)).collect();
    SIGINT_SEEN.store(false, Ordering::SeqCst);
    let catcher = SigintCatcher::with_sigterm();
    let (results, remote_results) = std::thread::scope(|scope| {
        // Each remote rank's probe samples itself and answers with its fold.
        let remote: Vec<_> = found
            .remote
            .iter()
            .map(|(rank, _, probe)| {
                let duration = options.duration.as_secs_f64();
                scope.spawn(move || -> Result<Profile> {
                    let answer = probe.profile(duration, options.rate_hz, &SIGINT_SEEN)?;
                    let mut profile = rankscope_profile::wire::from_json(&answer)?;
                    profile.rank = Some(*rank);
                    Ok(profile)
                })
            })
            .collect();
        let handles: Vec<_> = found
            .here
            .iter()
            .enumerate()
            .map(|(at, &(rank, pid))| {
                let (options, ticks) = (&options, &ticks);
                let inside = args.inside;
                scope.spawn(move || -> Result<(Profile, bool)> {
                    // Sampled by the rank's own probe (`--inside`, or where
                    // reading it from outside is not allowed), which keeps
                    // the profile in its run store itself.
                    let by_its_probe = || -> Result<(Profile, bool)> {
                        let probe = Probe::locate(pid)?;
                        let answer = probe.profile(
                            options.duration.as_secs_f64(),
                            options.rate_hz,
                            &SIGINT_SEEN,
                        )?;
                        let mut profile = rankscope_profile::wire::from_json(&answer)?;
                        profile.rank = Some(rank);
                        Ok((profile, true))
                    };
                    if inside {
                        return by_its_probe();
                    }
                    let meta = probe_meta(pid);
                    let options = SampleOptions {
                        step_address: meta.as_ref().and_then(|m| m.step_address),
                        ..options.clone()
                    };
                    let sampled = sample(pid, &options, &SIGINT_SEEN, |n, elapsed| {
                        ticks[at].store(n, Ordering::Relaxed);
                        // One line for the job, drawn by the first rank's sampler.
                        if tty && at == 0 {
                            let all: u64 = ticks.iter().map(|t| t.load(Ordering::Relaxed)).sum();
                            eprint!(
                                "\rsampling {} ranks: {all} ticks, {elapsed:.1}/{} s (Ctrl-C ends early) ",
                                ticks.len(),
                                options.duration.as_secs_f64()
                            );
                            let _ = std::io::stderr().flush();
                        }
                    });
                    let mut profile = match sampled {
                        Ok(profile) => profile,
                        Err(e) if refused(&e) && meta.is_some() && !options.native => {
                            return by_its_probe()
                        }
                        Err(e) => return Err(explain(pid, e)),
                    };
                    profile.rank = Some(rank);
                    Ok((profile, false))
                })
            })
            .collect();
        let local: Vec<Result<(Profile, bool)>> = handles
            .into_iter()
            .map(|h| h.join().expect("a rank's sampler panicked"))
            .collect();
        let remote: Vec<Result<Profile>> = remote
            .into_iter()
            .map(|h| h.join().expect("a rank's request panicked"))
            .collect();
        (local, remote)
    });
    drop(catcher);
    if tty {
        eprintln!();
    }
    let mut job = JobProfile::default();
    let mut before = 0;
    for (((rank, _), result), run_dir) in found.here.iter().zip(results).zip(&run_dirs) {
        match result {
            Ok((mut profile, kept)) => {
                before += profile.total();
                args.filter(&mut profile);
                if !kept {
                    if let Err(e) = keep(&profile, run_dir) {
                        eprintln!("note: rank {rank}: {e}");
                    }
                }
                job.profiles.push(profile);
            }
            Err(e) => eprintln!("note: rank {rank} is not profiled: {e:#}"),
        }
    }
    // Kept in the run store by the probe that sampled them.
    for ((rank, host, _), result) in found.remote.iter().zip(remote_results) {
        match result {
            Ok(mut profile) => {
                before += profile.total();
                args.filter(&mut profile);
                job.profiles.push(profile);
            }
            Err(e) => eprintln!("note: rank {rank} (on {host}) is not profiled: {e:#}"),
        }
    }
    args.note_if_filtered_out(before, job.total());
    job.profiles.sort_by_key(|p| p.rank);
    if job.profiles.is_empty() {
        return Err(Hinted::new(
            "no rank could be sampled",
            "see the notes above; `rankscope cluster list` shows the ranks' states",
        )
        .into());
    }
    let write = args.write_options();
    match path {
        Some(path) => {
            let format = job.write(&path, &write, diff).map_err(failed)?;
            let missed: u64 = job.profiles.iter().map(|p| p.missed).sum();
            let errors: u64 = job.profiles.iter().map(|p| p.errors).sum();
            let what = match diff {
                Some(rank) => format!("rank {rank} against the median of the others, "),
                None => String::new(),
            };
            println!(
                "wrote {path} ({what}{format}): {} samples of {} ranks{}",
                job.total(),
                job.profiles.len(),
                missed_note(missed, errors)
            );
        }
        None => match diff {
            Some(rank) => print!("{}", job.diff_top(rank, &write).map_err(failed)?),
            None => print!("{}", job.top(&write)),
        },
    }
    Ok(0)
}
