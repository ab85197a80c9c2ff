//! `rankscope inject PID`: start the probe inside a Python process that was
//! started without it, or in every rank of a job given its launcher.
//!
//! The target's environment need not have rankscope: the package installed
//! with this CLI is offered to it through a private directory holding only
//! a link to the `rankscope` package, put first on the target's `sys.path`
//! for the import and taken off again. Before 3.14 the probe library is
//! loaded with ptrace (crate `rankscope-inject`); from 3.14 on, CPython's own
//! `sys.remote_exec` runs the same bootstrap.
//!
//! A launcher (torchrun, or any parent without a rank whose descendants carry
//! one in their environment) is not injected itself: its ranks are, each as
//! one process would be, at once.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use rankscope_core::paths;
use rankscope_inject::{InjectError, PythonInfo};

use crate::client::Probe;
use crate::hint::Hinted;

pub fn run(pid: u32, timeout: f64) -> Result<u8> {
    let started = Instant::now();
    let timeout = Duration::from_secs_f64(if timeout.is_finite() {
        timeout.clamp(0.1, 86_400.0)
    } else {
        60.0
    });
    if !paths::pid_alive(pid) {
        return Err(explain(pid, InjectError::NoProcess(pid)));
    }
    if let Some(job) = launcher_job(pid) {
        return inject_job(pid, job, started, timeout);
    }
    match inject_process(pid, timeout)? {
        None => println!("process {pid} already has a rankscope probe; nothing to do"),
        Some(done) => println!("{done}; try `rankscope {pid} bt`"),
    }
    Ok(0)
}

/// The processes below `pid` when it is a job's launcher (no rank of its
/// own, ranks among its descendants).
fn launcher_job(pid: u32) -> Option<Vec<Member>> {
    if rank_in_environment(pid).is_some() {
        return None;
    }
    job_below(pid, &Tree::read())
}

/// Whether `pid` launched a job (torchrun): injecting it would probe the
/// launcher, not its ranks.
pub fn is_launcher(pid: u32) -> bool {
    launcher_job(pid).is_some()
}

/// Starts the probe in one Python process and says what it did; `None` when
/// the process already had a probe. Prints nothing: `rankscope dap --stdio`
/// owns stdout.
pub fn inject_process(pid: u32, timeout: Duration) -> Result<Option<String>> {
    let started = Instant::now();
    if already_probed(pid) {
        return Ok(None);
    }
    let python = rankscope_inject::python_in(pid).map_err(|e| explain(pid, e))?;
    let stage = Stage::prepare()?;
    stage.inject(pid, &python, started + timeout, timeout)?;
    Ok(Some(format!(
        "probe started in process {pid} (Python {}) in {} ms",
        python.version,
        started.elapsed().as_millis()
    )))
}

fn already_probed(pid: u32) -> bool {
    matches!(Probe::find(pid), Ok(Some(probe)) if probe.meta(Duration::from_secs(1)).is_ok())
}

/// What the CLI offers a target: the staging directory and the probe library in it.
struct Stage {
    dir: PathBuf,
    library: PathBuf,
    endpoints: PathBuf,
}

impl Stage {
    fn prepare() -> Result<Stage> {
        let package = package_dir()?;
        let dir = stage(&package)?;
        let library = native_library(&dir.join("rankscope"))?;
        Ok(Stage {
            dir,
            library,
            endpoints: paths::endpoint_dir(),
        })
    }

    /// Loads the probe into `pid` and waits until it answers (its metadata
    /// file is written last). Safe to run for several processes at once.
    fn inject(
        &self,
        pid: u32,
        python: &PythonInfo,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<()> {
        let _ = std::fs::remove_file(paths::inject_error_path(&self.endpoints, pid));
        if python.minor() >= (3, 14) {
            remote_exec(pid, &self.dir)?;
        } else {
            rankscope_inject::load_probe(pid, &self.library, &self.dir, timeout)
                .map_err(|e| explain(pid, e))?;
        }
        wait_until_ready(pid, &self.endpoints, deadline)
    }
}

/// The launcher variables that give a process its global rank. SLURM's are
/// left out: `srun torchrun` gives the launcher itself SLURM_PROCID.
const RANK_VARIABLES: [&str; 3] = ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];

