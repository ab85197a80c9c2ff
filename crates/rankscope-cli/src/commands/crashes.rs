//! `rankscope crashes`: the crash records probes left in run directories,
//! readable after the processes are gone.
//!
//! Two kinds of entry: `crash-*.json` (an uncaught exception with its frames
//! and locals, written by `rankscope._probe.crashes`) and non-empty
//! `native-*.log` (faulthandler's output after a segfault or abort).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Result;
use rankscope_core::crash::{self, CrashRecord};
use rankscope_core::paths;
use rankscope_core::tables::Rows;
use serde_json::{json, Value};

use rankscope_query::table::{Align, Style, Table};

use crate::hint::Hinted;
use crate::ListFormat;

enum Kind {
    Exception(Box<CrashRecord>),
    /// `rank`: the rank its process registered as in the run directory.
    Native {
        pid: Option<u32>,
        rank: Option<i64>,
        text: String,
    },
}

struct Entry {
    time: f64,
    path: PathBuf,
    /// The run directory's name (the job), shown when listing several.
    job: String,
    kind: Kind,
}

impl Entry {
    fn rank(&self) -> Option<i64> {
        match &self.kind {
            Kind::Exception(r) => r.rank,
            Kind::Native { rank, .. } => *rank,
        }
    }

    fn pid(&self) -> Option<u32> {
        match &self.kind {
            Kind::Exception(r) => Some(r.pid),
            Kind::Native { pid, .. } => *pid,
        }
    }

    /// Written by a job's launcher (torchrun's exit), not by the user's program.
    fn launcher(&self) -> bool {
        matches!(&self.kind, Kind::Exception(r) if r.is_launcher())
    }

    /// The RANK column: the rank, `launcher`, or `?`.
    fn rank_cell(&self) -> String {
        if self.launcher() {
            "launcher".to_string()
        } else {
            opt(self.rank())
        }
    }

    /// "Type: message" for an exception, "native crash: Fatal Python error: ..." otherwise.
    fn summary(&self) -> String {
        match &self.kind {
            Kind::Exception(r) => match r.last_exception() {
                Some(e) if e.message.is_empty() => e.type_name.clone(),
                Some(e) => format!("{}: {}", e.type_name, first_line(&e.message)),
                None => "(no exception)".to_string(),
            },
            Kind::Native { text, .. } => {
                let fatal = text
                    .lines()
                    .find(|l| l.starts_with("Fatal Python error"))
                    .or_else(|| text.lines().next());
                format!("native crash: {}", fatal.unwrap_or_default().trim())
            }
        }
    }

    /// Where the user looks first: the innermost frame in their own code.
    fn location(&self) -> String {
        match &self.kind {
            Kind::Exception(r) => r
                .user_location()
                .map(|f| format!("{}:{}", f.file, f.lineno))
                .unwrap_or_default(),
            Kind::Native { text, .. } => native_location(text).unwrap_or_default(),
        }
    }

    /// Where it was raised (or crashed): the innermost frame, library or not.
    fn innermost(&self) -> String {
        match &self.kind {
            Kind::Exception(r) => r
                .location()
                .map(|f| format!("{}:{}", f.file, f.lineno))
                .unwrap_or_default(),
            Kind::Native { text, .. } => native_frames(crashing_thread(text))
                .next()
                .map(|(file, line)| place(file, line))
                .unwrap_or_default(),
        }
    }
}

/// Whether an entry, by (pid, time), is one of the job's.
pub type KeepEntry = Box<dyn Fn(Option<u32>, f64) -> bool>;

/// Which entries a listing shows.
#[derive(Default)]
pub struct Select {
    /// The launcher's records too (`--all`).
    pub all: bool,
    /// Only what one job left in a run directory other jobs share: see
    /// `cluster crashes`. Called with (pid, time) of each entry.
    pub keep: Option<KeepEntry>,
}

