//! The endpoint a probe serves inside the target process.
//!
//! One accept thread waits in `poll(2)` with no timeout, so an idle probe does
//! no work at all; `stop()` wakes it through a pipe. Each connection gets a
//! short-lived thread (at most [`MAX_CONNECTIONS`] at once) that reads one
//! request under size and time limits, asks the [`Handler`], and answers.
//! Nothing here knows about Python: the probe crate supplies the handler.

use std::fs;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use rankscope_core::fd::Guarded;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rankscope_core::http::{self, Request, Response, MAX_BODY_BYTES};
use thiserror::Error;

/// Connections served at once; more get a 503 rather than a thread each.
pub const MAX_CONNECTIONS: usize = 16;
/// A client gets this long to send its request (slow clients cost a thread).
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// And this long to take the answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// After an error answer, unread input is discarded for at most this long...
const DRAIN_TIMEOUT: Duration = Duration::from_millis(200);
/// ...and at most this much of it.
const DRAIN_LIMIT: usize = 4 * 1024 * 1024;

pub trait Handler: Send + Sync + 'static {
    fn handle(&self, request: &Request) -> Response;

    /// Answers `request` on `out`. A handler whose answer can be too big to
    /// hold whole writes it as it is made; the others answer with `handle`.
    fn respond(&self, request: &Request, out: &mut (dyn Write + Send)) -> io::Result<()> {
        http::write_response(out, &self.handle(request))
    }

    /// The same, for a handler whose work takes long: `gone()` says
    /// whether the client has hung up meanwhile, so that the work can end
    /// rather than run on for nobody.
    fn respond_watching(
        &self,
        request: &Request,
        out: &mut (dyn Write + Send),
        gone: &dyn Fn() -> bool,
    ) -> io::Result<()> {
        let _ = gone;
        self.respond(request, out)
    }
}

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("cannot bind {path}: {source}")]
    BindUnix { path: PathBuf, source: io::Error },
    #[error("cannot listen on TCP {addr}: {source}")]
    BindTcp { addr: String, source: io::Error },
    #[error("bad RANKSCOPE_LISTEN value {0:?}: expected PORT, :PORT or HOST:PORT")]
    BadListen(String),
    #[error("cannot write the token file {path}: {source}")]
    Token { path: PathBuf, source: io::Error },
    #[error("cannot start the server thread: {0}")]
    Thread(io::Error),
}

/// Parses `RANKSCOPE_LISTEN`: a bare port or `:port` binds loopback only.
pub fn parse_listen(spec: &str) -> Result<SocketAddr, ServerError> {
    let bad = || ServerError::BadListen(spec.to_string());
    let spec = spec.trim();
    let full = if let Ok(port) = spec.parse::<u16>() {
        format!("127.0.0.1:{port}")
    } else if let Some(port) = spec.strip_prefix(':') {
        format!("127.0.0.1:{port}")
    } else {
        spec.to_string()
    };
    full.parse().map_err(|_| bad())
}

pub struct TcpConfig {
    pub addr: SocketAddr,
    /// Where to write the token (mode 0600) for local clients to read.
    pub token_file: PathBuf,
}

pub struct ServerConfig {
    pub socket_path: PathBuf,
    pub tcp: Option<TcpConfig>,
}

/// A running server. Dropping it without `stop()` leaves the thread running;
/// that is what a forked child wants (the thread is not there to join).
pub struct Server {
    socket_path: PathBuf,
    token_file: Option<PathBuf>,
    /// (Guarded: a program that closed its descriptors and opened files of
    /// its own got the stop's wake-up byte in one; see `rankscope_core::fd`.)
    wake: Guarded<OwnedFd>,
    accept_thread: Option<JoinHandle<()>>,
    active: Arc<AtomicUsize>,
    tcp_addr: Option<SocketAddr>,
}

