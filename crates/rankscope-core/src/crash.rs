//! Crash records: what the probe writes to the run directory when an
//! exception goes uncaught (`python/rankscope/_probe/crashes.py`), and where
//! that directory is. The two sides must agree on both.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::protocol::Local;

/// Overrides the run directory.
pub const RUN_DIR_ENV: &str = "RANKSCOPE_RUN_DIR";
/// Environment variables that name the job, first one set wins ("local" if none).
pub const JOB_ENVS: [&str; 2] = ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CrashFrame {
    pub func: String,
    #[serde(default)]
    pub qualname: String,
    pub file: String,
    pub lineno: i64,
    /// The line's text (stripped), when the file could be read.
    #[serde(default)]
    pub source: Option<String>,
    #[serde(default)]
    pub locals: Vec<Local>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CrashException {
    #[serde(rename = "type")]
    pub type_name: String,
    pub message: String,
    /// How this exception follows the one before it in the chain: "cause"
    /// (`raise ... from`) or "context" (raised while handling it).
    #[serde(default)]
    pub via: Option<String>,
    /// Outermost first, where it was raised last.
    #[serde(default)]
    pub frames: Vec<CrashFrame>,
    /// Outer frames left out of a very deep stack (the innermost are kept).
    #[serde(default)]
    pub frames_omitted: usize,
}

/// One `crash-<epoch_ms>-rank<r>-pid<p>.json` file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CrashRecord {
    pub version: u32,
    /// "excepthook", "threading.excepthook" or "on_error".
    pub source: String,
    /// Seconds since the epoch.
    pub time: f64,
    pub host: String,
    /// None for a process outside the ranks: the torchrun launcher.
    #[serde(default)]
    pub rank: Option<i64>,
    pub pid: u32,
    pub thread: String,
    #[serde(default)]
    pub argv: Vec<String>,
    #[serde(default)]
    pub python_version: String,
    /// In the order Python prints them: the exception that went uncaught is last.
    pub exceptions: Vec<CrashException>,
    /// Written by a job's launcher (torchrun's own process), not by the
    /// user's program. Absent in records of older probes: see
    /// [`CrashRecord::is_launcher`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<bool>,
    /// The process's memory at the crash (`rss_mb`, `uss_mb`, ...); for an
    /// out-of-memory error also `cuda` and `largest_tensors`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<serde_json::Value>,
}

/// Launchers' own processes: torchrun's console script, and the modules
/// `python -m` runs for it (argv[0] is then the module's file).
const LAUNCHER_SCRIPTS: [&str; 3] = [
    "torchrun",
    "torch/distributed/run.py",
    "torch/distributed/launch.py",
];

/// Whether `argv` is a job launcher's command line (torchrun and kin).
pub fn launcher_argv(argv: &[String]) -> bool {
    let Some(first) = argv.first() else {
        return false;
    };
    LAUNCHER_SCRIPTS
        .iter()
        .any(|script| first == script || first.ends_with(&format!("/{script}")))
}

/// Whether a frame's file is the user's own code: not an installed package
/// (site-packages, dist-packages), not the standard library (`lib/pythonX.Y/`),
/// not one of rankscope's own files, not a frozen module. Decided from the
/// path alone, so records of any age, read on any machine, answer the same.
pub fn is_user_file(file: &str) -> bool {
    if file.starts_with("<frozen ") {
        return false;
    }
    if file.contains("/site-packages/") || file.contains("/dist-packages/") {
        return false;
    }
    if file.contains("/rankscope/_probe/") || file.ends_with("/rankscope/__init__.py") {
        return false;
    }
    // The standard library: <prefix>/lib/pythonX.Y/<module>, on every POSIX layout.
    let mut rest = file;
    while let Some(at) = rest.find("/lib/python3.") {
        let tail = &rest[at + "/lib/python3.".len()..];
        let digits = tail.chars().take_while(char::is_ascii_digit).count();
        if digits > 0 && tail[digits..].starts_with('/') {
            return false;
        }
        rest = tail;
    }
    true
}