impl Select {
    fn wants(&self, entry: &Entry) -> bool {
        (self.all || !entry.launcher())
            && self
                .keep
                .as_ref()
                .is_none_or(|keep| keep(entry.pid(), entry.time))
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

/// The Python frames faulthandler printed, innermost first (the crashing
/// thread's come first): `  File "x.py", line 3 in f` -> ("x.py", "3").
fn native_frames(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.lines().filter_map(|line| {
        let rest = line.trim_start().strip_prefix("File \"")?;
        let (file, rest) = rest.split_once('"')?;
        let digits = rest.trim_start_matches(", line ");
        Some((
            file,
            &digits[..digits.bytes().take_while(u8::is_ascii_digit).count()],
        ))
    })
}

/// The block of faulthandler's dump for the thread that crashed ("Current
/// thread ..."). A thread that aborts with the GIL let go (a C++ exception
/// in a collective, gloo's "enforce fail") is not marked current: then the
/// last block with a frame of the user's own code, which is the main
/// thread's where it has one (faulthandler lists the newest thread first),
/// not a DataLoader's feeder thread waiting in `threading.py`.
fn crashing_thread(text: &str) -> &str {
    let blocks: Vec<&str> = text.split("\n\n").collect();
    blocks
        .iter()
        .find(|b| b.trim_start().starts_with("Current thread"))
        .or_else(|| {
            blocks
                .iter()
                .rev()
                .find(|b| native_frames(b).any(|(file, _)| crash::is_user_file(file)))
        })
        .or_else(|| blocks.iter().find(|b| b.contains("File \"")))
        .copied()
        .unwrap_or(text)
}

/// The rank the process `pid` registered as in the run directory `dir`
/// (`ranks/rank<R>-pid<P>.json`); faulthandler's dump does not say.
fn registered_rank(dir: &Path, pid: u32) -> Option<i64> {
    let suffix = format!("-pid{pid}.json");
    std::fs::read_dir(dir.join("ranks"))
        .ok()?
        .flatten()
        .find_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_suffix(&suffix)?
                .strip_prefix("rank")?
                .parse()
                .ok()
        })
}

fn place(file: &str, line: &str) -> String {
    if line.is_empty() {
        file.to_string()
    } else {
        format!("{file}:{line}")
    }
}

/// The crashing thread's innermost frame in the user's own code, else its
/// innermost frame.
fn native_location(text: &str) -> Option<String> {
    let mut frames = native_frames(crashing_thread(text)).peekable();
    let innermost = *frames.peek()?;
    let (file, line) = frames
        .find(|(file, _)| crash::is_user_file(file))
        .unwrap_or(innermost);
    Some(place(file, line))
}

