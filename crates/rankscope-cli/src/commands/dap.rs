//! `rankscope dap`: a Debug Adapter Protocol server for editors, over TCP
//! (`--listen`) or stdin/stdout (`--stdio`). The adapter itself is the
//! `rankscope-dap` crate; this finds the probes it talks to and carries the
//! bytes.
//!
//! In `--stdio` mode stdout is the DAP channel: everything for the user goes
//! to stderr.

use std::collections::BTreeMap;
use std::net::{Shutdown, SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use rankscope_core::paths;
use rankscope_core::protocol::ProcessMeta;
use rankscope_core::ranks::compress;
use rankscope_dap::{Backend, BackendError, Ending, Options, Target};
use serde_json::Value;

use crate::client::{describe, Probe};
use crate::hint::Hinted;

pub struct DapArgs {
    pub listen: Option<String>,
    pub stdio: bool,
    pub pid: Option<u32>,
    pub rank: Option<i64>,
    pub job: bool,
    pub token: Option<String>,
    pub lease: f64,
    pub trace: bool,
}

/// How long an inject may take before the adapter gives up on the process.
const INJECT_TIMEOUT: Duration = Duration::from_secs(5);
const META_TIMEOUT: Duration = Duration::from_secs(2);

/// The probes of a session, reached over their unix sockets.
struct Probes(Vec<Probe>);

impl Backend for Probes {
    fn call(
        &self,
        target: usize,
        request: Value,
        timeout: Duration,
    ) -> Result<Value, BackendError> {
        let probe = &self.0[target];
        probe.debug(&request, timeout).map_err(|err| {
            let message = super::first_line(&err);
            // A process that is gone, or whose probe stopped (its socket
            // removed), will not answer again: the session is over for it.
            let socket = paths::socket_path(&paths::endpoint_dir(), probe.pid);
            if paths::pid_alive(probe.pid) && socket.exists() {
                BackendError::Failed(message)
            } else {
                BackendError::Gone(message)
            }
        })
    }
}

#[derive(Clone, Copy)]
enum Mode {
    Listen(SocketAddr),
    Stdio,
}

pub fn run(args: DapArgs) -> Result<u8> {
    let mode = match (&args.listen, args.stdio) {
        (Some(spec), false) => Mode::Listen(parse_listen(spec)?),
        (None, true) => Mode::Stdio,
        (Some(_), true) => {
            return Err(Hinted::new(
                "--listen and --stdio both given",
                "--listen PORT for an editor that connects (VSCode's \"connect\"); --stdio for one that starts the adapter itself",
            )
            .into())
        }
        (None, false) => {
            return Err(Hinted::new(
                "say how the editor reaches the adapter: --listen or --stdio",
                "e.g. `rankscope dap --listen 5678 --pid PID`, then attach VSCode with {\"type\": \"debugpy\", \"request\": \"attach\", \"connect\": {\"port\": 5678}}",
            )
            .into())
        }
    };
    // Over a network anyone who reaches the port could run code in the
    // target; stdio's only peer is the editor that started us.
    let token = match mode {
        Mode::Listen(_) => args
            .token
            .clone()
            .or_else(|| std::env::var("RANKSCOPE_TOKEN").ok())
            .filter(|t| !t.is_empty()),
        Mode::Stdio => None,
    };
    if let Mode::Listen(addr) = mode {
        if !addr.ip().is_loopback() && token.is_none() {
            return Err(Hinted::new(
                format!("--listen {addr} is reachable from other machines, and no token is set"),
                "give --token T (or set RANKSCOPE_TOKEN) and put \"rankscopeToken\": \"T\" in the editor's attach configuration; \
                 or listen on loopback and tunnel: ssh -L 5678:127.0.0.1:5678 HOST",
            )
            .into());
        }
    }
    let lease = super::seconds(args.lease, "--lease")?;
    // Before any inject: a port in use leaves the target untouched.
    let listener = match mode {
        Mode::Listen(addr) => Some(TcpListener::bind(addr).map_err(|e| {
            Hinted::new(
                format!("cannot listen on {addr}: {e}"),
                "another debugger may hold the port: pick another with --listen",
            )
        })?),
        Mode::Stdio => None,
    };
    let (targets, notices) = find_targets(&args)?;
    let mut options = Options::new(targets.iter().map(|(t, _)| t.clone()).collect());
    options.token = token;
    options.notices = notices;
    options.trace = args.trace;
    options.lease = lease;
    // Several polls fit in a lease, so one slow answer does not lose the session.
    options.events_wait = options.events_wait.min(lease / 3);
    let what = match targets.as_slice() {
        [(t, _)] => describe(t.pid),
        _ => format!(
            "ranks {} ({} processes)",
            compress(targets.iter().map(|(_, m)| m.rank)),
            targets.len()
        ),
    };
    let backend: Arc<dyn Backend> = Arc::new(Probes(
        targets
            .iter()
            .map(|(t, _)| Probe::locate(t.pid))
            .collect::<Result<_>>()?,
    ));
    let Some(listener) = listener else {
        eprintln!("rankscope dap: debugging {what} over stdin/stdout");
        let ending = rankscope_dap::serve(backend, options, std::io::stdin(), std::io::stdout());
        if let Ending::ProtocolError(why) = ending {
            return Err(Hinted::new(
                format!("the editor's messages are not DAP: {why}"),
                "the editor must speak the Debug Adapter Protocol on the adapter's stdin",
            )
            .into());
        }
        report(&ending, targets.len() > 1);
        return Ok(0);
    };
    listen(listener, backend, options, &what)
}

fn listen(
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    mut options: Options,
    what: &str,
) -> Result<u8> {
    let bound = listener.local_addr()?;
    eprintln!(
        "rankscope dap: debugging {what}; attach the editor to {bound} \
         (VSCode: {{\"type\": \"debugpy\", \"request\": \"attach\", \"connect\": {{\"host\": \"{}\", \"port\": {}}}}})",
        bound.ip(),
        bound.port()
    );
    // Polled, so that an adapter waiting for an editor notices its process
    // exit and ends too.
    listener.set_nonblocking(true)?;
    let exited = |options: &Options| !options.targets.iter().any(|t| paths::pid_alive(t.pid));
    // One editor at a time: the probe holds one debug session.
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if exited(&options) {
                    eprintln!(
                        "rankscope dap: {} exited",
                        if options.targets.len() > 1 {
                            "every process"
                        } else {
                            "the process"
                        }
                    );
                    return Ok(0);
                }
                wait_for_editor(&listener, 500);
                continue;
            }
            Err(e) => {
                eprintln!("rankscope dap: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // Small messages answered at once: with Nagle's algorithm on, a
        // reply written as header then body waited for the editor's
        // delayed ACK (about 100 ms an attach).
        let _ = stream.set_nodelay(true);
        if let Err(e) = stream.set_nonblocking(false) {
            eprintln!("rankscope dap: {e}");
            continue;
        }
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        eprintln!("rankscope dap: editor connected from {peer}");
        let _ = stream.set_nodelay(true);
        let (reader, writer) = match (stream.try_clone(), stream.try_clone()) {
            (Ok(r), Ok(w)) => (r, w),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("rankscope dap: {e}");
                continue;
            }
        };
        let ending = rankscope_dap::serve(backend.clone(), options.clone(), reader, writer);
        // Ends the reader thread the session leaves blocked on the socket.
        let _ = stream.shutdown(Shutdown::Both);
        report(&ending, options.targets.len() > 1);
        // Said once: the next editor finds the probe already there.
        options.notices.clear();
        // A session the probe ended leaves a live process to attach again.
        if ending == Ending::TargetGone && exited(&options) {
            return Ok(0);
        }
    }
}

