//! Reading stacks from outside the target, with py-spy's library.
//!
//! No code runs in the target: its memory is read with `process_vm_readv`
//! while it is briefly paused. This works for processes that never loaded a
//! probe, and for probed ones whose probe cannot answer because a thread holds
//! the GIL in native code.

use std::collections::HashMap;
use std::io;
use std::path::Path;

use anyhow::Result;
use py_spy::config::LockingStrategy;
use py_spy::{Config, PythonSpy};
use rankscope_core::protocol::{Frame, Local, ProcessMeta, StacksReply, ThreadStack};
// The probe's own threads (one waiting for the GIL shows up as a Python
// thread) are not the user's business.
use rankscope_profile::is_probe_thread;

use crate::hint::Hinted;

pub fn permission_hint() -> String {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").unwrap_or_default();
    match scope.trim() {
        "1" => "Yama's ptrace_scope is 1: run as root, or `sudo sysctl kernel.yama.ptrace_scope=0`"
            .into(),
        "2" | "3" => format!(
            "Yama's ptrace_scope is {}: only root (2) or nobody (3) may read other processes",
            scope.trim()
        ),
        _ => "run as the target's user or as root; in a container, add the SYS_PTRACE capability \
              (docker run --cap-add SYS_PTRACE)"
            .into(),
    }
}

fn explain(pid: u32, err: anyhow::Error) -> anyhow::Error {
    let denied = err.chain().any(|cause| {
        cause
            .downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::PermissionDenied)
    }) || format!("{err:#}").contains("Permission denied")
        || format!("{err:#}").contains("Operation not permitted");
    if denied {
        return Hinted::new(
            format!("not allowed to read the memory of PID {pid}"),
            permission_hint(),
        )
        .into();
    }
    let text = rankscope_profile::reasons(err.as_ref());
    if text.contains("python") || text.contains("Python") {
        return Hinted::new(
            format!("cannot read Python stacks from PID {pid}: {text}"),
            "is it a CPython process? rankscope reads CPython 3.11 to 3.13",
        )
        .into();
    }
    Hinted::new(
        format!("cannot read PID {pid} from outside: {text}"),
        "check that the process still runs",
    )
    .into()
}

/// Whether this build can unwind native stacks (py-spy's `unwind` feature,
/// which links libunwind).
pub const NATIVE_SUPPORTED: bool = cfg!(feature = "native");

/// An error with what to install when this build cannot unwind native stacks.
pub fn require_native() -> Result<()> {
    if NATIVE_SUPPORTED {
        return Ok(());
    }
    Err(Hinted::new(
        "this rankscope was built without native unwinding",
        "install libunwind-dev (apt-get install libunwind-dev liblzma-dev) and reinstall rankscope with `pip install .`",
    )
    .into())
}

/// Whether `file` is a module of the rankscope package as the target
/// imported it: under a `rankscope` directory that holds `_probe` (looked up
/// through the target's root, then here; answers cached per package).
/// `demo.py` is the sample program `rankscope demo` runs, the user's code there.
fn is_own_file(pid: u32, file: &str, packages: &mut HashMap<String, bool>) -> bool {
    let Some(at) = file.rfind("/rankscope/") else {
        return false;
    };
    match &file[at..] {
        "/rankscope/demo.py" => return false,
        own if own.starts_with("/rankscope/_probe/") => return true,
        _ => {}
    }
    let package = &file[..at + "/rankscope".len()];
    *packages.entry(package.to_string()).or_insert_with(|| {
        [
            format!("/proc/{pid}/root{package}/_probe"),
            format!("{package}/_probe"),
        ]
        .iter()
        .any(|p| Path::new(p).is_dir())
    })
}

/// Leaves out rankscope's own Python frames, as the probe does: the depth
/// of what is left is the number `--frame` takes.
fn hide_own_frames(pid: u32, threads: &mut [ThreadStack]) {
    let mut packages = HashMap::new();
    for thread in threads {
        thread
            .frames
            .retain(|f| f.is_native() || !is_own_file(pid, &f.file, &mut packages));
    }
}

/// Every thread's stack, innermost frame first; `python_version` is filled
/// in. With `native`, C/C++/Rust frames are merged in where the interpreter
/// called into them (py-spy matches Python frames to the eval-loop frames).
/// rankscope's own frames are left out unless `all_frames`.
pub fn read_stacks(
    pid: u32,
    with_locals: bool,
    native: bool,
    all_frames: bool,
) -> Result<(StacksReply, String)> {
    if native {
        require_native()?;
    }
    let read = |blocking| {
        let config = Config {
            native,
            blocking,
            include_idle: true,
            collect_thread_names: true,
            dump_locals: u64::from(with_locals),
            full_filenames: true,
            ..Config::default()
        };
        let mut spy = PythonSpy::new(pid as py_spy::Pid, &config)?;
        let traces = spy.get_stack_traces()?;
        anyhow::Ok((traces, spy.version.to_string()))
    };
    let say_stopped = || {
        eprintln!(
            "note: PID {pid} is stopped (SIGSTOP, Ctrl-Z or a debugger): it runs nothing until continued (`kill -CONT {pid}`)"
        )
    };
    // A stopped process cannot be paused again (ptrace's wait sees its
    // stop instead), and it cannot change its stacks under the read.
    let read = if stopped(pid) {
        if native {
            return Err(stopped_native(pid).into());
        }
        say_stopped();
        read(LockingStrategy::NonBlocking)
    } else {
        match read(LockingStrategy::Lock) {
            // A stop signal still on its way when the state was read.
            Err(_) if stopped(pid) => {
                if native {
                    return Err(stopped_native(pid).into());
                }
                say_stopped();
                read(LockingStrategy::NonBlocking)
            }
            read => read,
        }
    };
    let (traces, version) = read.map_err(|e| explain(pid, e))?;
    let mut threads: Vec<ThreadStack> = traces
        .into_iter()
        .filter(|trace| !is_probe_thread(pid, trace.os_thread_id))
        .map(|trace| ThreadStack {
            thread_id: trace.thread_id,
            native_id: trace.os_thread_id,
            name: trace.thread_name.unwrap_or_default(),
            daemon: false,
            // The main thread's kernel id is the PID.
            is_main: trace.os_thread_id == Some(u64::from(pid)),
            holds_gil: Some(trace.owns_gil),
            frames: trace
                .frames
                .into_iter()
                .map(|f| Frame {
                    func: if f.module.is_some() {
                        demangle(&f.name)
                    } else {
                        f.name.clone()
                    },
                    qualname: if f.module.is_some() {
                        demangle(&f.name)
                    } else {
                        f.name
                    },
                    file: f.filename,
                    lineno: i64::from(f.line),
                    locals: f.locals.map(|locals| {
                        locals
                            .into_iter()
                            .map(|l| Local {
                                name: l.name,
                                repr: l.repr.unwrap_or_else(|| "?".into()),
                                type_name: String::new(),
                            })
                            .collect()
                    }),
                    native_module: f.module,
                })
                .collect(),
        })
        .collect();
    if !all_frames {
        hide_own_frames(pid, &mut threads);
    }
    threads.sort_by_key(|t| (!t.is_main, t.name.clone(), t.thread_id));
    Ok((
        StacksReply {
            taken_at: rankscope_core::host::now_seconds(),
            threads,
            counts: None,
        },
        version,
    ))
}

