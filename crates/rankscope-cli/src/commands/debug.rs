//! `rankscope debug --rank N | --pid P`: join the pdb session a crashed rank
//! holds open (RANKSCOPE_ON_ERROR=socket) on `debug-rank<N>-pid<P>.sock` in
//! its run directory. Lines typed here go to pdb; what pdb writes comes back.

use std::io::{BufRead, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::Result;
use rankscope_core::crash;

use crate::hint::Hinted;

struct Held {
    rank: i64,
    pid: u32,
    socket: PathBuf,
}

fn parse(path: &Path) -> Option<Held> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("debug-rank")?.strip_suffix(".sock")?;
    let (rank, pid) = rest.split_once("-pid")?;
    Some(Held {
        rank: rank.parse().ok()?,
        pid: pid.parse().ok()?,
        socket: path.to_path_buf(),
    })
}

fn held_processes(run: Option<PathBuf>) -> Vec<Held> {
    let mut held: Vec<Held> = crash::run_dirs(run)
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flat_map(|read| read.flatten().filter_map(|e| parse(&e.path())))
        .filter(|h| rankscope_core::paths::pid_alive(h.pid))
        .collect();
    held.sort_by_key(|h| (h.rank, h.pid));
    held
}

pub fn run(rank: Option<i64>, pid: Option<u32>, run: Option<PathBuf>) -> Result<u8> {
    let held = held_processes(run);
    let matching: Vec<&Held> = held
        .iter()
        .filter(|h| rank.is_none_or(|r| h.rank == r) && pid.is_none_or(|p| h.pid == p))
        .collect();
    let listing = || {
        if held.is_empty() {
            "no process is held for a debugger; run the job with RANKSCOPE_ON_ERROR=socket (or console), and `rankscope crashes` shows what was recorded".to_string()
        } else {
            let names: Vec<String> = held
                .iter()
                .map(|h| format!("rank {} (pid {})", h.rank, h.pid))
                .collect();
            format!("held now: {}", names.join(", "))
        }
    };
    let target = match (matching.as_slice(), rank, pid) {
        ([one], _, _) => *one,
        ([], _, _) => {
            let what = match (rank, pid) {
                (Some(r), _) => format!("rank {r}"),
                (None, Some(p)) => format!("pid {p}"),
                (None, None) => "any process".to_string(),
            };
            return Err(Hinted::new(
                format!("no crashed process is waiting for a debugger as {what}"),
                listing(),
            )
            .into());
        }
        (_, _, _) => {
            return Err(Hinted::new(
                "several crashed processes are waiting for a debugger",
                format!("pick one with --pid; {}", listing()),
            )
            .into());
        }
    };
    let stream = UnixStream::connect(&target.socket).map_err(|e| {
        Hinted::new(
            format!(
                "cannot connect to rank {} (pid {}): {e}",
                target.rank, target.pid
            ),
            "another debugger may have taken the session, or the hold timed out",
        )
    })?;
    relay(stream)
}

/// Connects the terminal to a pdb session on `stream` until either side ends it.
pub fn relay(stream: UnixStream) -> Result<u8> {
    let mut from_pdb = stream.try_clone()?;
    // pdb's output goes to our stdout as it comes; when pdb ends the session
    // (q, or the process exits), so does this command.
    let printer = std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        let mut out = std::io::stdout();
        while let Ok(n) = from_pdb.read(&mut buf) {
            if n == 0 || out.write_all(&buf[..n]).and_then(|_| out.flush()).is_err() {
                break;
            }
        }
    });
    let mut to_pdb = stream;
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        line.clear();
        if printer.is_finished() {
            break;
        }
        match stdin.lock().read_line(&mut line) {
            Ok(0) | Err(_) => {
                let _ = to_pdb.shutdown(std::net::Shutdown::Write);
                break;
            }
            Ok(_) => {
                if to_pdb.write_all(line.as_bytes()).is_err() {
                    break;
                }
            }
        }
    }
    let _ = printer.join();
    Ok(0)
}