fn report(ending: &Ending, job: bool) {
    let runs_on = if job {
        "the processes run on"
    } else {
        "the process runs on"
    };
    let line = match ending {
        Ending::Disconnected => format!("the editor disconnected; {runs_on}"),
        Ending::ClientGone => {
            format!("the editor went away without disconnecting; detached, {runs_on}")
        }
        Ending::TargetGone if job => {
            "the processes exited, or their probes ended the session".into()
        }
        Ending::TargetGone => "the process exited, or its probe ended the session".into(),
        Ending::Refused(why) => format!("refused an editor: {why}"),
        Ending::ProtocolError(why) => format!("dropped an editor that does not speak DAP: {why}"),
    };
    eprintln!("rankscope dap: {line}");
}

/// `--listen` as `rankscope run --listen` reads it: PORT and :PORT mean loopback.
fn parse_listen(spec: &str) -> Result<SocketAddr> {
    let bad = || {
        Hinted::new(
            format!("bad --listen value {spec:?}: expected PORT, :PORT or HOST:PORT"),
            "e.g. --listen 5678 (loopback), or --listen 0.0.0.0:5678 --token T",
        )
    };
    let spec = spec.trim();
    let full = if spec.parse::<u16>().is_ok() {
        format!("127.0.0.1:{spec}")
    } else if let Some(port) = spec.strip_prefix(':') {
        format!("127.0.0.1:{port}")
    } else {
        spec.to_string()
    };
    if let Ok(addr) = full.parse() {
        return Ok(addr);
    }
    // A host name (`localhost:5678`): its first address.
    let (_, port) = full.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    full.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| bad().into())
}