/// Whether the process is stopped: state `T` (a stop signal) or `t` (a
/// debugger's stop) in `/proc/PID/stat`.
pub fn stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which may hold spaces and parentheses.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some("T" | "t"))
}

/// Native frames are unwound through ptrace, which a stopped process's
/// group-stop answers in its place.
pub fn stopped_native(pid: u32) -> Hinted {
    Hinted::new(
        format!("PID {pid} is stopped, and native frames cannot be read from a stopped process"),
        format!("leave out --native, or continue it first (`kill -CONT {pid}`)"),
    )
}

/// py-spy demangles C++ (which also turns Rust's legacy `_ZN` symbols into
/// `a::b::h<hash>`); Rust v0 symbols (`_R...`) are left to rustc-demangle,
/// and the legacy hash suffix is dropped.
pub fn demangle(name: &str) -> String {
    if let Ok(symbol) = rustc_demangle::try_demangle(name) {
        return format!("{symbol:#}");
    }
    match name.rsplit_once("::h") {
        Some((path, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            path.to_string()
        }
        _ => name.to_string(),
    }
}

/// What can be said about a process without a probe, for the `bt` header.
/// A process's environment as it started (`/proc/PID/environ`; what it set
/// itself later is not there), the variables that are UTF-8; empty when
/// the file cannot be read (another user's process, or gone).
pub fn initial_environ(pid: u32) -> HashMap<String, String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    raw.split(|&b| b == 0)
        .filter_map(|entry| std::str::from_utf8(entry).ok()?.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn meta_from_proc(pid: u32, python_version: String) -> ProcessMeta {
    let cmdline: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|&b| b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    let env_rank = initial_environ(pid)
        .get("RANK")
        .and_then(|v| v.parse().ok());
    ProcessMeta {
        pid,
        ppid: 0,
        host: String::new(),
        rank: env_rank.unwrap_or(0),
        local_rank: 0,
        world_size: 1,
        cmdline,
        exe: String::new(),
        cwd: String::new(),
        python_version,
        started_at: 0.0,
        process_started_at: rankscope_core::host::process_started_at(pid),
        rankscope_version: String::new(),
        protocol: rankscope_core::PROTOCOL_VERSION,
        tcp: None,
        job_id: None,
        step_address: None,
    }
}

#[cfg(test)]
mod tests {
    use super::{demangle, is_own_file};

    #[test]
    fn rankscope_files_are_told_from_the_users() {
        let mut cache = std::collections::HashMap::new();
        let pid = std::process::id();
        assert!(is_own_file(
            pid,
            "/venv/lib/python3.11/site-packages/rankscope/_probe/torch_rank.py",
            &mut cache
        ));
        // A package directory without _probe is someone else's `rankscope`.
        assert!(!is_own_file(
            pid,
            "/nonexistent/rankscope/__init__.py",
            &mut cache
        ));
        assert!(!is_own_file(pid, "/home/me/train.py", &mut cache));
        assert!(!is_own_file(
            pid,
            "/venv/lib/python3.11/site-packages/rankscope/demo.py",
            &mut cache
        ));
        let dir = std::env::temp_dir().join(format!("rs-own-{pid}/rankscope"));
        std::fs::create_dir_all(dir.join("_probe")).unwrap();
        assert!(is_own_file(
            pid,
            &format!("{}/__init__.py", dir.display()),
            &mut cache
        ));
        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }

    #[test]
    fn rust_symbols_are_demangled_without_their_hash() {
        assert_eq!(
            demangle("_ZN3std2rt10lang_start17h0123456789abcdefE"),
            "std::rt::lang_start"
        );
        assert_eq!(
            demangle("std::rt::lang_start::h0123456789abcdef"),
            "std::rt::lang_start"
        );
        assert_eq!(
            demangle("_RNvCs15kBYyAo9fc_7mycrate7example"),
            "mycrate::example"
        );
    }

    #[test]
    fn other_names_are_kept() {
        assert_eq!(demangle("PyObject_Call"), "PyObject_Call");
        assert_eq!(
            demangle("at::native::add_out(at::Tensor const&)"),
            "at::native::add_out(at::Tensor const&)"
        );
    }
}
