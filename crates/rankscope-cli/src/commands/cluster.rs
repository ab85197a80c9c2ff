//! `rankscope cluster ...`: one job, every rank at once.
//!
//! The job is found from what its ranks leave: the registry in the run
//! directory (`<run>/ranks/rank<R>-pid<P>.json`, kept after a rank dies) and
//! the probes' own metadata in the endpoint directory. Every command fans out
//! on one thread per rank, each with its own deadline, and answers for the
//! ranks that answered; the others are named with what went wrong.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use rankscope_core::protocol::{EvalRequest, ProcessMeta, StacksReply};
use rankscope_core::ranks::compress;
use rankscope_core::tables::{Rows, TableDef};
use rankscope_core::{crash, paths};
use rankscope_query::table::{Align, Style, Table};
use rankscope_query::{Fetched, RowSource, Scan};
use serde::Deserialize;

use crate::client::Probe;
use crate::hint::Hinted;
use crate::stuck;
use crate::{outside, QueryFormat};

/// One rank as the registry and the endpoint directory describe it.
#[derive(Debug, Clone, Deserialize)]
struct RankEntry {
    #[serde(flatten)]
    meta: ProcessMeta,
    /// "running", "exited" or "crashed", as the rank last wrote it.
    #[serde(default)]
    state: Option<String>,
    /// The status the process gave `exit()`, where it ended through it
    /// (not `os._exit`, not a signal).
    #[serde(default)]
    exit_code: Option<i64>,
    /// With a TCP endpoint (`tcp` in the metadata): the bearer token its
    /// registry entry (mode 0600) carries, for the CLI on another machine.
    #[serde(default)]
    token: Option<String>,
    /// The run directory whose registry holds this entry (None: seen only
    /// through its live probe).
    #[serde(skip)]
    run_dir: Option<PathBuf>,
    /// When its file last changed (seconds since the epoch): a rank rewrites
    /// it as it exits, so the newest says which job ran last.
    #[serde(skip)]
    modified: f64,
}

pub struct Job {
    pub id: String,
    ranks: Vec<RankEntry>,
    /// Where the ranks registered: crash records live there too.
    run_dirs: Vec<PathBuf>,
    /// Every process that registered as one of its ranks (a restarted rank's
    /// earlier ones too).
    pids: Vec<u32>,
    /// The same, with their hosts: what names their files in the run store.
    processes: Vec<(String, u32)>,
    /// From its first rank's start to its registry's last change.
    span: (f64, f64),
    /// The processes of other jobs registered in the same run directory (a
    /// fixed RANKSCOPE_RUN_DIR): their records are not this job's.
    others_pids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Liveness {
    Running,
    Exited,
    Crashed,
    /// The process is gone without saying so (SIGKILL, OOM killer).
    Dead,
    /// On another machine: not reachable through a local socket.
    Remote,
    /// Alive, with a rankscope that speaks another protocol than this CLI.
    OtherVersion,
}

impl Liveness {
    fn word(self) -> &'static str {
        match self {
            Liveness::Running => "running",
            Liveness::Exited => "exited",
            Liveness::Crashed => "crashed",
            Liveness::Dead => "dead",
            Liveness::Remote => "remote",
            Liveness::OtherVersion => "other-version",
        }
    }
}

impl RankEntry {
    /// On another machine, with a TCP endpoint and its token.
    fn reachable_remotely(&self, here: &str) -> bool {
        self.meta.host != here && self.meta.tcp.is_some() && self.token.is_some()
    }
}

fn liveness(entry: &RankEntry, here: &str) -> Liveness {
    if entry.meta.host != here {
        if !entry.reachable_remotely(here) {
            return Liveness::Remote;
        }
        // Its PID means nothing here: trust what it last wrote, then ask it.
        return match entry.state.as_deref() {
            Some("exited") => Liveness::Exited,
            Some("crashed") => Liveness::Crashed,
            _ if entry.meta.protocol != rankscope_core::PROTOCOL_VERSION => Liveness::OtherVersion,
            _ => Liveness::Running,
        };
    }
    if entry.state.as_deref() == Some("exited") {
        // It said so as it left; its PID may be another process's by now.
        return Liveness::Exited;
    }
    if paths::same_process(entry.meta.pid, entry.meta.process_started_at) {
        // The registry says what the rank speaks: no request is sent in
        // words it would misread.
        if entry.meta.protocol != rankscope_core::PROTOCOL_VERSION {
            return Liveness::OtherVersion;
        }
        return Liveness::Running;
    }
    match entry.state.as_deref() {
        Some("exited") => Liveness::Exited,
        Some("crashed") => Liveness::Crashed,
        _ => Liveness::Dead,
    }
}

fn read_entries(dir: &std::path::Path, out: &mut Vec<RankEntry>) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    for path in read.flatten().map(|e| e.path()) {
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        if let Some(mut entry) = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<RankEntry>(&b).ok())
        {
            if entry.meta.job_id.is_some() || entry.meta.world_size > 1 {
                entry.modified = super::crashes::mtime(&path);
                out.push(entry);
            }
        }
    }
}

/// `--job host:port`: a rank's TCP address rather than a job id.
fn job_address(job: Option<&str>) -> Option<&str> {
    let job = job?;
    let (host, port) = job.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then_some(job)
}

/// The job as one of its ranks sees it (its run directory's registry),
/// asked over TCP with the token in RANKSCOPE_TOKEN.
fn job_at(addr: &str) -> Result<Job> {
    let token = std::env::var("RANKSCOPE_TOKEN").ok().filter(|t| !t.is_empty()).ok_or_else(|| {
        Hinted::new(
            format!("--job {addr} needs that rank's token in RANKSCOPE_TOKEN"),
            "the rank wrote it (mode 0600) to its registry entry <run dir>/ranks/rank<R>-pid<P>.json and next to its socket",
        )
    })?;
    let probe = Probe::remote(0, addr, &token);
    let entries: Vec<RankEntry> = probe
        .job(Duration::from_secs(5))?
        .into_iter()
        .filter_map(|v| serde_json::from_value(v).ok())
        .collect();
    let Some(id) = entries.iter().find_map(|e| e.meta.job_id.clone()) else {
        return Err(Hinted::new(
            format!("the probe at {addr} is not in a job's registry"),
            "start the job's ranks with a run directory (RANKSCOPE_RUN_DIR)",
        )
        .into());
    };
    Ok(one_per_rank(id, entries))
}

/// Which job a command without `--job` means when no job runs here.
#[derive(Clone, Copy, PartialEq)]
enum NoneRunning {
    Fail,
    /// The job whose registry changed last: what ran last (`cluster crashes`).
    Latest,
}