/// When `path` last changed, in seconds since the epoch (0 when unknown).
pub(crate) fn mtime(path: &Path) -> f64 {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn job_of(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

fn read_dir_entries(dir: &Path, out: &mut Vec<Entry>) -> Result<()> {
    let job = job_of(dir);
    for path in crash::record_files(dir)? {
        let parsed = std::fs::read(&path)
            .map_err(anyhow::Error::from)
            .and_then(|bytes| {
                serde_json::from_slice::<CrashRecord>(&bytes).map_err(anyhow::Error::from)
            });
        match parsed {
            Ok(record) => out.push(Entry {
                time: record.time,
                path,
                job: job.clone(),
                kind: Kind::Exception(Box::new(record)),
            }),
            Err(err) => eprintln!("warning: skipped {}: {err}", path.display()),
        }
    }
    for path in crash::native_logs(dir)? {
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let pid = crash::native_log_pid(&path);
        if bytes.iter().all(u8::is_ascii_whitespace) {
            // A live process's log, or one left by a process that ended
            // without its atexit (SIGKILL, os._exit): that one goes.
            if pid.is_some_and(|p| !paths::pid_alive(p)) {
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let rank = pid.and_then(|p| registered_rank(dir, p));
        out.push(Entry {
            time: mtime(&path),
            path,
            job: job.clone(),
            kind: Kind::Native { pid, rank, text },
        });
    }
    Ok(())
}

/// Which run directories to read: `--run`, else RANKSCOPE_RUN_DIR, else every
/// job's directory under ~/.local/state/rankscope/runs. Returns the entries
/// in time order (ids are 1-based positions in it) and whether several run
/// directories were read.
fn collect(run: Option<PathBuf>) -> Result<(Vec<Entry>, bool)> {
    let explicit = crash::explicit_run_dir(run);
    let mut entries = Vec::new();
    let several = match explicit {
        Some(dir) => {
            if !dir.is_dir() {
                return Err(Hinted::new(
                    format!("no run directory at {}", dir.display()),
                    "crash records are written there by processes started with RANKSCOPE=1 (or rankscope.start()); \
                     check --run or RANKSCOPE_RUN_DIR, or leave both out to read every job under ~/.local/state/rankscope/runs",
                )
                .into());
            }
            read_dir_entries(&dir, &mut entries)?;
            false
        }
        None => {
            let dirs = crash::run_dirs(None);
            for dir in &dirs {
                read_dir_entries(dir, &mut entries)?;
            }
            dirs.len() > 1
        }
    };
    entries.sort_by(|a, b| a.time.total_cmp(&b.time).then_with(|| a.path.cmp(&b.path)));
    Ok((entries, several))
}

/// Local time, to the second.
fn local_time(epoch: f64) -> String {
    let secs = epoch as libc::time_t;
    // SAFETY: localtime_r writes into the tm we own and reads only `secs`.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return format!("{epoch:.0}");
    }
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

fn opt<T: ToString>(value: Option<T>) -> String {
    value
        .map(|v| v.to_string())
        .unwrap_or_else(|| "?".to_string())
}

/// `python.crashes`: the records of the run directories `rankscope crashes`
/// reads, in its order (so `id` matches), optionally only those of `pid`.
/// The launcher's records only with `launcher` (a PID named is read whole).
pub fn table_rows(run: Option<PathBuf>, pid: Option<u32>, launcher: bool) -> Result<Rows> {
    let (entries, _) = collect(run)?;
    let mut rows = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if (pid.is_some() && e.pid() != pid) || (e.launcher() && !launcher && pid.is_none()) {
            continue;
        }
        let micros = json!((e.time * 1e6).round() as i64);
        let split = |location: &str| match location.rsplit_once(':') {
            Some((file, line)) if line.parse::<i64>().is_ok() => {
                (json!(file), json!(line.parse::<i64>().ok()))
            }
            _ if location.is_empty() => (Value::Null, Value::Null),
            _ => (json!(location), Value::Null),
        };
        let row = match &e.kind {
            Kind::Exception(r) => {
                let exc = r.last_exception();
                let frame = r.location();
                let user = r.user_location();
                vec![
                    json!(r.pid),
                    json!(r.rank),
                    json!(r.host),
                    micros,
                    json!(i + 1),
                    json!("exception"),
                    json!(e.launcher()),
                    json!(r.thread),
                    json!(exc.map(|x| x.type_name.clone())),
                    json!(exc.map(|x| x.message.clone())),
                    json!(frame.map(|f| f.func.clone())),
                    json!(frame.map(|f| f.file.clone())),
                    json!(frame.map(|f| f.lineno)),
                    json!(frame.and_then(|f| f.source.clone())),
                    json!(user.map(|f| f.func.clone())),
                    json!(user.map(|f| f.file.clone())),
                    json!(user.map(|f| f.lineno)),
                    json!(e.job),
                    json!(e.path.display().to_string()),
                ]
            }
            Kind::Native { pid, rank, .. } => {
                let (file, lineno) = split(&e.innermost());
                let (user_file, user_lineno) = split(&e.location());
                vec![
                    json!(pid),
                    json!(rank),
                    Value::Null,
                    micros,
                    json!(i + 1),
                    json!("native"),
                    json!(false),
                    Value::Null,
                    Value::Null,
                    json!(e.summary()),
                    Value::Null,
                    file,
                    lineno,
                    Value::Null,
                    Value::Null,
                    user_file,
                    user_lineno,
                    json!(e.job),
                    json!(e.path.display().to_string()),
                ]
            }
        };
        rows.push(row);
    }
    Ok(rows)
}

/// A rank whose registry entry still says "running" while its process is
/// gone from this machine: killed from outside (the kernel's OOM killer,
/// SIGKILL), which no record can catch. Its memory timeline in the run
/// store says how big it was last.
struct Vanished {
    rank: i64,
    pid: u32,
    /// Where it exited with a failing status and no record: the status.
    exit_code: Option<i64>,
    /// The last `python.memory` row's time and RSS.
    last: Option<(f64, f64)>,
}

fn vanished(run: Option<PathBuf>) -> Vec<Vanished> {
    let dirs = match crash::explicit_run_dir(run) {
        Some(dir) => vec![dir],
        None => crash::run_dirs(None),
    };
    let here = rankscope_core::host::hostname();
    let mut out = Vec::new();
    for dir in dirs {
        let Ok(read) = std::fs::read_dir(dir.join("ranks")) else {
            continue;
        };
        for path in read
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
        {
            let Some(entry) = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            else {
                continue;
            };
            let (Some(pid), Some(rank)) = (entry["pid"].as_u64(), entry["rank"].as_i64()) else {
                continue;
            };
            // Exited with a failing status: an exception that no hook saw
            // (mp.spawn's worker wrapper catches it), or sys.exit(1).
            let failed = entry["exit_code"].as_i64().filter(|&c| c != 0);
            let exited = entry["state"].as_str() == Some("exited") && failed.is_some();
            let killed = entry["state"].as_str() == Some("running")
                && entry["host"].as_str() == Some(here.as_str())
                && !paths::pid_alive(pid as u32);
            if !exited && !killed {
                continue;
            }
            out.push(Vanished {
                rank,
                pid: pid as u32,
                exit_code: failed.filter(|_| exited),
                last: last_memory(&dir, pid as i64),
            });
        }
    }
    out.sort_by_key(|v| (v.rank, v.pid));
    out
}

/// The time and RSS (MB) of a process's last `python.memory` row on disk.
fn last_memory(dir: &Path, pid: i64) -> Option<(f64, f64)> {
    use arrow_array::{Array, Float64Array, Int64Array, TimestampMicrosecondArray};
    let batches = rankscope_store::read_table(
        &[dir.to_path_buf()],
        &rankscope_core::tables::MEMORY,
        Some(&["pid", "ts", "rss_mb"]),
    )
    .ok()?;
    let mut last: Option<(f64, f64)> = None;
    for batch in &batches {
        let pids = batch.column(0).as_any().downcast_ref::<Int64Array>()?;
        let times = batch
            .column(1)
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()?;
        let rss = batch.column(2).as_any().downcast_ref::<Float64Array>()?;
        for i in 0..batch.num_rows() {
            if pids.is_valid(i) && pids.value(i) == pid && rss.is_valid(i) {
                let at = times.value(i) as f64 / 1e6;
                if last.is_none_or(|(t, _)| at >= t) {
                    last = Some((at, rss.value(i)));
                }
            }
        }
    }
    last
}

fn vanished_text(gone: &[Vanished]) -> String {
    let mut out = String::new();
    for v in gone {
        if let Some(code) = v.exit_code {
            out += &format!(
                "rank {} (pid {}) exited with status {code} and no crash record: its exception was caught before any hook saw it (mp.spawn's worker wrapper catches it and hands it to the parent, which prints it), or it called sys.exit({code})\n",
                v.rank, v.pid
            );
            continue;
        }
        let last = match v.last {
            Some((at, rss)) => format!(
                "last seen at {} with RSS {rss:.1} MB (python.memory)",
                local_time(at)
            ),
            None => "no memory timeline on disk".to_string(),
        };
        out += &format!(
            "rank {} (pid {}) vanished without a record: {last}; killed from outside by a signal it does not handle: the kernel's OOM killer, a SIGKILL, or a SIGTERM (torchrun sends one to the other ranks when a rank fails; `dmesg` names the OOM killer's victims)\n",
            v.rank, v.pid
        );
    }
    out
}

pub fn list(run: Option<PathBuf>, format: ListFormat, select: &Select) -> Result<u8> {
    let gone = if matches!(format, ListFormat::Json) {
        Vec::new()
    } else {
        vanished(run.clone())
    };
    let (entries, several) = collect(run)?;
    // One with a record (an exception's, or faulthandler's after an abort)
    // says why itself; another job's ranks (a run directory that jobs
    // share) are not this one's to name.
    let gone: Vec<Vanished> = gone
        .into_iter()
        .filter(|v| !entries.iter().any(|e| e.pid() == Some(v.pid)))
        .filter(|v| {
            select
                .keep
                .as_ref()
                .is_none_or(|keep| keep(Some(v.pid), f64::NAN))
        })
        .collect();
    // Ids are positions among every entry, launcher's included, so an id
    // means the same with and without --all.
    let shown: Vec<(usize, &Entry)> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (i + 1, e))
        .filter(|(_, e)| select.wants(e))
        .collect();
    let hidden = entries
        .iter()
        .filter(|e| {
            e.launcher() && !select.all && select.keep.as_ref().is_none_or(|k| k(e.pid(), e.time))
        })
        .count();
    match format {
        ListFormat::Json => {
            let rows: Vec<_> = shown
                .iter()
                .map(|&(id, e)| {
                    let (kind, record) = match &e.kind {
                        Kind::Exception(r) => ("exception", Some(r)),
                        Kind::Native { .. } => ("native", None),
                    };
                    json!({
                        "id": id,
                        "kind": kind,
                        "launcher": e.launcher(),
                        "time": e.time,
                        "rank": e.rank(),
                        "pid": e.pid(),
                        "host": record.map(|r| r.host.clone()),
                        "thread": record.map(|r| r.thread.clone()),
                        "source": record.map(|r| r.source.clone()),
                        "type": record.and_then(|r| r.last_exception()).map(|x| x.type_name.clone()),
                        "message": match &e.kind {
                            Kind::Exception(r) => r.last_exception().map(|x| x.message.clone()),
                            Kind::Native { .. } => Some(e.summary()),
                        },
                        "location": e.location(),
                        "innermost": e.innermost(),
                        "job": e.job,
                        "path": e.path.display().to_string(),
                    })
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&rows)?);
        }
        ListFormat::Table => {
            if shown.is_empty() {
                println!("No crashes recorded.");
                if hidden == 0 {
                    println!("hint: processes started with RANKSCOPE=1 (or rankscope.start()) record uncaught exceptions here");
                }
            } else {
                let mut table = Table::new(Style::Plain)
                    .whole_column("ID", Align::Right)
                    .whole_column("TIME", Align::Left)
                    .whole_column("RANK", Align::Right)
                    .whole_column("PID", Align::Right);
                if several {
                    table = table.column("JOB", Align::Left);
                }
                table = table
                    .column("EXCEPTION", Align::Left)
                    .column("LOCATION", Align::Left);
                for &(id, e) in &shown {
                    let mut row = vec![
                        id.to_string(),
                        local_time(e.time),
                        e.rank_cell(),
                        opt(e.pid()),
                    ];
                    if several {
                        row.push(e.job.clone());
                    }
                    row.extend([e.summary(), e.location()]);
                    table.row(row);
                }
                crate::term::print(&table);
            }
        }
    }
    print!("{}", vanished_text(&gone));
    if hidden > 0 {
        let records = if hidden == 1 {
            "1 record".to_string()
        } else {
            format!("{hidden} records")
        };
        eprintln!(
            "note: {records} of the job launcher (torchrun's own exit) left out; --all shows them"
        );
    }
    Ok(0)
}

pub fn show(id: usize, run: Option<PathBuf>, format: ListFormat) -> Result<u8> {
    let (entries, _) = collect(run)?;
    let count = entries.len();
    let Some(entry) = id.checked_sub(1).and_then(|i| entries.get(i)) else {
        let hint = if count == 0 {
            "no crashes are recorded there; `rankscope crashes` lists what is".to_string()
        } else {
            format!("ids go from 1 to {count}; `rankscope crashes` lists them")
        };
        let there = if count == 1 {
            "is 1 crash record".to_string()
        } else {
            format!("are {count} crash records")
        };
        return Err(Hinted::new(format!("no crash {id}: there {there}"), hint).into());
    };
    let text = match (&entry.kind, format) {
        (Kind::Exception(record), ListFormat::Json) => serde_json::to_string_pretty(record)? + "\n",
        (Kind::Native { pid, text, .. }, ListFormat::Json) => {
            serde_json::to_string_pretty(
                &json!({"kind": "native", "pid": pid, "time": entry.time, "log": text}),
            )? + "\n"
        }
        (Kind::Exception(record), ListFormat::Table) => render(id, count, record, &entry.path),
        (Kind::Native { pid, text, .. }, ListFormat::Table) => {
            let mut out = format!(
                "Crash {id} of {count}: native crash of pid {} at {}\n{}\n\n",
                opt(*pid),
                local_time(entry.time),
                entry.path.display()
            );
            out.push_str(text);
            if !out.ends_with('\n') {
                out.push('\n');
            }
            out
        }
    };
    print!("{text}");
    Ok(0)
}

/// Like Python's own traceback, innermost frame last, with each frame's
/// locals under its source line.
fn render(id: usize, count: usize, record: &CrashRecord, path: &Path) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Crash {id} of {count}: {}, pid {} on {}, thread \"{}\" ({})",
        if record.is_launcher() {
            "the job launcher (torchrun's own process, not a rank)".to_string()
        } else {
            format!(
                "rank {}",
                record
                    .rank
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| "-".into())
            )
        },
        record.pid,
        record.host,
        record.thread,
        record.source
    );
    let python = if record.python_version.is_empty() {
        String::new()
    } else {
        format!(", Python {}", record.python_version)
    };
    let _ = writeln!(
        out,
        "at {}{python}: {}",
        local_time(record.time),
        record.argv.join(" ")
    );
    let _ = writeln!(out, "{}", path.display());
    for exception in &record.exceptions {
        match exception.via.as_deref() {
            Some("cause") => out.push_str(
                "\nThe above exception was the direct cause of the following exception:\n",
            ),
            Some(_) => out.push_str(
                "\nDuring handling of the above exception, another exception occurred:\n",
            ),
            None => {}
        }
        if !exception.frames.is_empty() {
            out.push_str("\nTraceback (most recent call last):\n");
        } else {
            out.push('\n');
        }
        if exception.frames_omitted > 0 {
            let _ = writeln!(
                out,
                "  [... {} outer frames omitted: the record keeps the innermost {}]",
                exception.frames_omitted,
                exception.frames.len()
            );
        }
        for frame in &exception.frames {
            let name = if frame.qualname.is_empty() {
                &frame.func
            } else {
                &frame.qualname
            };
            let _ = writeln!(
                out,
                "  File \"{}\", line {}, in {name}",
                frame.file, frame.lineno
            );
            if let Some(source) = frame.source.as_deref().filter(|s| !s.is_empty()) {
                let _ = writeln!(out, "    {source}");
            }
            for local in &frame.locals {
                let _ = writeln!(
                    out,
                    "        {} = {}",
                    local.name,
                    local.repr.replace('\n', "\n          ")
                );
            }
        }
        if exception.message.is_empty() {
            let _ = writeln!(out, "{}", exception.type_name);
        } else {
            let _ = writeln!(out, "{}: {}", exception.type_name, exception.message);
        }
    }
    if let Some(memory) = &record.memory {
        out += &memory_text(memory);
    }
    out
}