/// The processes to debug, each with what its probe says of it.
type Targets = Vec<(Target, ProcessMeta)>;

/// The processes to debug, and what the user should be told (a probe
/// started by inject).
fn find_targets(args: &DapArgs) -> Result<(Targets, Vec<String>)> {
    let chosen = [args.pid.is_some(), args.rank.is_some(), args.job]
        .iter()
        .filter(|&&b| b)
        .count();
    if chosen != 1 {
        return Err(Hinted::new(
            if chosen == 0 {
                "say which process to debug: --pid PID, --rank N or --job"
            } else {
                "give only one of --pid, --rank and --job"
            },
            "`rankscope list` shows the processes that have a probe, with their ranks",
        )
        .into());
    }
    if let Some(pid) = args.pid {
        let mut notices = Vec::new();
        if Probe::find(pid)?.is_none() {
            if super::inject::is_launcher(pid) {
                return Err(Hinted::new(
                    format!("{} launched a job; debug one of its ranks", describe(pid)),
                    format!("`rankscope inject {pid}` starts probes in its ranks; then `rankscope dap --rank N`"),
                )
                .into());
            }
            if let Some(done) = super::inject::inject_process(pid, INJECT_TIMEOUT)? {
                eprintln!("rankscope dap: {done}");
                notices.push(format!(
                    "rankscope: started a probe in process {pid} by inject"
                ));
            }
        }
        let probe = Probe::locate(pid)?;
        let meta = probe.meta(META_TIMEOUT)?;
        let target = Target {
            label: None,
            rank: None,
            pid,
            cwd: Some(PathBuf::from(&meta.cwd)),
        };
        return Ok((vec![(target, meta)], notices));
    }
    let ranks = job_ranks();
    if let Some(rank) = args.rank {
        let matching: Vec<&ProcessMeta> = ranks.iter().filter(|m| m.rank == rank).collect();
        return match matching.as_slice() {
            [one] => {
                let probe = Probe::locate(one.pid)?;
                let meta = probe.meta(META_TIMEOUT)?;
                let target = Target {
                    label: Some(format!("rank {rank}")),
                    rank: Some(rank),
                    pid: one.pid,
                    cwd: Some(PathBuf::from(&meta.cwd)),
                };
                Ok((vec![(target, meta)], Vec::new()))
            }
            [] => Err(no_rank(
                &format!("no process of rank {rank} has a probe on this machine"),
                &ranks,
            )
            .into()),
            several => Err(Hinted::new(
                format!(
                    "{} processes here are rank {rank} (of different jobs)",
                    several.len()
                ),
                format!(
                    "pick one with --pid: {}",
                    several
                        .iter()
                        .map(|m| describe(m.pid))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
            .into()),
        };
    }
    // --job: every rank here, of the one job running here.
    let mut jobs: BTreeMap<String, Vec<&ProcessMeta>> = BTreeMap::new();
    for m in &ranks {
        jobs.entry(m.job_id.clone().unwrap_or_else(|| "(no job id)".into()))
            .or_default()
            .push(m);
    }
    let members = match jobs.len() {
        0 => return Err(no_rank("no rank of a job has a probe on this machine", &ranks).into()),
        1 => jobs.into_values().next().expect("one job"),
        _ => {
            return Err(Hinted::new(
                format!("{} jobs run here: {}", jobs.len(), jobs.keys().cloned().collect::<Vec<_>>().join(", ")),
                "--job takes the one job running here; debug one process of them with --pid PID (`rankscope list` shows them)",
            )
            .into())
        }
    };
    let mut targets = Vec::new();
    for m in members {
        match Probe::locate(m.pid).and_then(|p| p.meta(META_TIMEOUT)) {
            Ok(meta) => targets.push((
                Target {
                    label: Some(format!("rank {}", meta.rank)),
                    rank: Some(meta.rank),
                    pid: m.pid,
                    cwd: Some(PathBuf::from(&meta.cwd)),
                },
                meta,
            )),
            Err(e) => eprintln!(
                "rankscope dap: leaving out rank {} (pid {}): {}",
                m.rank,
                m.pid,
                super::first_line(&e)
            ),
        }
    }
    if targets.is_empty() {
        return Err(Hinted::new(
            "no rank of the job answered",
            "`rankscope cluster list` shows each rank's state",
        )
        .into());
    }
    Ok((targets, Vec::new()))
}

fn no_rank(message: &str, ranks: &[ProcessMeta]) -> Hinted {
    let hint = if ranks.is_empty() {
        "start the job under rankscope (`rankscope run -- torchrun ...`), or `rankscope inject LAUNCHER_PID` to start probes in its ranks".to_string()
    } else {
        format!(
            "ranks with a probe here: {}; `rankscope list` shows them",
            compress(ranks.iter().map(|m| m.rank))
        )
    };
    Hinted::new(message, hint)
}

/// The live probes on this machine that are ranks of a job, one process
/// per (job, rank): a rank's children (DataLoader workers) inherit its rank
/// and may start probes of their own, and a restarted rank leaves its
/// newest process.
fn job_ranks() -> Vec<ProcessMeta> {
    let dir = paths::endpoint_dir();
    let metas: Vec<ProcessMeta> = paths::listed_pids(&dir)
        .into_iter()
        .filter(|&pid| paths::pid_alive(pid))
        .filter_map(|pid| {
            let text = std::fs::read(paths::meta_path(&dir, pid)).ok()?;
            serde_json::from_slice::<ProcessMeta>(&text).ok()
        })
        .filter(|m| m.job_id.is_some() || m.world_size > 1)
        .collect();
    let mut by_rank: BTreeMap<(Option<String>, i64), ProcessMeta> = BTreeMap::new();
    for m in &metas {
        let child_of_rank = metas
            .iter()
            .any(|p| p.pid == m.ppid && p.rank == m.rank && p.job_id == m.job_id);
        if child_of_rank {
            continue;
        }
        let key = (m.job_id.clone(), m.rank);
        if by_rank
            .get(&key)
            .is_none_or(|kept| kept.started_at < m.started_at)
        {
            by_rank.insert(key, m.clone());
        }
    }
    by_rank.into_values().collect()
}

/// Until an editor connects to `listener`, or `ms` pass: it is accepted the
/// moment it connects (a sleep between tries cost it up to 100 ms), and
/// the target's exit is still noticed.
fn wait_for_editor(listener: &std::net::TcpListener, ms: i32) {
    use std::os::fd::AsRawFd;
    let mut fds = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, alive for the whole call.
    unsafe { libc::poll(&mut fds, 1, ms) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses() {
        assert_eq!(
            parse_listen("5678").unwrap(),
            "127.0.0.1:5678".parse().unwrap()
        );
        assert_eq!(
            parse_listen(":5678").unwrap(),
            "127.0.0.1:5678".parse().unwrap()
        );
        assert_eq!(
            parse_listen("0.0.0.0:9").unwrap(),
            "0.0.0.0:9".parse().unwrap()
        );
        assert_eq!(parse_listen("[::1]:9").unwrap(), "[::1]:9".parse().unwrap());
        assert!(parse_listen("localhost:5678").unwrap().ip().is_loopback());
        for bad in ["", "x", "70000", "host:", "1.2.3.4:x"] {
            assert!(parse_listen(bad).is_err(), "{bad:?}");
        }
    }
}