/// Finds the job: `--job ID` (or a rank's `host:port`), else the one job
/// with a live rank here.
pub fn find_job(job: Option<&str>, run: Option<PathBuf>) -> Result<Job> {
    find_job_or(job, run, NoneRunning::Fail)
}

fn find_job_or(job: Option<&str>, run: Option<PathBuf>, none_running: NoneRunning) -> Result<Job> {
    if let Some(addr) = job_address(job) {
        return job_at(addr);
    }
    let explicit_run = crash::explicit_run_dir(run.clone());
    let mut entries = Vec::new();
    // Live probes on this machine; what dead ones left behind goes, as in `rankscope list`.
    let endpoint_dir = paths::endpoint_dir();
    for pid in paths::listed_pids(&endpoint_dir) {
        if !paths::endpoint_live(&endpoint_dir, pid) {
            paths::remove_endpoint_files(&endpoint_dir, pid);
        }
    }
    read_entries(&endpoint_dir, &mut entries);
    // The registries: --run, RANKSCOPE_RUN_DIR, else every job's run directory.
    for dir in crash::run_dirs(run) {
        let first_new = entries.len();
        read_entries(&dir.join("ranks"), &mut entries);
        for entry in &mut entries[first_new..] {
            entry.run_dir = Some(dir.clone());
        }
    }
    let here = rankscope_core::host::hostname();
    let job_of = |e: &RankEntry| {
        e.meta
            .job_id
            .clone()
            .unwrap_or_else(|| "(no job id)".into())
    };
    let mut jobs: BTreeMap<String, Vec<RankEntry>> = BTreeMap::new();
    for entry in entries {
        jobs.entry(job_of(&entry)).or_default().push(entry);
    }
    // `--run DIR` names the jobs registered there (every live probe here is
    // read too, and may belong to another job).
    if let Some(dir) = &explicit_run {
        let in_dir = |ranks: &Vec<RankEntry>| {
            ranks
                .iter()
                .any(|r| r.run_dir.as_deref() == Some(dir.as_path()))
        };
        if jobs.values().any(in_dir) {
            jobs.retain(|_, ranks| in_dir(ranks));
        }
    }
    let chosen = match job {
        Some(id) => jobs.remove_entry(id).ok_or_else(|| {
            Hinted::new(
                format!("no job {id} found"),
                format!("jobs found: {}", names(&jobs)),
            )
        })?,
        None => {
            let live: Vec<String> = jobs
                .iter()
                .filter(|(_, ranks)| {
                    ranks
                        .iter()
                        .any(|r| liveness(r, &here) == Liveness::Running)
                })
                .map(|(id, _)| id.clone())
                .collect();

            let latest = || {
                jobs.iter()
                    .max_by(|a, b| newest(a.1).total_cmp(&newest(b.1)))
                    .map(|(id, _)| id.clone())
            };
            match live.as_slice() {
                [one] => jobs.remove_entry(one).expect("listed above"),
                [] if none_running == NoneRunning::Latest && !jobs.is_empty() => {
                    let id = latest().expect("jobs is not empty");
                    eprintln!("note: no job is running here; job {id} ran last (--job ID picks another)");
                    jobs.remove_entry(&id).expect("listed above")
                }
                [] => {
                    return Err(Hinted::new(
                        "no running job found on this machine",
                        "start the job with RANKSCOPE=1 (or `rankscope run -- torchrun ...`); --run DIR reads a job's run directory, --job ID picks one",
                    )
                    .into())
                }
                several => {
                    return Err(Hinted::new(
                        format!("{} jobs are running here", several.len()),
                        format!("pick one with --job: {}", several.join(", ")),
                    )
                    .into())
                }
            }
        }
    };
    let (id, ranks) = chosen;
    let mut job = one_per_rank(id, ranks);
    job.others_pids = jobs
        .values()
        .flatten()
        .filter(|e| e.run_dir.as_ref().is_some_and(|d| job.run_dirs.contains(d)))
        .map(|e| e.meta.pid)
        .collect();
    Ok(job)
}

/// When a job's registry last changed.
fn newest(ranks: &[RankEntry]) -> f64 {
    ranks
        .iter()
        .map(|r| r.modified.max(r.meta.started_at))
        .fold(0.0, f64::max)
}

