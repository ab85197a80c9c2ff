//! This machine's name and the time, as every row and record states them.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch.
pub fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The host name, "unknown" if the kernel will not say.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is valid for buf.len() bytes; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Seconds since process `pid` started, from `/proc`: its start time in
/// clock ticks after boot (field 22 of `/proc/PID/stat`) against the time
/// since boot (`/proc/uptime`). None when `/proc` does not say.
pub fn process_age(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    age_from(&stat, &uptime, ticks)
}

/// Seconds since the Unix epoch at which process `pid` started.
pub fn process_started_at(pid: u32) -> Option<f64> {
    Some(now_seconds() - process_age(pid)?)
}

fn age_from(stat: &str, uptime: &str, ticks_per_second: i64) -> Option<f64> {
    if ticks_per_second <= 0 {
        return None;
    }
    // The command name (field 2) may hold spaces and parentheses: count
    // fields from the last ')'. Field 3 (the state) is the first after it.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let start_ticks: u64 = after_name.split_whitespace().nth(22 - 3)?.parse().ok()?;
    let since_boot: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    Some((since_boot - start_ticks as f64 / ticks_per_second as f64).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_read_after_the_command_name() {
        // A command name with a space and a ')' in it; starttime = 5000 ticks.
        let stat =
            "77 (my (odd) proc) S 1 77 77 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5000 1000 10";
        assert_eq!(age_from(stat, "80.25 300.00", 100), Some(30.25));
        assert_eq!(age_from("garbage", "80.25 300.00", 100), None);
    }

    #[test]
    fn this_process_has_an_age() {
        let age = process_age(std::process::id()).expect("/proc/self/stat is readable");
        assert!((0.0..3600.0).contains(&age), "{age}");
    }
}
