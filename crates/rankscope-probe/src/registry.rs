//! The job's registry: one file per rank in `<run dir>/ranks/`.
//!
//! A rank writes its entry when its probe starts and marks it when the
//! process ends, "crashed" if it recorded a crash, else "exited". A rank
//! killed outright (SIGKILL, the OOM killer) leaves its entry saying
//! "running" with a PID that is gone: the CLI reports it as dead rather than
//! missing. With a run directory on a shared filesystem the same files
//! describe a job across machines.
//!
//! This lives in Rust, not in the probe's Python, so that starting a probe
//! imports nothing into the program (`json` would pull in `re` and more), and
//! so that `GET /v1/job` is answered without the GIL.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use rankscope_core::crash;
use serde_json::{json, Value};

struct Entry {
    path: PathBuf,
    socket: String,
}

/// Where this process's entry is; the endpoint is kept for a process that
/// joins a job late (torch.distributed gives it a world size after start).
static ENTRY: Mutex<Option<Entry>> = Mutex::new(None);
static ENDPOINT: Mutex<Option<(String, Option<String>)>> = Mutex::new(None);
static CRASHED: AtomicBool = AtomicBool::new(false);
/// The entry `leave` marked, for its exit code, written as the process
/// exits (`exit_code`).
static LEFT: Mutex<Option<PathBuf>> = Mutex::new(None);
/// The process that registered the exit hook: a forked child inherits the
/// hook, and its exit is not this rank's.
static HOOKED_BY: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

#[cfg(target_env = "gnu")]
extern "C" {
    /// glibc's: like `atexit`, with the status given to `exit()`.
    fn on_exit(
        function: extern "C" fn(libc::c_int, *mut libc::c_void),
        arg: *mut libc::c_void,
    ) -> libc::c_int;
}

/// Called by glibc's `exit()` with its status, after Python's own exit
/// handlers (where `leave` ran): the entry gets the exit code, so that a
/// rank that ended with `sys.exit(3)`, which records no crash, still says
/// how it ended. `os._exit` and signals pass it by (a signal's death shows
/// as "dead").
#[cfg(target_env = "gnu")]
extern "C" fn exit_code_hook(status: libc::c_int, _: *mut libc::c_void) {
    let _ = std::panic::catch_unwind(|| {
        if HOOKED_BY.load(Ordering::Relaxed) != std::process::id() {
            return;
        }
        let path = LEFT
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .or_else(|| {
                ENTRY
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .map(|e| e.path.clone())
            });
        let Some(path) = path else { return };
        let Some(mut value) = read(&path) else { return };
        if value["pid"].as_u64() != Some(u64::from(std::process::id())) {
            return; // another process's entry by now (a restarted rank)
        }
        value["exit_code"] = json!(status);
        let _ = write(&path, &value);
    });
}

/// Registers `exit_code_hook`, once a process.
fn hook_exit() {
    #[cfg(target_env = "gnu")]
    {
        let pid = std::process::id();
        if HOOKED_BY.swap(pid, Ordering::Relaxed) != pid {
            // SAFETY: a plain function with no argument to keep alive.
            unsafe {
                on_exit(exit_code_hook, std::ptr::null_mut());
            }
        }
    }
}

fn ranks_dir() -> PathBuf {
    crash::run_dir().join("ranks")
}

fn entry_path(meta: &Value) -> PathBuf {
    ranks_dir().join(format!("rank{}-pid{}.json", meta["rank"], meta["pid"]))
}

/// Temp file then rename, mode 0600: with a TCP endpoint the entry carries its token.
fn write(path: &Path, entry: &Value) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(entry.to_string().as_bytes())?;
    drop(file);
    std::fs::rename(&tmp, path)
}

