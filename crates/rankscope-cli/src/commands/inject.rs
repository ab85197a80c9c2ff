//! `rankscope inject PID`: start the probe inside a Python process that was
//! started without it.
//!
//! The target's environment need not have rankscope: the package installed
//! with this CLI is offered to it through a private directory holding only
//! a link to the `rankscope` package, put first on the target's `sys.path`
//! for the import and taken off again. Before 3.14 the probe library is
//! loaded with ptrace (crate `rankscope-inject`); from 3.14 on, CPython's own
//! `sys.remote_exec` runs the same bootstrap.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use rankscope_core::paths;
use rankscope_inject::InjectError;

use crate::client::Probe;
use crate::hint::Hinted;

pub fn run(pid: u32, timeout: f64) -> Result<u8> {
    let started = Instant::now();
    let timeout = Duration::from_secs_f64(timeout.max(0.1));
    if let Some(probe) = Probe::find(pid)? {
        if probe.meta(Duration::from_secs(1)).is_ok() {
            println!("process {pid} already has a rankscope probe; nothing to do");
            return Ok(0);
        }
    }
    let python = rankscope_inject::python_in(pid).map_err(|e| explain(pid, e))?;
    let package = package_dir()?;
    let stage = stage(&package)?;
    let library = native_library(&stage.join("rankscope"))?;
    let dir = paths::endpoint_dir();
    let _ = std::fs::remove_file(paths::inject_error_path(&dir, pid));

    if python.minor() >= (3, 14) {
        remote_exec(pid, &stage)?;
    } else {
        rankscope_inject::load_probe(pid, &library, &stage, timeout).map_err(|e| explain(pid, e))?;
    }
    wait_until_ready(pid, &dir, started + timeout)?;
    println!(
        "probe started in process {pid} (Python {}) in {} ms; try `rankscope {pid} bt`",
        python.version,
        started.elapsed().as_millis()
    );
    Ok(0)
}

/// The installed `rankscope` package: `RANKSCOPE_PACKAGE_DIR`, else the
/// site-packages beside this executable (pip puts both in one prefix).
fn package_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("RANKSCOPE_PACKAGE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    let prefix = exe.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_default();
    for lib in ["lib", "lib64"] {
        let Ok(entries) = std::fs::read_dir(prefix.join(lib)) else { continue };
        for entry in entries.flatten() {
            let candidate = entry.path().join("site-packages").join("rankscope");
            if candidate.join("__init__.py").is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(Hinted::new(
        format!("cannot find the rankscope package installed with {}", exe.display()),
        "install with `pip install .` (the CLI and the package go in together), or set RANKSCOPE_PACKAGE_DIR to the `rankscope` package directory",
    )
    .into())
}

/// A private directory whose entries are `rankscope`, a link to `package`,
/// and the package's one dependency (`bytecode`, for breakpoints on 3.11)
/// when it sits beside it. Private, since the target will run the code found
/// there.
fn stage(package: &Path) -> Result<PathBuf> {
    let dir = paths::endpoint_dir();
    paths::ensure_private_dir(&dir)?;
    let stage = dir.join(format!("inject-{:016x}", fnv1a(package.as_os_str().as_encoded_bytes())));
    std::fs::create_dir_all(&stage)?;
    link_into(&stage, "rankscope", package)?;
    if let Some(dependency) = package.parent().map(|p| p.join("bytecode")).filter(|d| d.join("__init__.py").is_file()) {
        link_into(&stage, "bytecode", &dependency)?;
    }
    Ok(stage)
}

fn link_into(stage: &Path, name: &str, target: &Path) -> Result<()> {
    let link = stage.join(name);
    if std::fs::read_link(&link).ok().as_deref() != Some(target) {
        let tmp = stage.join(format!(".{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(target, &tmp)?;
        std::fs::rename(&tmp, &link)?;
    }
    Ok(())
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

fn native_library(package: &Path) -> Result<PathBuf> {
    let found = std::fs::read_dir(package)?.flatten().map(|e| e.path()).find(|p| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        name.starts_with("_native") && name.ends_with(".so")
    });
    found.ok_or_else(|| {
        Hinted::new(
            format!("{} has no _native library", package.display()),
            "reinstall rankscope with `pip install .`",
        )
        .into()
    })
}

/// PEP 768: the target's own interpreter runs the bootstrap at a safe point.
fn remote_exec(pid: u32, stage: &Path) -> Result<()> {
    let script = stage.join(format!("bootstrap-{pid}.py"));
    let mut file = std::fs::File::create(&script)?;
    write!(
        file,
        "import sys\nsys.path.insert(0, {dir:?})\ntry:\n    import rankscope\n    rankscope._start_injected()\nfinally:\n    sys.path.remove({dir:?})\n",
        dir = stage.display().to_string()
    )?;
    let exe = format!("/proc/{pid}/exe");
    let status = std::process::Command::new(&exe)
        .args(["-c", "import sys; sys.remote_exec(int(sys.argv[1]), sys.argv[2])", &pid.to_string()])
        .arg(&script)
        .status()?;
    if !status.success() {
        return Err(Hinted::new(
            format!("sys.remote_exec into process {pid} failed ({status})"),
            "see the message above; the target must allow remote debugging (no PYTHON_DISABLE_REMOTE_DEBUG, no -X disable-remote-debug)",
        )
        .into());
    }
    Ok(())
}

fn wait_until_ready(pid: u32, dir: &Path, deadline: Instant) -> Result<()> {
    let error_file = paths::inject_error_path(dir, pid);
    loop {
        if paths::meta_path(dir, pid).exists() {
            return Ok(());
        }
        if let Ok(text) = std::fs::read_to_string(&error_file) {
            let _ = std::fs::remove_file(&error_file);
            return Err(Hinted::new(
                format!("the probe was loaded into process {pid} but did not start: {}", text.trim()),
                "the target is unchanged otherwise; `rankscope PID bt` still reads its stacks from outside",
            )
            .into());
        }
        if !paths::pid_alive(pid) {
            return Err(Hinted::new(format!("process {pid} exited during the inject"), "nothing is left to attach to").into());
        }
        if Instant::now() >= deadline {
            return Err(Hinted::new(
                format!("the probe was loaded into process {pid} but has not started yet"),
                "it starts when the interpreter can take the GIL; a thread that holds it in native code delays it. \
                 `rankscope PID bt` reads the stacks from outside meanwhile; try again later",
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn explain(_pid: u32, err: InjectError) -> anyhow::Error {
    let hint = match &err {
        InjectError::NoProcess(_) => "`ps` or `rankscope list` show what is running".to_string(),
        InjectError::NotPython(_) => "inject works on CPython processes; give the PID of the python process itself (not a shell or launcher around it)".into(),
        InjectError::TooOld { .. } => "start the program with RANKSCOPE=1 instead, or use a newer Python".into(),
        InjectError::Denied { tracer: Some(t), .. } => format!("detach the debugger or tracer (process {t}) and try again"),
        InjectError::Denied { .. } => crate::outside::permission_hint(),
        InjectError::Exited(_) => "nothing is left to attach to".into(),
        InjectError::Timeout(_) => "the target was left running as it was; try again, or read stacks from outside with `rankscope PID bt`".into(),
        _ => "the target was left running as it was; `rankscope PID bt` reads its stacks from outside".into(),
    };
    Hinted::new(err.to_string(), hint).into()
}
