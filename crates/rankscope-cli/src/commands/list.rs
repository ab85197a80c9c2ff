//! `rankscope list`: live probes on this machine; stale sockets are removed.

use std::time::Duration;

use anyhow::Result;
use rankscope_core::paths;
use rankscope_core::protocol::ProcessMeta;
use serde_json::json;

use rankscope_query::table::{Align, Style, Table};

use crate::client::Probe;
use crate::ListFormat;

const PING_TIMEOUT: Duration = Duration::from_millis(500);

struct Entry {
    pid: u32,
    meta: Option<ProcessMeta>,
    responsive: bool,
}

pub fn human_duration(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// How long the process has run, not its probe (an injected probe is
/// younger than its process): from `/proc` for a process on this machine,
/// else from what its probe read there at start, else the probe's age.
pub fn process_age(meta: &ProcessMeta, here: &str) -> f64 {
    if meta.host == here {
        if let Some(age) = rankscope_core::host::process_age(meta.pid) {
            return age;
        }
    }
    (rankscope_core::host::now_seconds() - meta.process_started_at.unwrap_or(meta.started_at))
        .max(0.0)
}

pub fn run(format: ListFormat) -> Result<u8> {
    let dir = paths::endpoint_dir();
    let mut cleaned = 0;
    let live: Vec<u32> = paths::listed_pids(&dir)
        .into_iter()
        .filter(|&pid| {
            let alive = paths::endpoint_live(&dir, pid);
            if !alive {
                paths::remove_endpoint_files(&dir, pid);
                cleaned += 1;
            }
            alive
        })
        .collect();
    // Ask every probe at once: one hung target must not slow the listing.
    let dir_ref = &dir;
    let entries: Vec<Entry> = std::thread::scope(|scope| {
        let handles: Vec<_> = live
            .iter()
            .map(|&pid| {
                scope.spawn(move || {
                    // Nobody listening: the probe is gone even if the PID was reused.
                    let socket = paths::socket_path(dir_ref, pid);
                    if let Err(e) = std::os::unix::net::UnixStream::connect(&socket) {
                        if e.kind() == std::io::ErrorKind::ConnectionRefused {
                            return Entry {
                                pid,
                                meta: None,
                                responsive: false,
                            };
                        }
                    }
                    let answer = Probe::locate(pid).and_then(|p| p.meta(PING_TIMEOUT));
                    let responsive = answer.is_ok();
                    let meta = answer.ok().or_else(|| {
                        let text = std::fs::read(paths::meta_path(dir_ref, pid)).ok()?;
                        serde_json::from_slice(&text).ok()
                    });
                    Entry {
                        pid,
                        meta,
                        responsive,
                    }
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    // A socket whose process lives but never answers and has no metadata is
    // another program's PID reusing a dead probe's number.
    let entries: Vec<Entry> = entries
        .into_iter()
        .filter(|e| {
            let keep = e.responsive || e.meta.is_some();
            if !keep {
                paths::remove_endpoint_files(&dir, e.pid);
                cleaned += 1;
            }
            keep
        })
        .collect();
    let here = rankscope_core::host::hostname();
    match format {
        ListFormat::Json => {
            let rows: Vec<_> = entries
                .iter()
                .map(|e| {
                    json!({
                        "pid": e.pid,
                        "rank": e.meta.as_ref().and_then(rank_of),
                        "state": if e.responsive { "ready" } else { "unresponsive" },
                        "uptime_s": e.meta.as_ref().map(|m| process_age(m, &here)),
                        "probe_uptime_s": e.meta.as_ref().map(|m| rankscope_core::host::now_seconds() - m.started_at),
                        "cmdline": e.meta.as_ref().map(|m| m.cmdline.join(" ")),
                        "python_version": e.meta.as_ref().map(|m| m.python_version.clone()),
                    })
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&rows)?);
        }
        ListFormat::Table => {
            if entries.is_empty() {
                println!("No probed Python processes on this machine.");
                println!(
                    "hint: start one with `rankscope run -- python your_script.py` or RANKSCOPE=1"
                );
            } else {
                let mut table = Table::new(Style::Plain)
                    .whole_column("PID", Align::Left)
                    .whole_column("RANK", Align::Right)
                    .whole_column("STATE", Align::Left)
                    .whole_column("UPTIME", Align::Right)
                    .whole_column("PYTHON", Align::Left)
                    .column("COMMAND", Align::Left);
                for e in &entries {
                    let (rank, uptime, python, cmd) = match &e.meta {
                        Some(m) => (
                            rank_of(m).map_or_else(|| "-".to_string(), |r| r.to_string()),
                            human_duration(process_age(m, &here)),
                            m.python_version.clone(),
                            m.cmdline.join(" "),
                        ),
                        None => ("?".into(), "?".into(), "?".into(), String::new()),
                    };
                    let state = if e.responsive {
                        "ready"
                    } else {
                        "unresponsive"
                    };
                    table.row(vec![
                        e.pid.to_string(),
                        rank,
                        state.to_string(),
                        uptime,
                        python,
                        cmd,
                    ]);
                }
                crate::term::print(&table);
            }
        }
    }
    if cleaned > 0 {
        eprintln!(
            "(removed {cleaned} stale endpoint{} left by exited processes)",
            if cleaned == 1 { "" } else { "s" }
        );
    }
    Ok(0)
}

/// A process's rank where it is one of a job's: a lone program, a
/// launcher (torchrun's own process) or an `mp.spawn` parent has none,
/// whatever its metadata's default says.
fn rank_of(meta: &ProcessMeta) -> Option<i64> {
    meta.job_rank()
}

#[cfg(test)]
mod tests {
    use super::human_duration;

    #[test]
    fn a_process_elsewhere_is_aged_from_what_its_probe_said() {
        use rankscope_core::protocol::ProcessMeta;
        let now = rankscope_core::host::now_seconds();
        let meta: ProcessMeta = serde_json::from_value(serde_json::json!({
            "pid": 1, "ppid": 0, "host": "elsewhere", "rank": 0, "local_rank": 0, "world_size": 2,
            "cmdline": [], "exe": "", "cwd": "", "python_version": "3.11.7",
            "started_at": now - 5.0, "process_started_at": now - 600.0,
            "rankscope_version": "0", "protocol": 1,
        }))
        .unwrap();
        // Not this machine's PID 1: its own start time, not /proc's.
        let age = super::process_age(&meta, "here");
        assert!((599.0..610.0).contains(&age), "{age}");
        let old_probe = ProcessMeta {
            process_started_at: None,
            ..meta
        };
        assert!(super::process_age(&old_probe, "here") < 10.0);
    }

    #[test]
    fn uptimes_read_naturally() {
        assert_eq!(human_duration(5.2), "5s");
        assert_eq!(human_duration(125.0), "2m05s");
        assert_eq!(human_duration(7300.0), "2h01m");
    }
}
