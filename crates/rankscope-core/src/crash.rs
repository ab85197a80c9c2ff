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
    run.or_else(|| std::env::var_os(RUN_DIR_ENV).filter(|d| !d.is_empty()).map(PathBuf::from))
}

/// Where to look for what processes left: the named run directory, else
/// every job's directory under [`runs_root`], sorted.
pub fn run_dirs(run: Option<PathBuf>) -> Vec<PathBuf> {
    if let Some(dir) = explicit_run_dir(run) {
        return vec![dir];
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(runs_root())
        .map(|read| read.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect())
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
    let job = JOB_ENVS.iter().find_map(|name| set(name)).unwrap_or_else(|| "local".to_string());
    home.join(".local/state/rankscope/runs").join(job)
}

/// The crash record files directly in `dir`, unsorted.
pub fn record_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    files_matching(dir, |name| name.starts_with("crash-") && name.ends_with(".json"))
}

/// The faulthandler logs (`native-<pid>.log`) directly in `dir`, unsorted.
pub fn native_logs(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    files_matching(dir, |name| name.starts_with("native-") && name.ends_with(".log"))
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
    fn native_log_names_carry_the_pid() {
        assert_eq!(native_log_pid(Path::new("/r/native-123.log")), Some(123));
        assert_eq!(native_log_pid(Path::new("/r/native-123-1700000000000.log")), Some(123));
        assert_eq!(native_log_pid(Path::new("/r/other.log")), None);
    }
}
