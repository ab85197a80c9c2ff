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

pub fn collect(python_version: &str, tcp: Option<String>) -> ProcessMeta {
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
        cmdline: cmdline(),
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
        .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty())),
        step_address: Some(crate::memory::step_address()),
    }
}