impl CrashRecord {
    /// The exception that went uncaught.
    pub fn last_exception(&self) -> Option<&CrashException> {
        self.exceptions.last()
    }

    /// Where the uncaught exception was raised: its innermost frame.
    pub fn location(&self) -> Option<&CrashFrame> {
        self.last_exception().and_then(|e| e.frames.last())
    }

    /// Where the user's eye looks: the innermost frame of the uncaught
    /// exception that is in the user's own code ([`is_user_file`]), else the
    /// innermost frame.
    pub fn user_location(&self) -> Option<&CrashFrame> {
        let frames = &self.last_exception()?.frames;
        frames
            .iter()
            .rev()
            .find(|f| is_user_file(&f.file))
            .or_else(|| frames.last())
    }

    /// Written by a job's launcher, not by a rank of the user's program.
    /// Records from probes older than the `launcher` field: no rank (those
    /// probes wrote none only for the launcher) and a launcher's argv.
    pub fn is_launcher(&self) -> bool {
        self.launcher
            .unwrap_or_else(|| self.rank.is_none() && launcher_argv(&self.argv))
    }
}

fn home() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(h) if !h.is_empty() => PathBuf::from(h),
        _ => PathBuf::from("/"),
    }
}

/// `~/.local/state/rankscope/runs`: every job's run directory lives here
/// unless RANKSCOPE_RUN_DIR says otherwise.
pub fn runs_root() -> PathBuf {
    home().join(".local/state/rankscope/runs")
}

/// The run directory the user named (`--run`, else RANKSCOPE_RUN_DIR), if any.
pub fn explicit_run_dir(run: Option<PathBuf>) -> Option<PathBuf> {
    run.or_else(|| {
        std::env::var_os(RUN_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    })
}

/// Where to look for what processes left: the named run directory, else
/// every job's directory under [`runs_root`], sorted.
pub fn run_dirs(run: Option<PathBuf>) -> Vec<PathBuf> {
    if let Some(dir) = explicit_run_dir(run) {
        return vec![dir];
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(runs_root())
        .map(|read| {
            read.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

/// The job's name: TORCHELASTIC_RUN_ID, else SLURM_JOB_ID, else "local".
pub fn job_name() -> String {
    JOB_ENVS
        .iter()
        .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "local".to_string())
}

/// RANKSCOPE_RUN_DIR if set, else `~/.local/state/rankscope/runs/<job>`.
pub fn run_dir() -> PathBuf {
    run_dir_of(|name| std::env::var(name).ok())
}

/// The run directory of a process whose environment `lookup` reads (another
/// process's, as its probe reports it).
pub fn run_dir_of(lookup: impl Fn(&str) -> Option<String>) -> PathBuf {
    let set = |name: &str| lookup(name).filter(|v| !v.is_empty());
    if let Some(dir) = set(RUN_DIR_ENV) {
        return PathBuf::from(dir);
    }
    let home = set("HOME").map(PathBuf::from).unwrap_or_else(home);
    let job = JOB_ENVS
        .iter()
        .find_map(|name| set(name))
        .unwrap_or_else(|| "local".to_string());
    home.join(".local/state/rankscope/runs").join(job)
}

/// The crash record files directly in `dir`, unsorted.
pub fn record_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    files_matching(dir, |name| {
        name.starts_with("crash-") && name.ends_with(".json")
    })
}

/// The faulthandler logs (`native-<pid>.log`) directly in `dir`, unsorted.
pub fn native_logs(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    files_matching(dir, |name| {
        name.starts_with("native-") && name.ends_with(".log")
    })
}

fn files_matching(dir: &Path, wanted: impl Fn(&str) -> bool) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if let Some(name) = name.to_str() {
            if wanted(name) && entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
                out.push(entry.path());
            }
        }
    }
    Ok(out)
}