/// The rank in a process's initial environment (`/proc/PID/environ`), if it
/// carries one; `None` too when that file cannot be read.
fn rank_in_environment(pid: u32) -> Option<i64> {
    let vars = crate::outside::initial_environ(pid);
    RANK_VARIABLES
        .iter()
        .find_map(|name| vars.get(*name)?.trim().parse().ok())
}

/// Parent to children, read once from `/proc/*/stat`.
struct Tree {
    children: BTreeMap<u32, Vec<u32>>,
}

impl Tree {
    fn read() -> Tree {
        let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // The command name may hold spaces and parentheses: fields follow the last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                children.entry(ppid).or_default().push(pid);
            }
        }
        Tree { children }
    }

    fn children(&self, pid: u32) -> &[u32] {
        self.children
            .get(&pid)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }
}

/// A descendant of a launcher: a rank to inject, or why it is not one.
struct Member {
    pid: u32,
    rank: Option<i64>,
    found: Result<PythonInfo, Outcome>,
}

/// Every descendant of `launcher`, or `None` when none carries a rank (then
/// `launcher` is injected as one process). A rank's own descendants
/// (DataLoader workers, compile workers) inherit its environment; they are
/// listed but are not ranks.
fn job_below(launcher: u32, tree: &Tree) -> Option<Vec<Member>> {
    let mut members = Vec::new();
    // (pid, the rank process above it, if any)
    let mut stack: Vec<(u32, Option<(u32, i64)>)> = tree
        .children(launcher)
        .iter()
        .rev()
        .map(|&c| (c, None))
        .collect();
    let mut any_rank = false;
    while let Some((pid, above)) = stack.pop() {
        let rank = rank_in_environment(pid);
        any_rank |= rank.is_some();
        let mut below = above;
        let found = match (above, rank) {
            (Some((owner, owner_rank)), _) => Err(Outcome::Skipped(format!(
                "a child of rank {owner_rank} (pid {owner}), not a rank itself"
            ))),
            (None, None) => Err(Outcome::Skipped("no rank in its environment".into())),
            (None, Some(rank)) => match rankscope_inject::python_in(pid) {
                Ok(python) => {
                    below = Some((pid, rank));
                    Ok(python)
                }
                Err(InjectError::NotPython(_)) => Err(Outcome::Skipped("not CPython".into())),
                Err(err) => Err(Outcome::Failed(err.to_string())),
            },
        };
        members.push(Member { pid, rank, found });
        stack.extend(tree.children(pid).iter().rev().map(|&c| (c, below)));
    }
    any_rank.then_some(members)
}

fn inject_job(
    launcher: u32,
    members: Vec<Member>,
    started: Instant,
    timeout: Duration,
) -> Result<u8> {
    println!(
        "{} runs a job; injecting its ranks",
        crate::client::describe(launcher)
    );
    let stage = Stage::prepare()?;
    let deadline = started + timeout;
    // One thread per rank: each inject waits for its own probe to start (and
    // ptrace ties a tracee to the thread that seized it).
    let mut outcomes: Vec<(u32, Option<i64>, Outcome)> = std::thread::scope(|scope| {
        let running: Vec<_> = members
            .into_iter()
            .map(|Member { pid, rank, found }| {
                let outcome = match found {
                    Ok(_) if already_probed(pid) => Err(Outcome::AlreadyProbed),
                    Ok(python) => {
                        let stage = &stage;
                        Ok(scope.spawn(move || {
                            match stage.inject(pid, &python, deadline, timeout) {
                                Ok(()) => Outcome::Injected {
                                    version: python.version.clone(),
                                    after: started.elapsed(),
                                },
                                Err(err) => Outcome::Failed(super::first_line(&err)),
                            }
                        }))
                    }
                    Err(done) => Err(done),
                };
                (pid, rank, outcome)
            })
            .collect();
        running
            .into_iter()
            .map(|(pid, rank, outcome)| {
                let outcome = match outcome {
                    Ok(handle) => handle
                        .join()
                        .unwrap_or_else(|_| Outcome::Failed("the inject thread panicked".into())),
                    Err(done) => done,
                };
                (pid, rank, outcome)
            })
            .collect()
    });
    outcomes.sort_by_key(|(pid, rank, outcome)| {
        (!matches!(outcome, Outcome::Injected { .. }), *rank, *pid)
    });
    let (mut injected, mut failed) = (0, 0);
    for (pid, rank, outcome) in &outcomes {
        let rank = rank
            .map(|r| format!("rank {r}"))
            .unwrap_or_else(|| "-".into());
        let what = match outcome {
            Outcome::Injected { version, after } => {
                injected += 1;
                format!("injected (Python {version}, {} ms)", after.as_millis())
            }
            Outcome::AlreadyProbed => "skipped: already probed".into(),
            Outcome::Skipped(why) => format!(
                "skipped: {why}: {}",
                crate::client::command_line(*pid).unwrap_or_default()
            ),
            Outcome::Failed(why) => {
                failed += 1;
                format!("failed: {why}")
            }
        };
        println!("  {rank:<8} pid {pid:<8} {what}");
    }
    println!(
        "injected {injected} of {}; try `rankscope cluster list` or `rankscope cluster bt`",
        outcomes.len()
    );
    if failed > 0 {
        return Err(Hinted::new(
            format!("{failed} rank(s) of the job could not be injected (see above)"),
            "`rankscope inject PID` on one of them says more; the other processes are unchanged",
        )
        .into());
    }
    Ok(0)
}

