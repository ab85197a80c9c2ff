//! What a probe says about its process, computed once at start.

use rankscope_core::host::{hostname, now_seconds};
use rankscope_core::protocol::ProcessMeta;

/// First of the launcher variables that is set and numeric.
fn env_int(names: &[&str]) -> Option<i64> {
    names
        .iter()
        .find_map(|n| std::env::var(n).ok()?.trim().parse().ok())
}

fn cmdline() -> Vec<String> {
    std::fs::read("/proc/self/cmdline")
        .map(|raw| {
            raw.split(|&b| b == 0)
                .filter(|part| !part.is_empty())
                .map(|part| String::from_utf8_lossy(part).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn link(path: &str) -> String {
    std::fs::read_link(path)
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// Set at start for a process that inherits a rank's environment without
/// being a rank (a multiprocessing child, torchrun's own process), until
/// torch.distributed makes it one: its rows carry no rank.
pub static BYSTANDER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A child that multiprocessing starts by spawn or forkserver (a DataLoader
/// worker, the resource tracker, the fork server): it inherits its parent
/// rank's RANK, WORLD_SIZE and job id, which describe the parent. It is no
/// rank of the job unless it calls `init_process_group` itself (mp.spawn's
/// workers do). A forked child keeps no probe at all.
pub fn multiprocessing_child(cmdline: &[String]) -> bool {
    cmdline.iter().any(|arg| arg == "--multiprocessing-fork")
        || cmdline
            .windows(2)
            .any(|w| w[0] == "-c" && w[1].trim_start().starts_with("from multiprocessing."))
}

/// torchrun's own process (or torch.distributed.launch's): it runs the
/// workers without being one, and keeps its job id (it names the job).
pub fn launcher(cmdline: &[String]) -> bool {
    cmdline.windows(2).any(|w| {
        w[0] == "-m" && (w[1] == "torch.distributed.run" || w[1] == "torch.distributed.launch")
    }) || cmdline.iter().take(2).any(|arg| {
        arg.rsplit('/').next() == Some("torchrun")
            || arg.ends_with("torch/distributed/run.py")
            || arg.ends_with("torch/distributed/launch.py")
    })
}

/// torchrun names every job started without `--rdzv-id` (or
/// `--standalone`) "none": two such jobs at once would be taken for one.
/// Their rendezvous address, which they cannot share while both run, and
/// which every rank of one job is given alike, tells them apart.
fn told_apart(id: String, env: impl Fn(&str) -> Option<String>) -> String {
    if id != "none" {
        return id;
    }
    match (env("MASTER_ADDR"), env("MASTER_PORT")) {
        (Some(addr), Some(port)) if !addr.is_empty() && !port.is_empty() => {
            format!("none-{addr}-{port}")
        }
        _ => id,
    }
}

pub fn collect(python_version: &str, tcp: Option<String>) -> ProcessMeta {
    let cmdline = cmdline();
    let child = multiprocessing_child(&cmdline);
    let launcher = launcher(&cmdline);
    BYSTANDER.store(child || launcher, std::sync::atomic::Ordering::Relaxed);
    // A launcher started by a scheduler (`srun torchrun ...`) has the
    // scheduler's task rank in its environment (SLURM_PROCID): it is the
    // rank of no job's process group.
    let env_int = |names: &[&str]| {
        if child || launcher {
            None
        } else {
            env_int(names)
        }
    };
    ProcessMeta {
        pid: std::process::id(),
        // SAFETY: getppid cannot fail.
        ppid: unsafe { libc::getppid() } as u32,
        host: hostname(),
        rank: env_int(&["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]).unwrap_or(0),
        local_rank: env_int(&["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"])
            .unwrap_or(0),
        world_size: env_int(&[
            "WORLD_SIZE",
            "OMPI_COMM_WORLD_SIZE",
            "PMI_SIZE",
            "SLURM_NTASKS",
        ])
        .unwrap_or(1),
        cmdline,
        exe: link("/proc/self/exe"),
        cwd: link("/proc/self/cwd"),
        python_version: python_version.to_string(),
        started_at: now_seconds(),
        process_started_at: rankscope_core::host::process_started_at(std::process::id()),
        rankscope_version: rankscope_core::VERSION.to_string(),
        protocol: rankscope_core::PROTOCOL_VERSION,
        tcp,
        job_id: [
            "TORCHELASTIC_RUN_ID",
            "SLURM_JOB_ID",
            "OMPI_MCA_ess_base_jobid",
            "PMIX_NAMESPACE",
        ]
        .iter()
        .filter(|_| !child)
        .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
        .map(|id| told_apart(id, |n| std::env::var(n).ok())),
        step_address: Some(crate::memory::step_address()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split('|').map(str::to_string).collect()
    }

    #[test]
    fn torchruns_default_job_id_is_told_apart_by_its_rendezvous() {
        let env = |n: &str| match n {
            "MASTER_ADDR" => Some("10.0.0.5".to_string()),
            "MASTER_PORT" => Some("29501".to_string()),
            _ => None,
        };
        assert_eq!(told_apart("none".into(), env), "none-10.0.0.5-29501");
        assert_eq!(told_apart("a1b2".into(), env), "a1b2");
        assert_eq!(told_apart("none".into(), |_| None), "none");
    }

    #[test]
    fn multiprocessing_children_and_launchers_are_told_from_ranks() {
        let spawn = args("/usr/bin/python3|-c|from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)|--multiprocessing-fork");
        let tracker =
            args("/usr/bin/python3|-c|from multiprocessing.resource_tracker import main;main(6)");
        assert!(multiprocessing_child(&spawn) && multiprocessing_child(&tracker));
        assert!(!launcher(&spawn));
        for line in [
            "/venv/bin/python|-m|torch.distributed.run|--nproc-per-node|2|train.py",
            "/venv/bin/python3|/venv/bin/torchrun|--standalone|train.py",
            "/venv/bin/python|/venv/lib/python3.11/site-packages/torch/distributed/launch.py|train.py",
        ] {
            assert!(launcher(&args(line)), "{line}");
            assert!(!multiprocessing_child(&args(line)), "{line}");
        }
        for line in [
            "/venv/bin/python|train.py|--multiprocessing|x",
            "/venv/bin/python|-c|print(1)",
            "/venv/bin/python|train.py|torchrun",
        ] {
            assert!(
                !launcher(&args(line)) && !multiprocessing_child(&args(line)),
                "{line}"
            );
        }
    }
}
