//! Where a probe's endpoint lives on disk.
//!
//! Every probe of a user binds `<dir>/<pid>.sock` and writes `<dir>/<pid>.json`
//! (its metadata) in one per-user directory. The directory is the security
//! boundary: it must be ours and closed to everyone else (0700), or we refuse
//! to use it rather than expose eval to another user.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Overrides the endpoint directory (tests, or users with a noexec /tmp).
pub const DIR_ENV: &str = "RANKSCOPE_DIR";

#[derive(Debug, Error)]
pub enum DirError {
    #[error("cannot create {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
    #[error("{path} belongs to uid {owner}, not to us (uid {me}); refusing to use it")]
    Foreign { path: PathBuf, owner: u32, me: u32 },
    #[error("{path} is not a directory")]
    NotADirectory { path: PathBuf },
}

pub fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The endpoint directory for this user, whether or not it exists yet.
pub fn endpoint_dir() -> PathBuf {
    match std::env::var_os(DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(format!("/tmp/rankscope-{}", current_uid())),
    }
}

/// Creates the endpoint directory with mode 0700, or checks that an existing
/// one is ours; tightens its mode if someone loosened it.
pub fn ensure_private_dir(dir: &Path) -> Result<(), DirError> {
    let create = fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir);
    if let Err(source) = create {
        return Err(DirError::Create {
            path: dir.to_path_buf(),
            source,
        });
    }
    let meta = fs::symlink_metadata(dir).map_err(|source| DirError::Create {
        path: dir.to_path_buf(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(DirError::NotADirectory {
            path: dir.to_path_buf(),
        });
    }
    let me = current_uid();
    if meta.uid() != me {
        return Err(DirError::Foreign {
            path: dir.to_path_buf(),
            owner: meta.uid(),
            me,
        });
    }
    if meta.mode() & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|source| {
            DirError::Create {
                path: dir.to_path_buf(),
                source,
            }
        })?;
    }
    Ok(())
}

pub fn socket_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.sock"))
}

pub fn meta_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.json"))
}

pub fn token_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.token"))
}

/// Where an injected probe that failed to start says why.
pub fn inject_error_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.inject-error"))
}

/// PIDs that have a socket in `dir`, in ascending order.
pub fn listed_pids(dir: &Path) -> Vec<u32> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let name = name.to_str()?;
            name.strip_suffix(".sock")?.parse().ok()
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// Removes what a dead probe left behind. Missing files are not an error.
pub fn remove_endpoint_files(dir: &Path, pid: u32) {
    for path in [
        socket_path(dir, pid),
        meta_path(dir, pid),
        token_path(dir, pid),
        inject_error_path(dir, pid),
    ] {
        let _ = fs::remove_file(path);
    }
}

/// Whether the process that started at `started_at` (seconds since the
/// epoch, as the probe wrote it) still runs as `pid`: PIDs come round
/// again (32768 of them by default), and an unrelated process that took
/// this one is not it. Without a start time, whether `pid` runs.
pub fn same_process(pid: u32, started_at: Option<f64>) -> bool {
    pid_alive(pid)
        && match (started_at, crate::host::process_started_at(pid)) {
            (Some(then), Some(now)) => (now - then).abs() < 1.0,
            _ => true,
        }
}

/// Whether the probe whose files in `dir` carry `pid` still runs: its
/// process, by the start time its metadata says, not a later one that
/// took the PID of one killed without the chance to remove them.
pub fn endpoint_live(dir: &Path, pid: u32) -> bool {
    let started = fs::read(meta_path(dir, pid))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("process_started_at")?.as_f64());
    same_process(pid, started)
}

/// Whether a process with this PID runs (it may belong to someone else).
/// A zombie, exited but not yet reaped by its parent, does not.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    let exists = rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && !is_zombie(pid)
}

fn is_zombie(pid: i32) -> bool {
    // The state follows the command name, which is in parentheses and may
    // itself hold spaces or parentheses.
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        == Some("Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rankscope-core-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn private_dir_is_created_0700_and_loose_modes_are_tightened() {
        let dir = scratch("mode");
        ensure_private_dir(&dir).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        ensure_private_dir(&dir).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_in_place_of_the_dir_is_refused() {
        let dir = scratch("file");
        fs::write(&dir, b"x").unwrap();
        assert!(ensure_private_dir(&dir).is_err());
        fs::remove_file(&dir).unwrap();
    }

    #[test]
    fn pids_are_listed_from_socket_names_only() {
        let dir = scratch("list");
        ensure_private_dir(&dir).unwrap();
        for name in ["12.sock", "3.sock", "12.json", "junk.sock", "7.token"] {
            fs::write(dir.join(name), b"").unwrap();
        }
        assert_eq!(listed_pids(&dir), vec![3, 12]);
        remove_endpoint_files(&dir, 12);
        assert_eq!(listed_pids(&dir), vec![3]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        while !is_zombie(pid as i32) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(!pid_alive(pid));
        child.wait().unwrap();
    }

    #[test]
    fn our_own_pid_is_alive_and_pid_zero_is_not() {
        assert!(pid_alive(std::process::id()));
        let me = std::process::id();
        let started = crate::host::process_started_at(me);
        assert!(started.is_some());
        assert!(same_process(me, started) && same_process(me, None));
        assert!(!same_process(me, started.map(|t| t - 60.0)));
        assert!(!pid_alive(0));
    }
}