struct Shared {
    handler: Arc<dyn Handler>,
    token: Option<String>,
    active: Arc<AtomicUsize>,
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid array of two ints; O_CLOEXEC keeps the pipe out of
    // the target's children.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn random_token() -> io::Result<String> {
    let mut bytes = [0u8; 32];
    let mut urandom = fs::File::open("/dev/urandom")?;
    io::Read::read_exact(&mut urandom, &mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn write_token(path: &Path, token: &str) -> io::Result<()> {
    let _ = fs::remove_file(path);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(token.as_bytes())
}

/// Constant-time comparison, so the token cannot be guessed byte by byte.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for writes of the sizes given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

impl Server {
    pub fn start(config: ServerConfig, handler: Arc<dyn Handler>) -> Result<Server, ServerError> {
        let path = config.socket_path.clone();
        // A socket file left by a dead process with our PID (PID reuse) is stale.
        let _ = fs::remove_file(&path);
        let unix = UnixListener::bind(&path).map_err(|source| ServerError::BindUnix {
            path: path.clone(),
            source,
        })?;
        // The directory is already 0700; the socket is closed too, in case it is
        // ever bound somewhere less private.
        let _ = fs::set_permissions(&path, fs::Permissions::from_mode(0o600));

        let (tcp, token, tcp_addr, token_file) = match &config.tcp {
            None => (None, None, None, None),
            Some(tcp) => {
                let listener = TcpListener::bind(tcp.addr).map_err(|source| {
                    let _ = fs::remove_file(&path);
                    ServerError::BindTcp {
                        addr: tcp.addr.to_string(),
                        source,
                    }
                })?;
                let token = random_token()
                    .and_then(|t| write_token(&tcp.token_file, &t).map(|_| t))
                    .map_err(|source| {
                        let _ = fs::remove_file(&path);
                        ServerError::Token {
                            path: tcp.token_file.clone(),
                            source,
                        }
                    })?;
                let addr = listener.local_addr().ok();
                (
                    Some(listener),
                    Some(token),
                    addr,
                    Some(tcp.token_file.clone()),
                )
            }
        };

        let (wake_read, wake_write) = pipe().map_err(ServerError::Thread)?;
        let active = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared {
            handler,
            token,
            active: active.clone(),
        });
        let accept_thread = std::thread::Builder::new()
            .name("rankscope-server".into())
            .spawn(move || accept_loop(unix, tcp, wake_read, shared))
            .map_err(ServerError::Thread)?;
        Ok(Server {
            socket_path: path,
            token_file,
            wake: Guarded::new(wake_write),
            accept_thread: Some(accept_thread),
            active,
            tcp_addr,
        })
    }

    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// Connections being served right now.
    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Stops accepting, removes the socket and token, and joins the accept
    /// thread. Connections already being served finish on their own threads.
    pub fn stop(mut self) {
        if self.wake.ours() {
            // SAFETY: writing one byte from a valid buffer to our own pipe.
            unsafe { libc::write(self.wake.get().as_raw_fd(), b"x".as_ptr().cast(), 1) };
        }
        if let Some(thread) = self.accept_thread.take() {
            let _ = thread.join();
        }
        let _ = fs::remove_file(&self.socket_path);
        if let Some(token) = &self.token_file {
            let _ = fs::remove_file(token);
        }
    }
}

fn accept_loop(unix: UnixListener, tcp: Option<TcpListener>, wake: OwnedFd, shared: Arc<Shared>) {
    // Where the program closes these descriptors, the loop ends without
    // closing the numbers, which may be its own files by then (and a
    // regular file in their place is always readable: the loop spun).
    let (unix, tcp, wake) = (
        Guarded::new(unix),
        tcp.map(Guarded::new),
        Guarded::new(wake),
    );
    let mut fds = vec![
        libc::pollfd {
            fd: wake.get().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: unix.get().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    if let Some(tcp) = &tcp {
        fds.push(libc::pollfd {
            fd: tcp.get().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
    }
    loop {
        for fd in fds.iter_mut() {
            fd.revents = 0;
        }
        // SAFETY: fds is a valid, correctly sized array of pollfd.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if rc < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if fds[0].revents != 0
            || fds.iter().any(|fd| fd.revents & libc::POLLNVAL != 0)
            || !unix.ours()
            || !wake.ours()
            || tcp.as_ref().is_some_and(|t| !t.ours())
        {
            return;
        }
        if fds[1].revents != 0 {
            if let Ok((stream, _)) = unix.get().accept() {
                dispatch(Connection::Unix(stream), &shared);
            }
        }
        if let (Some(tcp), Some(fd)) = (&tcp, fds.get(2)) {
            if fd.revents != 0 {
                if let Ok((stream, _)) = tcp.get().accept() {
                    dispatch(Connection::Tcp(stream), &shared);
                }
            }
        }
    }
}

enum Connection {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Connection {
    /// Whether the client hung up (or the connection broke): asked without
    /// waiting, while an answer is still being made.
    fn peer_gone(&self) -> bool {
        let fd = match self {
            Connection::Unix(s) => s.as_raw_fd(),
            Connection::Tcp(s) => s.as_raw_fd(),
        };
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        ready > 0 && poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// Ends our side and discards what the client still sends, so that it
    /// reads our (error) answer instead of a connection reset. Bounded in time
    /// and bytes: a client that keeps sending is cut off.
    fn finish(&mut self) {
        let _ = match self {
            Connection::Unix(s) => s.shutdown(std::net::Shutdown::Write),
            Connection::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
        };
        let _ = match self {
            Connection::Unix(s) => s.set_read_timeout(Some(DRAIN_TIMEOUT)),
            Connection::Tcp(s) => s.set_read_timeout(Some(DRAIN_TIMEOUT)),
        };
        let mut sink = [0u8; 8192];
        let mut left = DRAIN_LIMIT;
        while left > 0 {
            match io::Read::read(self, &mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    }

    fn set_timeouts(&self) {
        let _ = match self {
            Connection::Unix(s) => s
                .set_read_timeout(Some(READ_TIMEOUT))
                .and(s.set_write_timeout(Some(WRITE_TIMEOUT))),
            Connection::Tcp(s) => s
                .set_read_timeout(Some(READ_TIMEOUT))
                .and(s.set_write_timeout(Some(WRITE_TIMEOUT))),
        };
    }
}

impl io::Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Connection::Unix(s) => s.read(buf),
            Connection::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Connection::Unix(s) => s.write(buf),
            Connection::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Connection::Unix(s) => s.flush(),
            Connection::Tcp(s) => s.flush(),
        }
    }
}

struct ActiveGuard(Arc<AtomicUsize>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn dispatch(mut conn: Connection, shared: &Arc<Shared>) {
    // Refuse other users before spending a thread on them.
    if let Connection::Unix(stream) = &conn {
        match peer_uid(stream) {
            Ok(uid) if uid == rankscope_core::paths::current_uid() => {}
            _ => {
                let _ = http::write_response(
                    &mut conn,
                    &Response::error(403, "peer belongs to another user"),
                );
                return;
            }
        }
    }
    if shared.active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
        shared.active.fetch_sub(1, Ordering::AcqRel);
        conn.set_timeouts();
        let _ = http::write_response(&mut conn, &Response::error(503, "probe is busy; try again"));
        return;
    }
    let guard = ActiveGuard(shared.active.clone());
    let shared = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("rankscope-conn".into())
        .spawn(move || {
            let _guard = guard;
            serve(conn, &shared);
        });
    // If no thread can be had the connection is dropped; the guard went with the closure.
    drop(spawned);
}

fn serve(mut conn: Connection, shared: &Shared) {
    conn.set_timeouts();
    let is_tcp = matches!(conn, Connection::Tcp(_));
    let response = match http::read_request(&mut conn, MAX_BODY_BYTES) {
        Err(e) => {
            let _ = http::write_response(&mut conn, &Response::error(e.status(), &e.to_string()));
            conn.finish();
            return;
        }
        Ok(request) => {
            if is_tcp && !authorized(&request, shared.token.as_deref()) {
                Response::error(
                    401,
                    "missing or wrong token (send Authorization: Bearer <token>)",
                )
            } else {
                let watched = match &conn {
                    Connection::Unix(s) => s.try_clone().map(Connection::Unix),
                    Connection::Tcp(s) => s.try_clone().map(Connection::Tcp),
                };
                let _ = match watched {
                    Ok(watched) => shared
                        .handler
                        .respond_watching(&request, &mut conn, &|| watched.peer_gone()),
                    Err(_) => shared.handler.respond(&request, &mut conn),
                };
                return;
            }
        }
    };
    let _ = http::write_response(&mut conn, &response);
}

fn authorized(request: &Request, token: Option<&str>) -> bool {
    let Some(token) = token else { return false };
    let Some(given) = request
        .header("authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    same_secret(given.trim().as_bytes(), token.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    struct Echo;
    impl Handler for Echo {
        fn handle(&self, request: &Request) -> Response {
            Response::json(200, format!("{{\"path\":\"{}\"}}", request.path))
        }
    }

    fn socket(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("rs-srv-{name}-{}.sock", std::process::id()))
    }

    fn roundtrip(
        stream: &mut (impl Read + Write),
        path: &str,
        headers: &[(&str, &str)],
    ) -> Response {
        http::write_request(stream, "GET", path, headers, b"").unwrap();
        http::read_response(stream, 1 << 20).unwrap()
    }

    #[test]
    fn serves_over_unix_and_stop_removes_the_socket() {
        let path = socket("unix");
        let server = Server::start(
            ServerConfig {
                socket_path: path.clone(),
                tcp: None,
            },
            Arc::new(Echo),
        )
        .unwrap();
        let mut s = UnixStream::connect(&path).unwrap();
        let resp = roundtrip(&mut s, "/v1/meta", &[]);
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body, br#"{"path":"/v1/meta"}"#);
        server.stop();
        assert!(!path.exists());
        assert!(UnixStream::connect(&path).is_err());
    }

    #[test]
    fn malformed_request_gets_400_and_the_server_lives_on() {
        let path = socket("bad");
        let server = Server::start(
            ServerConfig {
                socket_path: path.clone(),
                tcp: None,
            },
            Arc::new(Echo),
        )
        .unwrap();
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(b"\x16\x03\x01garbage\r\n\r\n").unwrap();
        let resp = http::read_response(&mut s, 1 << 20).unwrap();
        assert_eq!(resp.status, 400);
        let mut s = UnixStream::connect(&path).unwrap();
        assert_eq!(roundtrip(&mut s, "/x", &[]).status, 200);
        server.stop();
    }

    #[test]
    fn tcp_needs_the_token_and_defaults_to_loopback() {
        let path = socket("tcp");
        let token_file = std::env::temp_dir().join(format!("rs-srv-token-{}", std::process::id()));
        let addr = parse_listen("0").unwrap();
        assert!(addr.ip().is_loopback());
        let server = Server::start(
            ServerConfig {
                socket_path: path.clone(),
                tcp: Some(TcpConfig {
                    addr,
                    token_file: token_file.clone(),
                }),
            },
            Arc::new(Echo),
        )
        .unwrap();
        let mode = fs::metadata(&token_file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let token = fs::read_to_string(&token_file).unwrap();
        let tcp_addr = server.tcp_addr().unwrap();
        let mut s = TcpStream::connect(tcp_addr).unwrap();
        assert_eq!(roundtrip(&mut s, "/v1/meta", &[]).status, 401);
        let mut s = TcpStream::connect(tcp_addr).unwrap();
        assert_eq!(
            roundtrip(&mut s, "/v1/meta", &[("Authorization", "Bearer nope")]).status,
            401
        );
        let mut s = TcpStream::connect(tcp_addr).unwrap();
        let bearer = format!("Bearer {token}");
        assert_eq!(
            roundtrip(&mut s, "/v1/meta", &[("Authorization", &bearer)]).status,
            200
        );
        server.stop();
        assert!(!token_file.exists());
    }

    #[test]
    fn listen_specs() {
        assert_eq!(parse_listen("9000").unwrap().to_string(), "127.0.0.1:9000");
        assert_eq!(parse_listen(":9000").unwrap().to_string(), "127.0.0.1:9000");
        assert_eq!(
            parse_listen("0.0.0.0:9000").unwrap().to_string(),
            "0.0.0.0:9000"
        );
        assert!(parse_listen("nope").is_err());
    }
}
