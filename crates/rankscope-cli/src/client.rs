//! Talking to one probe: over its unix socket on this machine, or over TCP
//! with its token for a rank on another machine.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use rankscope_core::http;
use rankscope_core::paths;
use rankscope_core::protocol::{
    EnvReply, EvalInterrupt, EvalInterruptReply, EvalReply, EvalRequest, ProbeTableReply,
    ProcessMeta, StacksQuery, StacksReply,
};
use serde::de::DeserializeOwned;

use crate::hint::Hinted;

/// Replies can be large (every frame's locals of many threads).
const MAX_REPLY_BYTES: usize = 256 * 1024 * 1024;

#[derive(Clone)]
pub struct Probe {
    pub pid: u32,
    endpoint: Endpoint,
}

#[derive(Clone)]
enum Endpoint {
    Unix(PathBuf),
    /// `host:port` and the bearer token the probe wrote for its clients.
    Tcp {
        addr: String,
        token: String,
    },
}

/// A connected stream of either kind.
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
        }
    }
}

/// A process's first words of its command line; `None` when it has none
/// (a kernel thread) or is gone.
pub fn command_line(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|w| !w.is_empty())
        .take(4)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    (!words.is_empty()).then(|| words.join(" "))
}

/// A one-word description of a PID for error messages: its command line.
pub fn describe(pid: u32) -> String {
    match command_line(pid) {
        Some(words) => format!("process {pid} ({words})"),
        None => format!("process {pid}"),
    }
}