fn read(path: &Path) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Adds this process to its job's registry when it is a rank of one.
pub fn register(meta_json: &str, socket: &str, token_file: Option<&str>) -> std::io::Result<()> {
    *ENDPOINT.lock().unwrap_or_else(|e| e.into_inner()) =
        Some((socket.to_string(), token_file.map(str::to_string)));
    let meta: Value = serde_json::from_str(meta_json)?;
    let in_job = meta["job_id"].is_string() || meta["world_size"].as_i64().unwrap_or(1) > 1;
    // A launcher keeps its job id (a scheduler's), but is none of the
    // job's ranks: listed as one, it was "rank 0" of a job of its own.
    if !in_job || crate::meta::BYSTANDER.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    let mut entry = meta.clone();
    entry["socket"] = json!(socket);
    entry["state"] = json!("running");
    if meta["tcp"].is_string() {
        if let Some(token) = token_file.and_then(|f| std::fs::read_to_string(f).ok()) {
            entry["token"] = json!(token.trim());
        }
    }
    let dir = ranks_dir();
    create_private_dir(&dir)?;
    let path = entry_path(&meta);
    write(&path, &entry)?;
    *ENTRY.lock().unwrap_or_else(|e| e.into_inner()) = Some(Entry {
        path,
        socket: socket.to_string(),
    });
    hook_exit();
    Ok(())
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// New metadata (torch.distributed assigned the rank): the entry moves to
/// the file of its new rank, or is written now if a world size above 1 makes
/// this process a rank of a job only now.
pub fn update(meta_json: &str) -> std::io::Result<()> {
    let mut guard = ENTRY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(current) = guard.as_mut() else {
        drop(guard);
        let endpoint = ENDPOINT.lock().unwrap_or_else(|e| e.into_inner()).clone();
        return match endpoint {
            Some((socket, token_file)) => register(meta_json, &socket, token_file.as_deref()),
            None => Ok(()),
        };
    };
    let meta: Value = serde_json::from_str(meta_json)?;
    let mut entry = read(&current.path).unwrap_or_else(|| {
        let mut fresh = meta.clone();
        fresh["socket"] = json!(current.socket);
        fresh["state"] = json!("running");
        fresh
    });
    entry["rank"] = meta["rank"].clone();
    entry["world_size"] = meta["world_size"].clone();
    let path = entry_path(&meta);
    write(&path, &entry)?;
    if path != current.path {
        let _ = std::fs::remove_file(&current.path);
    }
    current.path = path;
    Ok(())
}

/// Remembers that this process recorded a crash, for [`leave`].
pub fn mark_crashed() {
    CRASHED.store(true, Ordering::Relaxed);
}

/// Marks this rank's entry as ended (at stop, or at exit).
pub fn leave() {
    let Some(entry) = ENTRY.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    let Some(mut value) = read(&entry.path) else {
        return;
    };
    let state = if CRASHED.load(Ordering::Relaxed) {
        "crashed"
    } else {
        "exited"
    };
    value["state"] = json!(state);
    value["ended_at"] = json!(rankscope_core::host::now_seconds());
    let _ = write(&entry.path, &value);
    *LEFT.lock().unwrap_or_else(|e| e.into_inner()) = Some(entry.path);
}

/// The registry of this process's job (`GET /v1/job`): what a CLI that
/// reached this rank by address needs to reach the others.
pub fn job_entries() -> String {
    let Some(path) = ENTRY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(|e| e.path.clone())
    else {
        return "[]".to_string();
    };
    let job_id = read(&path)
        .map(|e| e["job_id"].clone())
        .unwrap_or(Value::Null);
    let mut names: Vec<PathBuf> = std::fs::read_dir(ranks_dir())
        .map(|dir| {
            dir.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    let entries: Vec<Value> = names
        .iter()
        .filter_map(|p| read(p))
        .filter(|e| e["job_id"] == job_id)
        .collect();
    Value::Array(entries).to_string()
}

/// In a forked child the entry is the parent's.
pub fn forget_after_fork() {
    if let Ok(mut entry) = ENTRY.try_lock() {
        *entry = None;
    }
}