/// The PID in `native-<pid>.log` or `native-<pid>-<ms>.log`.
pub fn native_log_pid(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("native-")?.strip_suffix(".log")?;
    rest.split('-').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORD: &str = r#"{"version": 1, "source": "excepthook", "time": 1700000000.5,
        "host": "h", "rank": 3, "pid": 42, "thread": "MainThread", "argv": ["t.py"],
        "python_version": "3.11.7", "exceptions": [
          {"type": "KeyError", "message": "'k'", "via": null, "frames": [
            {"func": "inner", "qualname": "inner", "file": "t.py", "lineno": 7, "source": "{}['k']",
             "locals": [{"name": "x", "repr": "[1, 2]", "type": "list"}]}]},
          {"type": "ValueError", "message": "bad", "via": "cause", "frames": [
            {"func": "<module>", "file": "t.py", "lineno": 14, "source": null, "locals": []},
            {"func": "inner", "file": "t.py", "lineno": 9}]}]}"#;

    #[test]
    fn a_record_written_by_the_probe_parses() {
        let record: CrashRecord = serde_json::from_str(RECORD).unwrap();
        assert_eq!(record.rank, Some(3));
        assert_eq!(record.last_exception().unwrap().type_name, "ValueError");
        assert_eq!(record.location().unwrap().lineno, 9);
        assert_eq!(record.exceptions[0].frames[0].locals[0].repr, "[1, 2]");
    }

    #[test]
    fn the_users_frame_is_the_innermost_outside_libraries() {
        for library in [
            "/usr/lib/python3.11/json/decoder.py",
            "/home/u/.pyenv/versions/3.12.1/lib/python3.12/threading.py",
            "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py",
            "/usr/lib/python3/dist-packages/numpy/core/fromnumeric.py",
            "<frozen importlib._bootstrap>",
            "/venv/lib/python3.11/site-packages/rankscope/_probe/torch_rank.py",
            "/src/rankscope/python/rankscope/_probe/torch_rank.py",
        ] {
            assert!(!is_user_file(library), "{library}");
        }
        for user in [
            "/home/u/train.py",
            "/home/u/lib/python3x/mine.py",
            "/srv/lib/python3.11x/a.py",
            "t.py",
            "<stdin>",
        ] {
            assert!(is_user_file(user), "{user}");
        }
        let mut record: CrashRecord = serde_json::from_str(RECORD).unwrap();
        record.exceptions[1].frames.push(CrashFrame {
            func: "decode".into(),
            qualname: "JSONDecoder.decode".into(),
            file: "/usr/lib/python3.11/json/decoder.py".into(),
            lineno: 337,
            source: None,
            locals: Vec::new(),
        });
        assert_eq!(record.location().unwrap().lineno, 337);
        assert_eq!(record.user_location().unwrap().lineno, 9);
    }

    #[test]
    fn launcher_records_are_told_by_their_field_else_by_rank_and_argv() {
        let mut record: CrashRecord = serde_json::from_str(RECORD).unwrap();
        assert!(!record.is_launcher());
        record.rank = None;
        record.argv = vec![
            "/venv/bin/torchrun".into(),
            "--nproc-per-node".into(),
            "2".into(),
            "train.py".into(),
        ];
        assert!(record.is_launcher());
        record.argv[0] = "/venv/lib/python3.11/site-packages/torch/distributed/run.py".into();
        assert!(record.is_launcher());
        record.launcher = Some(false);
        assert!(!record.is_launcher());
        record.launcher = None;
        record.rank = Some(0);
        assert!(!record.is_launcher(), "a rank is never the launcher");
        record.rank = None;
        record.argv = vec!["train.py".into()];
        assert!(!record.is_launcher());
    }

    #[test]
    fn native_log_names_carry_the_pid() {
        assert_eq!(native_log_pid(Path::new("/r/native-123.log")), Some(123));
        assert_eq!(
            native_log_pid(Path::new("/r/native-123-1700000000000.log")),
            Some(123)
        );
        assert_eq!(native_log_pid(Path::new("/r/other.log")), None);
    }
}
