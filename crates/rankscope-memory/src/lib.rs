//! A process's memory as the kernel counts it, read from `/proc` without
//! touching the process (no GIL, no signal, no ptrace): the probe's sampler
//! reads its own process this way on a thread of its own, and the CLI can
//! read any process of the same user.
//!
//! * RSS and its peak (`VmHWM`) from `/proc/PID/status`: cheap, one small file.
//! * USS (what would be freed if the process exited: its private pages),
//!   PSS and swap from `/proc/PID/smaps_rollup`, which the kernel sums over
//!   every mapping: dearer (it walks the page tables, milliseconds for a
//!   process with torch loaded), so the sampler reads it one sample in ten.

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum MemoryError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} has no {field} line")]
    Missing { path: PathBuf, field: &'static str },
}

/// Bytes, as the kernel counted them at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcMemory {
    pub rss: u64,
    /// The most RSS the process ever had (`VmHWM`).
    pub rss_peak: u64,
    /// Private pages only: what the process alone holds.
    pub uss: u64,
    /// Shared pages divided among the processes that map them.
    pub pss: u64,
    pub swap: u64,
}

fn read(path: PathBuf) -> Result<(PathBuf, String), MemoryError> {
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok((path, text)),
        Err(source) => Err(MemoryError::Read { path, source }),
    }
}

/// The value of a `Name:   1234 kB` line, in bytes.
fn kb_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let number: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(number * 1024)
    })
}

fn need(text: &str, path: &std::path::Path, field: &'static str) -> Result<u64, MemoryError> {
    kb_field(text, field).ok_or_else(|| MemoryError::Missing {
        path: path.to_path_buf(),
        field,
    })
}

/// What `/proc/PID/status` says (RSS, its peak, swap): about 20 µs to
/// read, cheap enough for every sample. `uss` and `pss` are 0: only
/// `smaps_rollup` has them.
pub fn read_status(pid: u32) -> Result<ProcMemory, MemoryError> {
    let (path, text) = read(PathBuf::from(format!("/proc/{pid}/status")))?;
    Ok(ProcMemory {
        rss: need(&text, &path, "VmRSS")?,
        rss_peak: need(&text, &path, "VmHWM")?,
        swap: kb_field(&text, "VmSwap").unwrap_or(0),
        ..ProcMemory::default()
    })
}

/// Everything: RSS and peak, and USS, PSS and swap from `smaps_rollup`,
/// which the kernel sums over every mapping under the process's mmap lock:
/// milliseconds for a process with torch loaded (6-12 ms measured here).
pub fn read_process(pid: u32) -> Result<ProcMemory, MemoryError> {
    let ProcMemory { rss, rss_peak, .. } = read_status(pid)?;
    let (path, text) = read(PathBuf::from(format!("/proc/{pid}/smaps_rollup")))?;
    let private = need(&text, &path, "Private_Clean")? + need(&text, &path, "Private_Dirty")?;
    Ok(ProcMemory {
        rss,
        rss_peak,
        uss: private,
        pss: need(&text, &path, "Pss")?,
        swap: kb_field(&text, "Swap").unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_in_bytes() {
        let text = "Rss:                2048 kB\nPss:                1024 kB\nPss_Anon:  4 kB\nSwap:  0 kB\n";
        assert_eq!(
            kb_field(text, "Pss"),
            Some(1024 * 1024),
            "Pss, not Pss_Anon"
        );
        assert_eq!(kb_field(text, "Rss"), Some(2048 * 1024));
        assert_eq!(kb_field(text, "Private_Dirty"), None);
    }

    #[test]
    fn this_process_is_read_and_grows_when_it_touches_memory() {
        let before = read_process(std::process::id()).unwrap();
        assert!(
            before.rss > 0
                && before.uss > 0
                && before.uss <= before.rss
                && before.rss <= before.rss_peak
        );
        let block = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = read_process(std::process::id()).unwrap();
        assert!(
            after.uss >= before.uss + (60 << 20),
            "{before:?} -> {after:?}"
        );
        drop(block);
    }

    #[test]
    fn a_process_that_is_not_there_says_which_file() {
        let err = read_process(u32::MAX).unwrap_err().to_string();
        assert!(
            err.starts_with("cannot read /proc/4294967295/status"),
            "{err}"
        );
    }
}