/// The memory picture a record carries, as `crashes show` prints it.
fn memory_text(memory: &serde_json::Value) -> String {
    let mb = |key: &str| {
        memory[key]
            .as_f64()
            .map(|v| format!("{v:.1} MB"))
            .unwrap_or_else(|| "?".into())
    };
    // USS is read for a memory error only (smaps_rollup is slow).
    let uss = if memory["uss_mb"].is_null() {
        String::new()
    } else {
        format!(", USS {}", mb("uss_mb"))
    };
    let mut out = format!(
        "\nMemory at the crash: RSS {} (peak {}){uss}, swap {}\n",
        mb("rss_mb"),
        mb("rss_peak_mb"),
        mb("swap_mb")
    );
    for device in memory["cuda"].as_array().into_iter().flatten() {
        let f = |key: &str| {
            device[key]
                .as_f64()
                .map(|v| format!("{v:.1} MB"))
                .unwrap_or_else(|| "?".into())
        };
        out += &format!(
            "  {}: allocated {}, reserved {}, peak {}, {} OOMs\n",
            device["device"].as_str().unwrap_or("cuda"),
            f("allocated_mb"),
            f("reserved_mb"),
            f("peak_mb"),
            device["ooms"]
        );
    }
    // How it got there: the first and last of the timeline's rows kept.
    let timeline = memory["timeline"].as_array().cloned().unwrap_or_default();
    if let (Some(first), Some(last)) = (timeline.first(), timeline.last()) {
        let seconds = last["ts"].as_f64().unwrap_or(0.0) - first["ts"].as_f64().unwrap_or(0.0);
        let cuda = match (
            first["cuda_allocated_mb"].as_f64(),
            last["cuda_allocated_mb"].as_f64(),
        ) {
            (Some(a), Some(b)) => format!(", CUDA allocated {a:.1} -> {b:.1} MB"),
            _ => String::new(),
        };
        out += &format!(
            "  timeline: RSS {:.1} -> {:.1} MB over the last {seconds:.0} s ({} rows of python.memory){cuda}\n",
            first["rss_mb"].as_f64().unwrap_or(0.0),
            last["rss_mb"].as_f64().unwrap_or(0.0),
            timeline.len()
        );
    }
    if let Some(summary) = memory["cuda_summary"].as_str() {
        out += "  CUDA allocator (torch.cuda.memory_summary):\n";
        for line in summary.lines() {
            out += &format!("    {line}\n");
        }
    }
    let tensors = memory["largest_tensors"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !tensors.is_empty() {
        out += "  largest tensors:\n";
    }
    for t in &tensors {
        out += &format!(
            "    {:>9.1} MB  {} {} on {}  {}\n",
            t["mb"].as_f64().unwrap_or(0.0),
            t["shape"].as_str().unwrap_or("?"),
            t["dtype"].as_str().unwrap_or("?"),
            t["device"].as_str().unwrap_or("?"),
            t["holder"].as_str().unwrap_or("(no name found)")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native_entry(rank: Option<i64>, text: &str) -> Entry {
        Entry {
            time: 0.0,
            path: PathBuf::from("native-5.log"),
            job: "local".into(),
            kind: Kind::Native {
                pid: Some(5),
                rank,
                text: text.into(),
            },
        }
    }

    const FAULTHANDLER: &str = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call first):\n  File \"/tmp/t.py\", line 3 in <module>\n";

    #[test]
    fn an_out_of_memory_picture_shows_how_it_got_there() {
        let memory = serde_json::json!({
            "rss_mb": 380.0, "rss_peak_mb": 390.0, "uss_mb": 370.0, "swap_mb": 0.0,
            "timeline": [{"ts": 100.0, "rss_mb": 120.0}, {"ts": 130.0, "rss_mb": 360.5}],
            "cuda_summary": "|  PyTorch CUDA memory summary  |\n| Allocated memory |",
        });
        let text = memory_text(&memory);
        assert!(
            text.contains(
                "timeline: RSS 120.0 -> 360.5 MB over the last 30 s (2 rows of python.memory)"
            ),
            "{text}"
        );
        assert!(text.contains("\n    | Allocated memory |\n"), "{text}");
    }

    #[test]
    fn a_native_log_is_summarized_by_its_fatal_error_and_frame() {
        let entry = native_entry(None, FAULTHANDLER);
        assert_eq!(
            entry.summary(),
            "native crash: Fatal Python error: Segmentation fault"
        );
        assert_eq!(entry.location(), "/tmp/t.py:3");
    }

    #[test]
    fn a_native_crash_is_placed_at_the_crashing_threads_own_code() {
        let text = "Fatal Python error: Segmentation fault\n\n\
            Thread 0x01 (most recent call first):\n  File \"/home/u/loader.py\", line 9 in load\n\n\
            Current thread 0x02 (most recent call first):\n\
              File \"/usr/lib/python3.11/ctypes/__init__.py\", line 519 in string_at\n\
              File \"/home/u/train.py\", line 40 in step\n";
        let entry = native_entry(None, text);
        assert_eq!(entry.location(), "/home/u/train.py:40");
        assert_eq!(
            entry.innermost(),
            "/usr/lib/python3.11/ctypes/__init__.py:519"
        );
    }

    #[test]
    fn an_abort_with_the_gil_let_go_is_placed_in_the_main_threads_code() {
        // gloo's C++ exception in a collective: no thread is "Current"; the
        // DataLoader's feeder threads are listed first, the main thread last.
        let text = "Fatal Python error: Aborted\n\n\
            Thread 0x01 (most recent call first):\n\
              File \"/usr/lib/python3.11/threading.py\", line 327 in wait\n\
              File \"/usr/lib/python3.11/multiprocessing/queues.py\", line 231 in _feed\n\n\
            Thread 0x02 (most recent call first):\n\
              File \"/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py\", line 4181 in all_reduce\n\
              File \"/home/u/train.py\", line 24 in <module>\n\n\
            Extension modules: torch._C (total: 1)\n";
        let entry = native_entry(Some(0), text);
        assert_eq!(entry.location(), "/home/u/train.py:24");
        assert_eq!(entry.rank(), Some(0));
    }

    #[test]
    fn a_record_renders_like_a_traceback_with_locals() {
        let record: CrashRecord = serde_json::from_str(
            r#"{"version": 1, "source": "excepthook", "time": 0, "host": "h", "rank": 0, "pid": 1,
                "thread": "MainThread", "exceptions": [
                {"type": "KeyError", "message": "'k'", "frames": [
                  {"func": "f", "file": "t.py", "lineno": 2, "source": "d['k']",
                   "locals": [{"name": "d", "repr": "{}", "type": "dict"}]}]},
                {"type": "ValueError", "message": "bad", "via": "cause", "frames": []}]}"#,
        )
        .unwrap();
        let text = render(1, 1, &record, Path::new("crash.json"));
        assert!(
            text.contains(
                "  File \"t.py\", line 2, in f\n    d['k']\n        d = {}\nKeyError: 'k'\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("direct cause of the following exception:\n\nValueError: bad\n"),
            "{text}"
        );
    }
}
