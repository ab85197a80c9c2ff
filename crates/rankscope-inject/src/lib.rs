//! Makes a running CPython process (3.11 to 3.13) load the rankscope probe.
//!
//! One thread of the target is borrowed with ptrace for three calls:
//! `dlopen(probe library)`, `dlsym(handle, "rankscope_inject_start")`, and
//! that function with the package directory. The function only starts a
//! native thread and returns; that thread asks the interpreter to run the
//! bootstrap at its next safe point (`Py_AddPendingCall`), so no Python code
//! runs while the thread is borrowed, in a signal handler, or with the world
//! stopped. Then the thread gets its registers and stack bytes back.
//!
//! Python 3.14 and later have `sys.remote_exec` (PEP 768) for this; the CLI
//! uses that there and never calls this crate.
//!
//! x86-64 Linux only: the calling convention and registers are those.

mod maps;
mod remote;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use maps::Module;

/// The function the probe library exports for us (`rankscope-probe`).
pub const ENTRY_SYMBOL: &str = "rankscope_inject_start";
/// Exported by every CPython 3.11+ (the interpreter's `PY_VERSION_HEX`).
const VERSION_SYMBOL: &str = "Py_Version";
/// Exported by every CPython with a GIL API: tells a Python from anything else.
const PYTHON_SYMBOL: &str = "PyGILState_Ensure";

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error("no process with PID {0}")]
    NoProcess(u32),
    #[error("process {0} is not a CPython process (no libpython or python executable exporting the C API in its memory)")]
    NotPython(u32),
    #[error("process {pid} runs Python {version}, and inject needs 3.11 or later")]
    TooOld { pid: u32, version: String },
    #[error("process {0} has no C library with dlopen mapped (a static binary?)")]
    NoDlopen(u32),
    #[error("ptrace of process {pid} was refused{}", tracer.map(|t| format!(": process {t} is already tracing it")).unwrap_or_default())]
    Denied { pid: u32, tracer: Option<u32> },
    #[error("process {0} exited during the inject")]
    Exited(u32),
    #[error("process {0} did not answer in time (its thread stayed busy); it was left as it was")]
    Timeout(u32),
    #[error("ptrace on process {pid} failed: {errno}")]
    Ptrace { pid: u32, errno: nix::errno::Errno },
    #[error("a call into process {pid} faulted at {address:#x}; its registers were restored")]
    Faulted { pid: u32, address: u64 },
    #[error("the target could not load {library}: {message}")]
    Dlopen { library: PathBuf, message: String },
    #[error(
        "{library} does not export {ENTRY_SYMBOL}: not a rankscope probe library of this version"
    )]
    NoEntry { library: PathBuf },
    #[error("the probe library refused to start its bootstrap thread (code {0})")]
    EntryFailed(u64),
    #[error("cannot read {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("cannot parse {path}: {message}")]
    Elf { path: PathBuf, message: String },
}

/// The interpreter found in a process.
#[derive(Debug, Clone)]
pub struct PythonInfo {
    /// "3.12.1"
    pub version: String,
    pub hex: u32,
    /// The libpython or executable that holds the interpreter.
    pub module: PathBuf,
}

impl PythonInfo {
    pub fn minor(&self) -> (u32, u32) {
        (self.hex >> 24, (self.hex >> 16) & 0xff)
    }
}