enum Outcome {
    Injected { version: String, after: Duration },
    AlreadyProbed,
    Skipped(String),
    Failed(String),
}

/// The installed `rankscope` package: `RANKSCOPE_PACKAGE_DIR`, else the
/// site-packages beside this executable (pip puts both in one prefix).
fn package_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("RANKSCOPE_PACKAGE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    let prefix = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    for lib in ["lib", "lib64"] {
        let Ok(entries) = std::fs::read_dir(prefix.join(lib)) else {
            continue;
        };
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
    let stage = dir.join(format!(
        "inject-{:016x}",
        fnv1a(package.as_os_str().as_encoded_bytes())
    ));
    std::fs::create_dir_all(&stage)?;
    link_into(&stage, "rankscope", package)?;
    if let Some(dependency) = package
        .parent()
        .map(|p| p.join("bytecode"))
        .filter(|d| d.join("__init__.py").is_file())
    {
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
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn native_library(package: &Path) -> Result<PathBuf> {
    let found = std::fs::read_dir(package)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
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
        .args([
            "-c",
            "import sys; sys.remote_exec(int(sys.argv[1]), sys.argv[2])",
            &pid.to_string(),
        ])
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
            return Err(Hinted::new(
                format!("process {pid} exited during the inject"),
                "nothing is left to attach to",
            )
            .into());
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

/// The user a process runs as, where it is not this one's.
fn other_user(pid: u32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt as _;
    let uid = std::fs::metadata(format!("/proc/{pid}")).ok()?.uid();
    // SAFETY: getuid has no preconditions.
    (uid != unsafe { libc::getuid() }).then_some(uid)
}

fn explain(pid: u32, err: InjectError) -> anyhow::Error {
    // The probe library is loaded by the target, as its user: one who may
    // not read this side's install (a venv under a home of mode 700) could
    // not open it.
    let foreign = other_user(pid).map(|uid| {
        format!("PID {pid} runs as uid {uid}, not as you: run rankscope as that user, from an install it can read")
    });
    let hint = match &err {
        InjectError::NoProcess(_)
        | InjectError::NotPython(_)
        | InjectError::TooOld { .. }
        | InjectError::Exited(_) => None,
        InjectError::Denied {
            tracer: Some(_), ..
        } => None,
        _ => foreign,
    };
    if let Some(hint) = hint {
        return Hinted::new(err.to_string(), hint).into();
    }
    let hint = match &err {
        InjectError::NoProcess(_) => "`ps` or `rankscope list` show what is running".to_string(),
        InjectError::NotPython(_) => "inject works on CPython processes, and on a launcher (torchrun) whose children carry a rank; give the PID of the python process itself".into(),
        InjectError::TooOld { .. } => "start the program with RANKSCOPE=1 instead, or use a newer Python".into(),
        InjectError::Denied { tracer: Some(t), .. } => format!("detach the debugger or tracer (process {t}) and try again"),
        InjectError::Denied { .. } => crate::outside::permission_hint(),
        InjectError::Exited(_) => "nothing is left to attach to".into(),
        InjectError::Timeout(_) => "the target was left running as it was; try again, or read stacks from outside with `rankscope PID bt`".into(),
        _ => "the target was left running as it was; `rankscope PID bt` reads its stacks from outside".into(),
    };
    Hinted::new(err.to_string(), hint).into()
}