fn one_per_rank(id: String, mut ranks: Vec<RankEntry>) -> Job {
    let mut pids: Vec<u32> = ranks.iter().map(|r| r.meta.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let mut processes: Vec<(String, u32)> = ranks
        .iter()
        .map(|r| (r.meta.host.clone(), r.meta.pid))
        .collect();
    processes.sort();
    processes.dedup();
    let span = (
        ranks
            .iter()
            .map(|r| r.meta.started_at)
            .fold(f64::INFINITY, f64::min),
        newest(&ranks),
    );
    // One entry per rank: the registry and the endpoint directory describe
    // the same process twice; a restarted rank's newest process wins.
    ranks.sort_by(|a, b| {
        (a.meta.rank, a.meta.started_at)
            .partial_cmp(&(b.meta.rank, b.meta.started_at))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let mut by_rank: BTreeMap<i64, RankEntry> = BTreeMap::new();
    for entry in ranks {
        match by_rank.get_mut(&entry.meta.rank) {
            Some(kept) if kept.meta.pid == entry.meta.pid => {
                if entry.state.is_some() {
                    kept.state = entry.state;
                }
                if entry.run_dir.is_some() {
                    kept.run_dir = entry.run_dir;
                }
                if entry.token.is_some() {
                    kept.token = entry.token;
                }
            }
            _ => {
                by_rank.insert(entry.meta.rank, entry);
            }
        }
    }
    let mut job_run_dirs: Vec<PathBuf> =
        by_rank.values().filter_map(|e| e.run_dir.clone()).collect();
    job_run_dirs.sort();
    job_run_dirs.dedup();
    Job {
        id,
        ranks: by_rank.into_values().collect(),
        run_dirs: job_run_dirs,
        pids,
        processes,
        span,
        others_pids: Vec::new(),
    }
}

fn names(jobs: &BTreeMap<String, Vec<RankEntry>>) -> String {
    if jobs.is_empty() {
        "none".into()
    } else {
        jobs.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// "0,2,4-6" -> [0, 2, 4, 5, 6], each checked against the job's ranks.
fn parse_ranks(spec: &str, job: &Job) -> Result<Vec<i64>> {
    let known: Vec<i64> = job.ranks.iter().map(|r| r.meta.rank).collect();
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || {
            Hinted::new(
                format!("--ranks: {part:?} is not a rank or a range"),
                "e.g. --ranks 0,2,4-7",
            )
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (
                a.parse::<i64>().map_err(|_| bad())?,
                b.parse::<i64>().map_err(|_| bad())?,
            ),
            None => {
                let r = part.parse::<i64>().map_err(|_| bad())?;
                (r, r)
            }
        };
        for rank in lo..=hi {
            if !known.contains(&rank) {
                return Err(Hinted::new(
                    format!("rank {rank} is not in job {}", job.id),
                    format!("its ranks are {}", compress(known.iter().copied())),
                )
                .into());
            }
            out.push(rank);
        }
    }
    Ok(out)
}

impl Job {
    fn selected(&self, ranks: Option<&str>) -> Result<Vec<&RankEntry>> {
        match ranks {
            None => Ok(self.ranks.iter().collect()),
            Some(spec) => {
                let wanted = parse_ranks(spec, self)?;
                Ok(self
                    .ranks
                    .iter()
                    .filter(|r| wanted.contains(&r.meta.rank))
                    .collect())
            }
        }
    }
}

/// Runs `work` for every rank at once; results come back in rank order.
fn fan_out<T: Send>(ranks: &[&RankEntry], work: impl Fn(&RankEntry) -> T + Sync) -> Vec<T> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks.iter().map(|r| scope.spawn(|| work(r))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank's worker panicked"))
            .collect()
    })
}

fn probe_of(entry: &RankEntry) -> Result<Probe> {
    if entry.reachable_remotely(&rankscope_core::host::hostname()) {
        if let (Some(tcp), Some(token)) = (&entry.meta.tcp, &entry.token) {
            return Ok(Probe::remote(entry.meta.pid, tcp, token));
        }
    }
    Probe::locate(entry.meta.pid)
}

/// The ranks of the job this machine can read from outside (running, on
/// this host): (rank, pid); those on other machines whose probes listen
/// on TCP (with the token), to be asked through them; and the others, each
/// with why not.
pub struct LocalRanks {
    pub job_id: String,
    pub here: Vec<(i64, u32)>,
    pub remote: Vec<(i64, String, Probe)>,
    pub not_here: Vec<(i64, String)>,
}

pub fn local_ranks(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
) -> Result<LocalRanks> {
    let job = find_job(job, run)?;
    let host = rankscope_core::host::hostname();
    let mut out = LocalRanks {
        job_id: job.id.clone(),
        here: Vec::new(),
        remote: Vec::new(),
        not_here: Vec::new(),
    };
    for entry in job.selected(ranks)? {
        let rank = entry.meta.rank;
        match liveness(entry, &host) {
            Liveness::Running | Liveness::OtherVersion if entry.meta.host == host => {
                out.here.push((rank, entry.meta.pid))
            }
            Liveness::Running if entry.reachable_remotely(&host) => {
                out.remote
                    .push((rank, entry.meta.host.clone(), probe_of(entry)?))
            }
            Liveness::Running | Liveness::OtherVersion | Liveness::Remote => out.not_here.push((
                rank,
                format!("on {}: run this command there", entry.meta.host),
            )),
            other => out.not_here.push((rank, other.word().to_string())),
        }
    }
    Ok(out)
}

pub fn list(
    job: Option<&str>,
    run: Option<PathBuf>,
    deadline: Duration,
    format: crate::ListFormat,
) -> Result<u8> {
    let job = find_job(job, run)?;
    let here = rankscope_core::host::hostname();
    let ranks: Vec<&RankEntry> = job.ranks.iter().collect();
    let states = fan_out(&ranks, |entry| match liveness(entry, &here) {
        Liveness::Running => match probe_of(entry).and_then(|p| p.meta(deadline)) {
            Ok(_) => "running".to_string(),
            // A rank whose rankscope speaks another protocol answers, but not in our words.
            Err(e) if format!("{e:#}").contains("speaks protocol") => "other-version".to_string(),
            Err(_) if entry.meta.host != here => "unreachable".to_string(),
            Err(_) => "unresponsive".to_string(),
        },
        // A rank that exited with a status other than 0 (`sys.exit(3)`)
        // says so: it recorded no crash.
        Liveness::Exited => match entry.exit_code {
            Some(code) if code != 0 => format!("exited ({code})"),
            _ => "exited".to_string(),
        },
        other => other.word().to_string(),
    });
    // The process's age, not its probe's (an injected probe is younger).
    let uptime = |entry: &RankEntry, state: &str| {
        (state == "running" || state == "unresponsive")
            .then(|| super::list::process_age(&entry.meta, &here))
    };
    if let crate::ListFormat::Json = format {
        let rows: Vec<serde_json::Value> = job
            .ranks
            .iter()
            .zip(&states)
            .map(|(entry, state)| {
                let m = &entry.meta;
                serde_json::json!({
                    "job": job.id, "rank": m.rank, "local_rank": m.local_rank, "host": m.host, "pid": m.pid,
                    "state": state.split(' ').next().unwrap_or(state), "exit_code": entry.exit_code,
                    "uptime_s": uptime(entry, state.as_str()),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    println!("job {} ({} ranks)", job.id, job.ranks.len());
    let mut table = Table::new(Style::Plain)
        .whole_column("RANK", Align::Right)
        .whole_column("LOCAL", Align::Right)
        .column("HOST", Align::Left)
        .whole_column("PID", Align::Right)
        .whole_column("STATE", Align::Left)
        .whole_column("UPTIME", Align::Left);
    for (entry, state) in job.ranks.iter().zip(&states) {
        let m = &entry.meta;
        let uptime = uptime(entry, state.as_str()).map_or("-".into(), |s| format!("{s:.0}s"));
        table.row(vec![
            m.rank.to_string(),
            m.local_rank.to_string(),
            m.host.clone(),
            m.pid.to_string(),
            state.clone(),
            uptime,
        ]);
    }
    crate::term::print(&table);
    Ok(0)
}

enum Stacks {
    FromProbe(StacksReply),
    FromOutside(StacksReply),
    Missing(String),
}

fn stacks_of(entry: &RankEntry, here: &str, all_frames: bool, deadline: Duration) -> Stacks {
    match liveness(entry, here) {
        Liveness::Running => {}
        // Stacks do not depend on the probe's version: read them from outside.
        Liveness::OtherVersion => {
            return match outside::read_stacks(entry.meta.pid, false, false, all_frames) {
                Ok((stacks, _)) => Stacks::FromOutside(stacks),
                Err(e) => Stacks::Missing(format!(
                    "other-version, and the outside read failed: {}",
                    crate::commands::first_line(&e)
                )),
            }
        }
        other => return Stacks::Missing(other.word().to_string()),
    }
    match probe_of(entry).and_then(|p| p.stacks(false, all_frames, deadline)) {
        Ok(stacks) => Stacks::FromProbe(stacks),
        // Another machine's process cannot be read from outside here.
        Err(e) if entry.meta.host != here => {
            Stacks::Missing(format!("unreachable: {}", crate::commands::first_line(&e)))
        }
        // A probe stuck behind the GIL: read the rank from outside instead.
        Err(_) => match outside::read_stacks(entry.meta.pid, false, false, all_frames) {
            Ok((stacks, _)) => Stacks::FromOutside(stacks),
            Err(e) => Stacks::Missing(format!(
                "unresponsive, and the outside read failed: {}",
                crate::commands::first_line(&e)
            )),
        },
    }
}

/// The stack a group is formed on: the main thread's, innermost first.
fn signature(stacks: &StacksReply, ignore_lines: bool) -> Vec<String> {
    let main = stacks
        .threads
        .iter()
        .find(|t| t.is_main)
        .or_else(|| stacks.threads.first());
    main.map(|t| {
        t.frames
            .iter()
            .map(|f| {
                let file = f.file.rsplit('/').next().unwrap_or(&f.file);
                if ignore_lines {
                    format!("{} ({file})", f.func)
                } else {
                    format!("{} ({file}:{})", f.func, f.lineno)
                }
            })
            .collect()
    })
    .unwrap_or_default()
}

pub fn bt(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    ignore_lines: bool,
    all_frames: bool,
    deadline: Duration,
) -> Result<u8> {
    let job = find_job(job, run)?;
    let selected = job.selected(ranks)?;
    let here = rankscope_core::host::hostname();
    // The stacks, and each rank's collectives (answered without the GIL).
    let results = fan_out(&selected, |entry| {
        (
            stacks_of(entry, &here, all_frames, deadline),
            collectives_of(entry, &here, deadline),
        )
    });
    let mut groups: BTreeMap<Vec<String>, Vec<i64>> = BTreeMap::new();
    let mut missing = Vec::new();
    let mut outside_ranks = Vec::new();
    let mut read = Vec::new();
    for (entry, (result, records)) in selected.iter().zip(results) {
        let rank = entry.meta.rank;
        match result {
            Stacks::FromProbe(s) => {
                groups
                    .entry(signature(&s, ignore_lines))
                    .or_default()
                    .push(rank);
                read.push((rank, records, Some(s)));
            }
            Stacks::FromOutside(s) => {
                outside_ranks.push(rank);
                groups
                    .entry(signature(&s, ignore_lines))
                    .or_default()
                    .push(rank);
                read.push((rank, records, Some(s)));
            }
            Stacks::Missing(why) => {
                missing.push((rank, why));
                read.push((rank, records, None));
            }
        }
    }
    let views: Vec<stuck::RankView> = read
        .iter()
        .map(|(rank, records, stacks)| stuck::RankView {
            rank: *rank,
            records: records.clone(),
            stacks: stacks.as_ref(),
        })
        .collect();
    let stuck_lines = stuck::stuck_lines(&views, rankscope_core::host::now_seconds());
    let mut ordered: Vec<(Vec<String>, Vec<i64>)> = groups.into_iter().collect();
    ordered.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.1.cmp(&b.1)));
    let largest = ordered.first().map(|g| g.1.len()).unwrap_or(0);
    let smallest = ordered.last().map(|g| g.1.len()).unwrap_or(0);
    println!(
        "job {}: {} ranks answered, {} groups (main thread, innermost first)",
        job.id,
        selected.len() - missing.len(),
        ordered.len()
    );
    for (frames, ranks) in &ordered {
        let label = format!(
            "{} {} ({})",
            if ranks.len() == 1 { "rank " } else { "ranks" },
            compress(ranks.iter().copied()),
            ranks.len()
        );
        let shown: Vec<&str> = frames.iter().take(6).map(String::as_str).collect();
        let more = if frames.len() > 6 {
            format!(" <- ... {} more", frames.len() - 6)
        } else {
            String::new()
        };
        let differs = if ordered.len() > 1 && ranks.len() == smallest && smallest < largest {
            "    <-- differs"
        } else {
            ""
        };
        println!("  {label}: {}{more}{differs}", shown.join(" <- "));
    }
    if !outside_ranks.is_empty() {
        eprintln!(
            "note: rank(s) {} did not answer in time or run another rankscope version; their stacks were read from outside",
            compress(outside_ranks.iter().copied())
        );
    }
    for (rank, why) in &missing {
        println!("  rank {rank}: no stacks ({why})");
    }
    if !stuck_lines.is_empty() {
        println!("collectives:");
        for line in &stuck_lines {
            println!("  {line}");
        }
    }
    if !selected.is_empty() && missing.len() == selected.len() {
        // A job whose ranks have all ended: no stack is no answer.
        return Err(Hinted::new(
            format!("no rank of job {} answered", job.id),
            format!(
                "`rankscope cluster list --job {}` says how each ended; `cluster crashes` shows its crash records",
                job.id
            ),
        )
        .into());
    }
    Ok(0)
}

/// A rank's `python.collectives` (None when it cannot be read: another
/// machine's rank that is not reachable, or a probe that is gone).
fn collectives_of(entry: &RankEntry, here: &str, deadline: Duration) -> Option<Vec<stuck::Record>> {
    if !matches!(liveness(entry, here), Liveness::Running) {
        return None;
    }
    let probe = probe_of(entry).ok()?;
    let recorded = probe
        .probe_table("collectives", Some(&stuck::COLUMNS), &[], false, deadline)
        .ok()
        .map(|r| stuck::records(&r));
    // Flight Recorder has what the wrappers miss (DDP's buckets); it needs
    // the GIL, which a rank inside a collective has let go of.
    let flight = probe
        .flight_recorder(16, deadline.min(FLIGHT_RECORDER_WAIT))
        .ok()
        .map(|r| stuck::records(&r));
    match (recorded, flight) {
        (None, None) => None,
        (recorded, flight) => Some(stuck::merge(
            recorded.unwrap_or_default(),
            flight.unwrap_or_default(),
        )),
    }
}

/// How long `cluster bt` waits for a rank's Flight Recorder (a rank whose
/// GIL is held has its stacks read from outside meanwhile).
const FLIGHT_RECORDER_WAIT: Duration = Duration::from_secs(2);

/// How long after its registry's last change a job's launcher may still
/// write its record (it outlives its workers by a moment).
const LAUNCHER_GRACE_S: f64 = 60.0;

/// The crash records of the job's ranks, from the run directory they
/// registered in: the running job's, else the one that ran last (crashes
/// are asked for after a job ends), or `--job`'s.
pub fn crashes(
    job: Option<&str>,
    run: Option<PathBuf>,
    all: bool,
    format: crate::ListFormat,
) -> Result<u8> {
    let job = find_job_or(job, run, NoneRunning::Latest)?;
    match job.run_dirs.as_slice() {
        [dir] => {
            let mut select = super::crashes::Select { all, keep: None };
            if !job.others_pids.is_empty() {
                // Other jobs' records lie here too: this job's are its ranks'
                // (by PID), and those of no job's rank from while it ran (its launcher's).
                let (pids, others, (start, end)) =
                    (job.pids.clone(), job.others_pids.clone(), job.span);
                select.keep = Some(Box::new(move |pid: Option<u32>, time: f64| match pid {
                    Some(pid) if pids.contains(&pid) => true,
                    Some(pid) if others.contains(&pid) => false,
                    _ => time >= start && time <= end + LAUNCHER_GRACE_S,
                }));
            }
            if matches!(format, crate::ListFormat::Table) {
                println!("job {}: crashes recorded in {}", job.id, dir.display());
            }
            super::crashes::list(Some(dir.clone()), format, &select)
        }
        [] => Err(Hinted::new(
            format!("job {} has no registry in a run directory here", job.id),
            "its ranks' crashes are where RANKSCOPE_RUN_DIR pointed them; pass --run DIR",
        )
        .into()),
        several => {
            let names: Vec<String> = several.iter().map(|d| d.display().to_string()).collect();
            Err(Hinted::new(
                format!("job {} registered in several run directories", job.id),
                format!("pick one with --run: {}", names.join(", ")),
            )
            .into())
        }
    }
}

pub fn eval(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    code: &str,
    timeout: f64,
    at: crate::FrameArgs,
) -> Result<u8> {
    super::seconds(timeout, "--eval-timeout")?;
    let request = EvalRequest::new(code, timeout).at(at.thread, at.frame);
    each_rank(
        job,
        run,
        ranks,
        |probe| super::eval_at(probe, &request),
        |reply| crate::commands::print_eval(&reply),
    )
}

/// `cluster break ...`: the same breakpoint request to every rank (or
/// `--ranks`), each answer under its rank; `break list --format json`: one
/// JSON array, an object per rank.
pub fn breakpoints(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    action: &crate::BreakAction,
) -> Result<u8> {
    let request = super::breakpoints::request_of(action)?;
    if let crate::BreakAction::List {
        format: crate::ListFormat::Json,
    } = action
    {
        return json_per_rank(job, run, ranks, "breakpoints", |probe| {
            probe.breakpoints(&request)
        });
    }
    each_rank(
        job,
        run,
        ranks,
        |probe| probe.breakpoints(&request),
        |reply| {
            let (lines, notes) = super::breakpoints::render(action, &reply);
            for line in notes.iter().chain(&lines) {
                println!("{line}");
            }
            0
        },
    )
}

/// `cluster torch ...`: the same torch request to every rank (or
/// `--ranks`) at once; each answer under its rank. A request that turns on
/// a feature which samples steps first has the ranks number their steps
/// alike (`numbered_alike`), so that `--every N` picks the same steps on
/// every rank.
pub fn torch(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    action: Option<&crate::TorchAction>,
    format: crate::BtFormat,
) -> Result<u8> {
    let request = super::torch::request_of(action)?;
    let here = rankscope_core::host::hostname();
    let over = |job: &Job| {
        !job.ranks
            .iter()
            .any(|r| liveness(r, &here) == Liveness::Running)
            && !job.run_dirs.is_empty()
    };
    let after_the_job = matches!(action, Some(crate::TorchAction::Nan { switch: None }))
        && !matches!(format, crate::BtFormat::Json);
    let job = match (find_job(job, run.clone()), &run) {
        // The job is over: what its NaN watch found is in its run store,
        // its own processes' rows only (other jobs may have written there).
        (Ok(job), Some(dir)) if after_the_job && over(&job) => {
            return nan_after_the_job(dir, Some(&job));
        }
        (Ok(job), _) => job,
        (Err(_), Some(dir)) if after_the_job => {
            return match find_job_or(None, run.clone(), NoneRunning::Latest) {
                Ok(job) if !job.run_dirs.is_empty() => nan_after_the_job(dir, Some(&job)),
                // No registry (processes of no job): every process's events.
                _ => nan_after_the_job(dir, None),
            };
        }
        (Err(err), _) => return Err(err),
    };
    let (shifts, note) = if samples_steps(&request) {
        numbered_alike(&job, ranks)?
    } else {
        (BTreeMap::new(), None)
    };
    let answers = ask_ranks_each(&job, ranks, |entry, probe| {
        let mut request = request.clone();
        if let Some(by) = shifts.get(&entry.meta.rank) {
            request["shift"] = serde_json::json!(by);
        }
        probe.torch(&request)
    })?;
    let failed = answers.iter().any(|(_, answer)| answer.is_err());
    if let crate::BtFormat::Json = format {
        let rows: Vec<serde_json::Value> = answers
            .into_iter()
            .map(|(entry, answer)| {
                let (key, value) = match answer {
                    Ok(reply) => ("torch", reply),
                    Err(why) => ("error", serde_json::Value::String(why)),
                };
                serde_json::json!({"rank": entry.meta.rank, "pid": entry.meta.pid, key: value})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        if let Some(note) = note {
            eprintln!("{note}");
        }
        return Ok(u8::from(failed));
    }
    if let Some(note) = note {
        println!("{note}");
    }
    if let Some(crate::TorchAction::Nan { .. }) = action {
        let replies: Vec<(i64, &serde_json::Value)> = answers
            .iter()
            .filter_map(|(entry, answer)| {
                answer.as_ref().ok().map(|reply| (entry.meta.rank, reply))
            })
            .collect();
        if let Some(line) = super::torch::job_nan_line(&replies) {
            println!("{line}");
        }
    }
    for (entry, answer) in answers {
        println!("== rank {} (pid {})", entry.meta.rank, entry.meta.pid);
        match answer {
            Ok(reply) => print!("{}", super::torch::text_of(action, &reply)),
            Err(why) => println!("error: {why}"),
        }
    }
    Ok(u8::from(failed))
}

/// `cluster torch --run DIR nan` once no rank runs: each rank's events from
/// `python.nan_events` in the run store, under the same line for the job.
fn nan_after_the_job(dir: &std::path::Path, job: Option<&Job>) -> Result<u8> {
    let rows = super::query::offline_rows(
        dir,
        job.map(|job| (job.run_dirs.clone(), job.processes.clone())),
        "SELECT rank, pid, date_part('epoch', ts) AS ts, step, stage, module, module_type, what, nonfinite, \
         input_min, input_max, input_nonfinite, weight_min, weight_max, weight_nonfinite, loss, detail, record \
         FROM python.nan_events ORDER BY rank, ts",
    )?;
    let mut by_rank: BTreeMap<(i64, i64), Vec<serde_json::Value>> = BTreeMap::new();
    for row in rows {
        let key = (
            row["rank"].as_i64().unwrap_or(-1),
            row["pid"].as_i64().unwrap_or(0),
        );
        by_rank.entry(key).or_default().push(row);
    }
    match job {
        Some(job) => println!(
            "no rank of this job is running: the NaN watch's events from its run store ({}; job {})",
            dir.display(),
            job.id
        ),
        None => println!(
            "no rank of this job is running: the NaN watch's events from its run store ({})",
            dir.display()
        ),
    }
    let replies: Vec<((i64, i64), serde_json::Value)> = by_rank
        .into_iter()
        .map(|(key, events)| (key, serde_json::json!({ "events": events })))
        .collect();
    let ranked: Vec<(i64, &serde_json::Value)> = replies
        .iter()
        .map(|((rank, _), reply)| (*rank, reply))
        .collect();
    match super::torch::job_nan_line(&ranked) {
        Some(line) => println!("{line}"),
        None => println!("no non-finite value was recorded"),
    }
    for ((rank, pid), reply) in &replies {
        println!("== rank {rank} (pid {pid})");
        print!("{}", super::torch::nan_events_text(reply));
    }
    Ok(0)
}

/// Whether `request` turns on (or resets) a feature that samples steps.
fn samples_steps(request: &serde_json::Value) -> bool {
    match request["action"].as_str() {
        Some("trace_on") => true,
        Some("grads") | Some("activations") => {
            request["switch"] == "on"
                || (request["switch"].is_null()
                    && (!request["every"].is_null() || !request["modules"].is_null()))
        }
        _ => false,
    }
}

/// How long `cluster torch` waits for the ranks' boundaries to meet.
const ALIGN_WAIT: Duration = Duration::from_secs(10);

/// Has every selected rank record its step boundaries' collective counts
/// until they share one (`crate::align`); returns how far each rank moves
/// its step number, and a line for the user. Ranks that cannot take part
/// (no torch.distributed, a rank that did not answer) are left as they
/// are, and the line says so.
fn numbered_alike(job: &Job, ranks: Option<&str>) -> Result<(BTreeMap<i64, i64>, Option<String>)> {
    let start = serde_json::json!({"action": "anchors", "switch": "on"});
    let mut taking_part = Vec::new();
    if job.selected(ranks)?.len() < 2 {
        return Ok((BTreeMap::new(), None));
    }
    let mut why_not = None;
    for (entry, answer) in ask_ranks(job, ranks, |probe| probe.torch(&start))? {
        match answer {
            Ok(reply) if reply["available"] == true => taking_part.push(entry.meta.rank),
            Ok(reply) => {
                why_not.get_or_insert_with(|| {
                    format!(
                        "rank {}: {}",
                        entry.meta.rank,
                        reply["why"].as_str().unwrap_or("no reason given")
                    )
                });
            }
            // The feature's own request will say what is wrong with it.
            Err(_) => {}
        }
    }
    if taking_part.len() < 2 {
        // A rank that did start recording stops with the feature's request.
        return Ok((
            taking_part.iter().map(|&rank| (rank, 0)).collect(),
            why_not.map(|why| format!("steps: not numbered alike across ranks ({why})")),
        ));
    }
    let look = serde_json::json!({"action": "anchors"});
    let deadline = std::time::Instant::now() + ALIGN_WAIT;
    loop {
        let mut anchors = Vec::new();
        for (entry, answer) in ask_ranks(job, ranks, |probe| probe.torch(&look))? {
            if !taking_part.contains(&entry.meta.rank) {
                continue;
            }
            let list = answer
                .ok()
                .and_then(|reply| reply["anchors"].as_array().cloned())
                .unwrap_or_default()
                .iter()
                .filter_map(|pair| Some((pair[0].as_i64()?, pair[1].as_i64()?)))
                .collect::<Vec<_>>();
            anchors.push((entry.meta.rank, list));
        }
        if let Some(met) = crate::align::meet(&anchors) {
            let moved: Vec<String> = met
                .shifts
                .iter()
                .filter(|(_, by)| **by != 0)
                .map(|(rank, by)| format!("rank {rank} +{by}"))
                .collect();
            let note = format!(
                "steps: numbered alike on {} ranks (they share step {} at collective #{} of the default group){}",
                met.shifts.len(),
                met.step,
                met.count,
                if moved.is_empty() { String::new() } else { format!("; moved: {}", moved.join(", ")) },
            );
            return Ok((met.shifts, Some(note)));
        }
        let hopeless = crate::align::hopeless(&anchors, 4);
        if hopeless || std::time::Instant::now() >= deadline {
            let why = if hopeless {
                "their steps issue no collective on the default process group".to_string()
            } else {
                format!(
                    "their step boundaries did not meet within {} s; a rank that is stuck, or steps longer than that, leave them apart",
                    ALIGN_WAIT.as_secs()
                )
            };
            // Each rank's recording stops with the feature's request.
            let none: BTreeMap<i64, i64> = taking_part.iter().map(|&rank| (rank, 0)).collect();
            return Ok((
                none,
                Some(format!(
                    "steps: not numbered alike across ranks ({why}); each counts from where its clock started unless its optimizer keeps a count"
                )),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `cluster memory`: a light look at every rank at once, one line each,
/// the rank whose RSS stands out from the others' median marked.
pub fn memory(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    format: crate::BtFormat,
) -> Result<u8> {
    let request = serde_json::json!({"action": "summary", "light": true});
    if let crate::BtFormat::Json = format {
        return json_per_rank(job, run, ranks, "memory", |probe| probe.memory(&request));
    }
    let job = find_job(job, run)?;
    let answers = ask_ranks(&job, ranks, |probe| probe.memory(&request))?;
    let cuda_peak = |r: &serde_json::Value| {
        r["cuda"].as_array().and_then(|d| {
            d.iter()
                .filter_map(|x| x["peak_mb"].as_f64())
                .reduce(f64::max)
        })
    };
    // The rank that holds more than the others, in host memory or on its
    // GPU (an OOM on one rank is usually one of these).
    let rss_marks = outliers(
        &answers
            .iter()
            .map(|(_, a)| a.as_ref().ok().and_then(|r| r["rss_mb"].as_f64()))
            .collect::<Vec<_>>(),
    );
    let cuda_marks = outliers(
        &answers
            .iter()
            .map(|(_, a)| a.as_ref().ok().and_then(cuda_peak))
            .collect::<Vec<_>>(),
    );
    let mut table = Table::new(Style::Plain)
        .whole_column("RANK", Align::Right)
        .whole_column("PID", Align::Right)
        .whole_column("RSS", Align::Right)
        .whole_column("USS", Align::Right)
        .whole_column("CUDA PEAK", Align::Right)
        .whole_column("RSS GROWTH", Align::Left)
        .column("", Align::Left);
    let mut code = 0;
    for (at, (entry, answer)) in answers.iter().enumerate() {
        let mb = |v: &serde_json::Value| {
            v.as_f64()
                .map(|x| format!("{x:.0} MB"))
                .unwrap_or_else(|| "-".into())
        };
        match answer {
            Ok(r) => {
                let peak = cuda_peak(r);
                let growth = r["growth"]["rss_mb"].as_f64().map(|g| {
                    format!(
                        "{g:+.0} MB in {:.0} s",
                        r["growth"]["seconds"].as_f64().unwrap_or(0.0)
                    )
                });
                let marks: Vec<String> = [("RSS", rss_marks[at]), ("CUDA peak", cuda_marks[at])]
                    .into_iter()
                    .filter_map(|(what, ratio)| Some(format!("{what} {:.1}x the median", ratio?)))
                    .collect();
                table.row(vec![
                    entry.meta.rank.to_string(),
                    entry.meta.pid.to_string(),
                    mb(&r["rss_mb"]),
                    mb(&r["uss_mb"]),
                    peak.map(|p| format!("{p:.0} MB"))
                        .unwrap_or_else(|| "-".into()),
                    growth.unwrap_or_else(|| "-".into()),
                    if marks.is_empty() {
                        String::new()
                    } else {
                        format!("<-- {}", marks.join(", "))
                    },
                ]);
            }
            Err(why) => {
                code = 1;
                table.row(vec![
                    entry.meta.rank.to_string(),
                    entry.meta.pid.to_string(),
                    format!("error: {why}"),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                ]);
            }
        }
    }
    crate::term::print(&table);
    Ok(code)
}

/// For each rank's value, its ratio to the median where it is the largest
/// and more than 1.2x the median, among three or more ranks with a value.
fn outliers(values: &[Option<f64>]) -> Vec<Option<f64>> {
    let mut known: Vec<f64> = values.iter().flatten().copied().collect();
    known.sort_by(|a, b| a.total_cmp(b));
    let (Some(&median), Some(&largest)) = (known.get(known.len() / 2), known.last()) else {
        return vec![None; values.len()];
    };
    values
        .iter()
        .map(|v| {
            let v = (*v)?;
            (known.len() > 2 && median > 0.0 && v > median * 1.2 && v == largest)
                .then(|| v / median)
        })
        .collect()
}

/// One JSON array, an object per rank: its rank, pid, and its answer under
/// `key` (or why there is none under `error`); exit 1 if any rank failed.
fn json_per_rank(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    key: &str,
    ask: impl Fn(&Probe) -> Result<serde_json::Value> + Sync,
) -> Result<u8> {
    let job = find_job(job, run)?;
    let answers = ask_ranks(&job, ranks, ask)?;
    let failed = answers.iter().any(|(_, answer)| answer.is_err());
    let rows: Vec<serde_json::Value> = answers
        .into_iter()
        .map(|(entry, answer)| {
            let (key, value) = match answer {
                Ok(reply) => (key, reply),
                Err(why) => ("error", serde_json::Value::String(why)),
            };
            serde_json::json!({"rank": entry.meta.rank, "pid": entry.meta.pid, key: value})
        })
        .collect();
    println!("{}", serde_json::to_string_pretty(&rows)?);
    Ok(u8::from(failed))
}

/// Asks every selected running rank in parallel; answers in rank order,
/// each with why there is none.
fn ask_ranks<'j, T: Send>(
    job: &'j Job,
    ranks: Option<&str>,
    ask: impl Fn(&Probe) -> Result<T> + Sync,
) -> Result<Vec<(&'j RankEntry, Result<T, String>)>> {
    ask_ranks_each(job, ranks, |_, probe| ask(probe))
}

/// `ask_ranks`, with a question that depends on the rank.
fn ask_ranks_each<'j, T: Send>(
    job: &'j Job,
    ranks: Option<&str>,
    ask: impl Fn(&RankEntry, &Probe) -> Result<T> + Sync,
) -> Result<Vec<(&'j RankEntry, Result<T, String>)>> {
    let selected = job.selected(ranks)?;
    let here = rankscope_core::host::hostname();
    let results = fan_out(&selected, |entry| match liveness(entry, &here) {
        // A rank's error keeps its hint (a bad --thread/--frame names what exists).
        Liveness::Running => probe_of(entry)
            .and_then(|p| ask(entry, &p))
            .map_err(|e| match e.downcast_ref::<Hinted>() {
                Some(h) => format!("{}\nhint: {}", h.message, h.hint),
                None => format!("{e:#}"),
            }),
        other => Err(other.word().to_string()),
    });
    Ok(selected.into_iter().zip(results).collect())
}

/// Asks every selected running rank in parallel and prints each answer (or
/// why there is none) under its rank; exits 1 if any rank failed.
fn each_rank<T: Send>(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    ask: impl Fn(&Probe) -> Result<T> + Sync,
    show: impl Fn(T) -> u8,
) -> Result<u8> {
    let job = find_job(job, run)?;
    let mut code = 0;
    for (entry, result) in ask_ranks(&job, ranks, ask)? {
        println!("== rank {} (pid {})", entry.meta.rank, entry.meta.pid);
        match result {
            Ok(reply) => code = code.max(show(reply)),
            Err(why) => {
                println!("error: {why}");
                code = 1;
            }
        }
    }
    Ok(code)
}

/// Rows of every rank, each tagged with its own pid and rank already; a
/// rank that fails is left out with a warning, the rest still answer.
struct AllRanks {
    probes: Vec<Box<dyn RowSource>>,
    warnings: Mutex<Vec<String>>,
}

impl RowSource for AllRanks {
    fn rows(&self, table: &TableDef) -> Result<Rows, String> {
        match self.scan(table, &Scan::default())? {
            Fetched::Rows(rows) => Ok(rows),
            Fetched::Counts(_) => Err("a full scan came back as counts".into()),
            Fetched::Batches(_) => Err("a full scan came back as files".into()),
        }
    }

    /// Every rank gets the same scan, in parallel; counts stay counts, so a
    /// `count(*)` over the job moves one number per rank.
    fn scan(&self, table: &TableDef, scan: &Scan) -> Result<Fetched, String> {
        let per_rank: Vec<Result<Fetched, String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .probes
                .iter()
                .map(|p| scope.spawn(|| p.scan(table, scan)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
                .collect()
        });
        let mut rows = Vec::new();
        let mut counts = Vec::new();
        let mut batches = Vec::new();
        for result in per_rank {
            match result {
                Ok(Fetched::Rows(r)) => rows.extend(r),
                Ok(Fetched::Counts(c)) => counts.extend(c),
                // A table the CLI writes into each rank's run store (the
                // last profile): that rank's files, in the scan's columns.
                Ok(Fetched::Batches(b)) => batches.extend(b),
                Err(e) => self
                    .warnings
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(e),
            }
        }
        if !batches.is_empty() {
            if !rows.is_empty() || !counts.is_empty() {
                // Every rank gets the same scan of the same kind of table.
                self.warnings
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push("ranks answered the same scan in different ways; rows left out".into());
            }
            return Ok(Fetched::Batches(batches));
        }
        if rows.is_empty() {
            return Ok(Fetched::Counts(counts));
        }
        // Mixed answers (not expected: every rank gets the same scan): rows for all.
        let width = table.all_columns().count();
        for (identity, count) in counts {
            let mut row = identity.to_vec();
            row.resize(width, serde_json::Value::Null);
            rows.extend(std::iter::repeat_n(row, count));
        }
        Ok(Fetched::Rows(rows))
    }
}

pub fn query(
    job: Option<&str>,
    run: Option<PathBuf>,
    ranks: Option<&str>,
    sql: &str,
    format: QueryFormat,
    all_frames: bool,
) -> Result<u8> {
    let here = rankscope_core::host::hostname();
    let over = |job: &Job| {
        !job.ranks
            .iter()
            .any(|r| liveness(r, &here) == Liveness::Running)
    };
    let job = match (find_job(job, run.clone()), &run) {
        (Ok(job), _) if !over(&job) || job.run_dirs.is_empty() => job,
        // The job is over: its rows are in its run store, every rank's;
        // only its own, where other jobs wrote to the same directory.
        (Ok(job), _) => return query_finished(&job, ranks, sql, format),
        (Err(_), Some(dir)) => match find_job_or(None, run.clone(), NoneRunning::Latest) {
            Ok(job) if !job.run_dirs.is_empty() => return query_finished(&job, ranks, sql, format),
            // No registry (processes of no job): every process's rows.
            _ => {
                if ranks.is_some() {
                    return Err(no_ranks_to_ask().into());
                }
                eprintln!(
                    "note: no rank of this job is running: read from its run store ({})",
                    dir.display()
                );
                return super::query::run_offline(Some(dir.clone()), false, sql, format);
            }
        },
        (Err(e), None) => return Err(e),
    };
    let selected = job.selected(ranks)?;
    let mut probes: Vec<Box<dyn RowSource>> = Vec::new();
    let mut skipped = Vec::new();
    for entry in selected {
        match (liveness(entry, &here), probe_of(entry)) {
            (Liveness::Running, Ok(probe)) => probes.push(Box::new(super::query::LiveProbe::new(
                probe, false, all_frames,
            ))),
            (state, _) => skipped.push(format!("rank {} ({})", entry.meta.rank, state.word())),
        }
    }
    if !skipped.is_empty() {
        eprintln!("note: left out: {}", skipped.join(", "));
    }
    let source = Arc::new(AllRanks {
        probes,
        warnings: Mutex::new(Vec::new()),
    });
    let code = super::query::execute(source.clone(), sql, format)?;
    for warning in source
        .warnings
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        eprintln!("warning: a rank did not answer: {warning}");
    }
    Ok(code)
}

fn no_ranks_to_ask() -> Hinted {
    Hinted::new(
        "no rank of this job is running, so --ranks has no ranks to ask",
        "the run store holds every rank's rows: filter them with WHERE rank IN (...)",
    )
}

/// `cluster query` once no rank of the job runs: the rows its processes
/// left in its run store (not those of another job, or of a program that
/// is no job's, that wrote to the same directory).
fn query_finished(job: &Job, ranks: Option<&str>, sql: &str, format: QueryFormat) -> Result<u8> {
    if ranks.is_some() {
        return Err(no_ranks_to_ask().into());
    }
    let dirs: Vec<String> = job
        .run_dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    eprintln!(
        "note: no rank of this job is running: read from its run store ({}; job {})",
        dirs.join(", "),
        job.id
    );
    super::query::run_offline_of(job.run_dirs.clone(), job.processes.clone(), sql, format)
}

#[cfg(test)]
mod tests {
    use super::outliers;

    fn entry_of_this_process(started_at: Option<f64>, state: Option<&str>) -> super::RankEntry {
        let here = rankscope_core::host::hostname();
        let value = serde_json::json!({
            "pid": std::process::id(), "ppid": 1, "host": here, "rank": 0, "local_rank": 0,
            "world_size": 1, "cmdline": [], "exe": "", "cwd": "", "python_version": "3",
            "started_at": 0.0, "process_started_at": started_at, "rankscope_version": "0",
            "protocol": rankscope_core::PROTOCOL_VERSION, "state": state,
        });
        serde_json::from_value(value).expect("an entry")
    }

    #[test]
    fn a_pid_taken_by_another_process_or_an_exited_entry_is_not_a_running_rank() {
        use super::{liveness, Liveness};
        let here = rankscope_core::host::hostname();
        let started = rankscope_core::host::process_started_at(std::process::id());
        let live = entry_of_this_process(started, Some("running"));
        assert!(matches!(liveness(&live, &here), Liveness::Running));
        // The rank that wrote the entry started a minute before this process:
        // the PID came round again to another process.
        let reused = entry_of_this_process(started.map(|t| t - 60.0), Some("running"));
        assert!(matches!(liveness(&reused, &here), Liveness::Dead));
        let exited = entry_of_this_process(started, Some("exited"));
        assert!(matches!(liveness(&exited, &here), Liveness::Exited));
    }

    #[test]
    fn the_rank_that_holds_more_is_marked_in_either_memory() {
        // RSS: rank 2 holds 2x the median; a CUDA peak alike everywhere.
        assert_eq!(
            outliers(&[Some(100.0), Some(110.0), Some(220.0), Some(105.0)]),
            [None, None, Some(2.0), None]
        );
        // A rank without CUDA is left out of the CUDA median, not counted as 0.
        let cuda = outliers(&[Some(4000.0), None, Some(4100.0), Some(7000.0)]);
        assert_eq!(cuda[..3], [None, None, None]);
        assert!((cuda[3].unwrap() - 7000.0 / 4100.0).abs() < 1e-9);
        // Two ranks, or nothing out of line: no mark.
        assert_eq!(outliers(&[Some(1.0), Some(9.0)]), [None, None]);
        assert_eq!(
            outliers(&[Some(10.0), Some(11.0), Some(12.0)]),
            [None, None, None]
        );
        assert_eq!(outliers(&[None, None]), [None, None]);
    }
}