impl Probe {
    /// The probe of `pid` if it has one; an error only when there is no such process.
    pub fn find(pid: u32) -> Result<Option<Probe>> {
        match Probe::locate(pid) {
            Ok(probe) => Ok(Some(probe)),
            Err(_) if paths::pid_alive(pid) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Finds the probe of `pid`, or says precisely why there is none.
    pub fn locate(pid: u32) -> Result<Probe> {
        let dir = paths::endpoint_dir();
        let socket = paths::socket_path(&dir, pid);
        if !paths::pid_alive(pid) {
            if socket.exists() {
                paths::remove_endpoint_files(&dir, pid);
            }
            return Err(Hinted::new(
                format!("no process with PID {pid}"),
                "`rankscope list` shows the processes that have a probe",
            )
            .into());
        }
        if !socket.exists() {
            return Err(Hinted::new(
                format!("{} has no rankscope probe", describe(pid)),
                "`rankscope inject PID` starts one in the running process; or start it with RANKSCOPE=1 or `rankscope run -- ...`",
            )
            .into());
        }
        Ok(Probe {
            pid,
            endpoint: Endpoint::Unix(socket),
        })
    }

    /// The probe of a process on another machine, at `addr` (`host:port`,
    /// or `tcp://host:port`), with its token.
    pub fn remote(pid: u32, addr: &str, token: &str) -> Probe {
        let addr = addr.strip_prefix("tcp://").unwrap_or(addr).to_string();
        Probe {
            pid,
            endpoint: Endpoint::Tcp {
                addr,
                token: token.to_string(),
            },
        }
    }

    fn connect(&self, timeout: Duration) -> Result<Stream> {
        let socket = match &self.endpoint {
            Endpoint::Unix(socket) => socket,
            Endpoint::Tcp { addr, .. } => return self.connect_tcp(addr, timeout),
        };
        let stream = UnixStream::connect(socket).map_err(|e| {
            let stale = matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
            );
            if stale {
                Hinted::new(
                    format!(
                        "the probe socket of {} does not accept connections",
                        describe(self.pid)
                    ),
                    "the probe was stopped, or the socket is left from an earlier process; \
                     `rankscope list` cleans up stale sockets",
                )
            } else if e.kind() == io::ErrorKind::PermissionDenied {
                Hinted::new(
                    format!("permission denied on {}", socket.display()),
                    "run rankscope as the user that owns the target process",
                )
            } else {
                Hinted::new(
                    format!("cannot connect to {}: {e}", socket.display()),
                    "`rankscope list` shows live probes",
                )
            }
        })?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(Stream::Unix(stream))
    }

    fn connect_tcp(&self, addr: &str, timeout: Duration) -> Result<Stream> {
        use std::net::ToSocketAddrs;
        let unreachable = |why: String| {
            Hinted::new(
                format!("cannot reach the probe of PID {} at {addr}: {why}", self.pid),
                "is the rank alive, and its address routable from here? it listens where RANKSCOPE_LISTEN told it to",
            )
        };
        let target = addr
            .to_socket_addrs()
            .map_err(|e| unreachable(e.to_string()))?
            .next()
            .ok_or_else(|| unreachable("the name has no address".into()))?;
        let stream = TcpStream::connect_timeout(&target, timeout.min(Duration::from_secs(5)))
            .map_err(|e| unreachable(e.to_string()))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        let _ = stream.set_nodelay(true);
        Ok(Stream::Tcp(stream))
    }

    /// One request, one answer; `timeout` bounds the wait for the answer.
    fn request<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<T> {
        let local = matches!(self.endpoint, Endpoint::Unix(_));
        // A stopped process (SIGSTOP, Ctrl-Z, a debugger) answers nothing
        // until continued: said now, not after the whole wait.
        if local && crate::outside::stopped(self.pid) {
            return Err(stopped(self.pid).into());
        }
        let mut stream = self.connect(timeout)?;
        let bearer;
        let headers: &[(&str, &str)] = match &self.endpoint {
            Endpoint::Tcp { token, .. } => {
                bearer = format!("Bearer {token}");
                &[("Authorization", &bearer)]
            }
            Endpoint::Unix(_) => &[],
        };
        if let Err(e) = http::write_request(&mut stream, method, path, headers, body) {
            // A busy probe answers 503 and closes before it reads the
            // request: the answer is there to read, where the write broke.
            if !matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) {
                return Err(e.into());
            }
        }
        let response = http::read_response(&mut stream, MAX_REPLY_BYTES).map_err(|e| match e {
            http::HttpError::Io(_) if local && crate::outside::stopped(self.pid) => {
                stopped(self.pid).into()
            }
            http::HttpError::Io(io)
                if matches!(
                    io.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Hinted::new(
                    format!(
                        "the probe of {} did not answer within {:.1}s",
                        describe(self.pid),
                        timeout.as_secs_f64()
                    ),
                    "a thread may be holding the GIL in native code; try again, or raise --timeout",
                )
                .into()
            }
            http::HttpError::Truncated
                if matches!(self.endpoint, Endpoint::Unix(_)) && exited(self.pid) =>
            {
                Hinted::new(
                    format!("{} exited before its probe answered", describe(self.pid)),
                    "`rankscope crashes` shows whether it crashed",
                )
                .into()
            }
            other => anyhow::anyhow!("bad answer from the probe of PID {}: {other}", self.pid),
        })?;
        if response.status != 200 {
            let message = serde_json::from_slice::<serde_json::Value>(&response.body)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&response.body).into_owned());
            anyhow::bail!(
                "the probe of PID {} answered {}: {message}",
                self.pid,
                response.status
            );
        }
        serde_json::from_slice(&response.body).map_err(|e| {
            anyhow::anyhow!("unreadable answer from the probe of PID {}: {e}", self.pid)
        })
    }

    pub fn meta(&self, timeout: Duration) -> Result<ProcessMeta> {
        let meta: ProcessMeta = self.request("GET", "/v1/meta", b"", timeout)?;
        if meta.protocol != rankscope_core::PROTOCOL_VERSION {
            return Err(Hinted::new(
                format!(
                    "the probe of PID {} speaks protocol {} (rankscope {}), this CLI speaks {}",
                    self.pid,
                    meta.protocol,
                    meta.rankscope_version,
                    rankscope_core::PROTOCOL_VERSION
                ),
                "use the rankscope command from the same install as the target's package",
            )
            .into());
        }
        Ok(meta)
    }

    pub fn stacks(
        &self,
        with_locals: bool,
        all_frames: bool,
        timeout: Duration,
    ) -> Result<StacksReply> {
        self.stacks_query(
            &StacksQuery {
                locals: with_locals,
                all_frames,
                ..StacksQuery::default()
            },
            timeout,
        )
    }

    pub fn stacks_query(&self, query: &StacksQuery, timeout: Duration) -> Result<StacksReply> {
        self.request("GET", &query.path(), b"", timeout)
    }

    /// The registry entries of the job this probe's process belongs to.
    pub fn job(&self, timeout: Duration) -> Result<Vec<serde_json::Value>> {
        self.request("GET", "/v1/job", b"", timeout)
    }

    pub fn env(&self, timeout: Duration) -> Result<EnvReply> {
        self.request("GET", "/v1/env", b"", timeout)
    }

    /// A breakpoint operation (`{"op": "add" | "list" | "rm" | "clear" |
    /// "snapshots", ...}`); the probe answers `{"ok": ...}` or `{"error": ...}`.
    pub fn breakpoints(&self, request: &serde_json::Value) -> Result<serde_json::Value> {
        let body = serde_json::to_vec(request)?;
        let mut reply: serde_json::Value =
            self.request("POST", "/v1/breakpoints", &body, Duration::from_secs(10))?;
        if let Some(error) = reply.get("error").and_then(|e| e.as_str()) {
            return Err(Hinted::new(
                error.to_string(),
                "`rankscope PID break list` shows what is set",
            )
            .into());
        }
        Ok(reply
            .get_mut("ok")
            .map(serde_json::Value::take)
            .unwrap_or_default())
    }

    /// A torch request (`{"action": "status" | "trace_on" | "trace_off", ...}`);
    /// the probe answers `{"ok": ...}` or `{"error": ..., "hint": ...}`.
    pub fn torch(&self, request: &serde_json::Value) -> Result<serde_json::Value> {
        // Turning hooks on or off may wait for the training thread to leave an optimizer step.
        self.helper(
            "/v1/torch",
            request,
            Duration::from_secs(15),
            "`rankscope PID torch` shows what the probe found",
        )
    }

    /// The last `tail` collectives of each group in torch's Flight Recorder
    /// (`cluster bt`, `python.flight_recorder`), as rows of `stuck::COLUMNS`.
    pub fn flight_recorder(&self, tail: usize, timeout: Duration) -> Result<ProbeTableReply> {
        let reply = self.helper(
            "/v1/torch",
            &serde_json::json!({"action": "collectives", "switch": "flight", "tail": tail}),
            timeout,
            "",
        )?;
        Ok(serde_json::from_value(reply)?)
    }

    /// `POST /v1/memory`: the probe's memory helper (a tensor scan may take its budget of seconds).
    pub fn memory(&self, request: &serde_json::Value) -> Result<serde_json::Value> {
        self.helper(
            "/v1/memory",
            request,
            Duration::from_secs(60),
            "`rankscope PID memory` shows what the probe sees",
        )
    }

    /// `POST /v1/profile`: the probe samples its own process for
    /// `duration_s` and answers with the fold (`--inside`, or a rank on
    /// another machine). Once `stop` is set (Ctrl-C) the probe is told to
    /// end early, and answers with the fold so far.
    pub fn profile(
        &self,
        duration_s: f64,
        rate_hz: f64,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<serde_json::Value> {
        // Names this sampling to the stop request: another client's may run
        // in the same probe at the same time.
        let id = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 40);
        let request = serde_json::json!({"duration_s": duration_s, "rate_hz": rate_hz, "id": id});
        std::thread::scope(|scope| {
            let asked = scope.spawn(|| {
                self.helper(
                    "/v1/profile",
                    &request,
                    Duration::from_secs_f64(duration_s + 30.0),
                    "`rankscope cluster profile` on the rank's own machine samples it from outside",
                )
            });
            let mut told: Option<std::time::Instant> = None;
            while !asked.is_finished() {
                std::thread::sleep(Duration::from_millis(50));
                // Told again until the answer comes: a stop that arrives
                // before the sampling has begun finds nothing to stop.
                if stop.load(std::sync::atomic::Ordering::SeqCst)
                    && told.is_none_or(|t| t.elapsed() > Duration::from_millis(250))
                {
                    let body = serde_json::json!({"id": id}).to_string();
                    let _ = self.request::<serde_json::Value>(
                        "POST",
                        "/v1/profile/stop",
                        body.as_bytes(),
                        Duration::from_secs(2),
                    );
                    told = Some(std::time::Instant::now());
                }
            }
            asked
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the profile request panicked")))
        })
    }

    /// `POST /v1/debug`: one op of a debug session (`rankscope dap`).
    pub fn debug(
        &self,
        request: &serde_json::Value,
        timeout: Duration,
    ) -> Result<serde_json::Value> {
        self.helper(
            "/v1/debug",
            request,
            timeout,
            "`rankscope dap` drives the probe's debug sessions",
        )
    }

    /// A helper's `{"ok": ...}`, or its `{"error": ..., "hint": ...}` as an error that keeps the hint.
    fn helper(
        &self,
        path: &str,
        request: &serde_json::Value,
        timeout: Duration,
        default_hint: &str,
    ) -> Result<serde_json::Value> {
        let body = serde_json::to_vec(request)?;
        let mut reply: serde_json::Value = self.request("POST", path, &body, timeout)?;
        if let Some(error) = reply.get("error").and_then(|e| e.as_str()) {
            let hint = reply
                .get("hint")
                .and_then(|h| h.as_str())
                .unwrap_or(default_hint);
            return Err(Hinted::new(error.to_string(), hint.to_string()).into());
        }
        Ok(reply
            .get_mut("ok")
            .map(serde_json::Value::take)
            .unwrap_or_default())
    }

    /// The rows of a table the probe keeps in memory (`python.torch_trace`).
    pub fn probe_table(
        &self,
        name: &str,
        columns: Option<&[&str]>,
        filters: &[serde_json::Value],
        count: bool,
        timeout: Duration,
    ) -> Result<ProbeTableReply> {
        self.request(
            "GET",
            &rankscope_core::protocol::probe_table_path(name, columns, filters, count),
            b"",
            timeout,
        )
    }

    /// The CLI waits a little longer than the probe's own deadline, so that
    /// an interrupted eval can still report what it printed.
    pub fn eval(&self, request: &EvalRequest) -> Result<EvalReply> {
        let body = serde_json::to_vec(request)?;
        let wait = Duration::from_secs_f64((request.timeout_s + 2.0).clamp(0.0, 1e7));
        self.request("POST", "/v1/eval", &body, wait)
    }

    /// Raises `KeyboardInterrupt` in the eval sent with this id, if it still
    /// runs; false when it had already ended.
    pub fn interrupt_eval(&self, id: &str, timeout: Duration) -> Result<bool> {
        let body = serde_json::to_vec(&EvalInterrupt { id: id.to_string() })?;
        let reply: EvalInterruptReply =
            self.request("POST", "/v1/eval/interrupt", &body, timeout)?;
        Ok(reply.interrupted)
    }
}

/// Whether `pid` is gone, or a zombie, within a moment: a connection that
/// closed mid-answer closed with the process, or for another reason.
/// A stopped process's probe cannot answer: said with what to do.
fn stopped(pid: u32) -> Hinted {
    Hinted::new(
        format!("{} is stopped (SIGSTOP, Ctrl-Z or a debugger): its probe cannot answer until it runs", describe(pid)),
        format!("continue it with `kill -CONT {pid}`; `rankscope {pid} bt` reads a stopped process from outside"),
    )
}

fn exited(pid: u32) -> bool {
    for _ in 0..10 {
        if !paths::pid_alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