/// Finds the interpreter in `pid` and reads its version from its memory.
pub fn python_in(pid: u32) -> Result<PythonInfo, InjectError> {
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(InjectError::NoProcess(pid));
    }
    let modules = maps::modules(pid)?;
    // libpython first (a shared build), then the executable (a static one).
    let mut candidates: Vec<&Module> = modules
        .iter()
        .filter(|m| m.file_name().starts_with("libpython3"))
        .collect();
    candidates.extend(modules.iter().take(1));
    for module in candidates {
        let Ok(symbols) = module.symbols(pid, &[PYTHON_SYMBOL, VERSION_SYMBOL]) else {
            continue;
        };
        if !symbols.contains_key(PYTHON_SYMBOL) {
            continue;
        }
        let Some(&address) = symbols.get(VERSION_SYMBOL) else {
            return Err(InjectError::TooOld {
                pid,
                version: "older than 3.11".into(),
            });
        };
        let hex = read_u32(pid, address)?;
        let version = format!("{}.{}.{}", hex >> 24, (hex >> 16) & 0xff, (hex >> 8) & 0xff);
        return Ok(PythonInfo {
            version,
            hex,
            module: module.path.clone(),
        });
    }
    Err(InjectError::NotPython(pid))
}

fn read_u32(pid: u32, address: u64) -> Result<u32, InjectError> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 4];
    std::fs::File::open(format!("/proc/{pid}/mem"))
        .and_then(|f| f.read_exact_at(&mut buf, address))
        .map_err(|e| InjectError::Io {
            what: format!("/proc/{pid}/mem"),
            source: e,
        })?;
    Ok(u32::from_ne_bytes(buf))
}

#[derive(Debug, Clone)]
pub struct Timings {
    pub borrowed_thread: i32,
    /// How long the thread was held (stopped or running our calls).
    pub held: Duration,
}

/// Loads `library` into `pid` and calls its entry with `package_dir`, the
/// directory the bootstrap puts first on `sys.path` to import `rankscope`.
pub fn load_probe(
    pid: u32,
    library: &Path,
    package_dir: &Path,
    timeout: Duration,
) -> Result<Timings, InjectError> {
    let modules = maps::modules(pid)?;
    let libc = maps::libc(&modules).ok_or(InjectError::NoDlopen(pid))?;
    let mut symbols = libc.symbols(pid, &["dlopen", "dlsym", "dlerror"])?;
    if !symbols.contains_key("dlopen") {
        if let Some(libdl) = maps::libdl(&modules) {
            symbols.extend(libdl.symbols(pid, &["dlopen", "dlsym", "dlerror"])?);
        }
    }
    let (Some(&dlopen), Some(&dlsym)) = (symbols.get("dlopen"), symbols.get("dlsym")) else {
        return Err(InjectError::NoDlopen(pid));
    };
    let dlerror = symbols.get("dlerror").copied();

    let tid = remote::choose_thread(pid, Duration::from_millis(100))?;
    let started = Instant::now();
    let mut thread = remote::Hijack::seize(pid, tid, timeout)?;
    let c_string = |p: &Path| {
        let mut bytes = p.as_os_str().as_encoded_bytes().to_vec();
        bytes.push(0);
        bytes
    };
    let library_at = thread.push_bytes(&c_string(library))?;
    let entry_name_at = thread.push_bytes(format!("{ENTRY_SYMBOL}\0").as_bytes())?;
    let package_at = thread.push_bytes(&c_string(package_dir))?;

    let handle = thread.call(
        dlopen,
        &[library_at, (libc::RTLD_NOW | libc::RTLD_LOCAL) as u64],
        timeout,
    )?;
    if handle == 0 {
        let message = match dlerror {
            Some(f) => match thread.call(f, &[], timeout)? {
                0 => "dlopen failed".to_string(),
                text => thread.read_c_string(text, 1024),
            },
            None => "dlopen failed".to_string(),
        };
        return Err(InjectError::Dlopen {
            library: library.to_path_buf(),
            message,
        });
    }
    let entry = thread.call(dlsym, &[handle, entry_name_at], timeout)?;
    if entry == 0 {
        return Err(InjectError::NoEntry {
            library: library.to_path_buf(),
        });
    }
    let code = thread.call(entry, &[package_at], timeout)? as u32 as u64;
    thread.release()?;
    if code != 0 {
        return Err(InjectError::EntryFailed(code));
    }
    Ok(Timings {
        borrowed_thread: tid,
        held: started.elapsed(),
    })
}
