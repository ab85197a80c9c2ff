//! One DAP session: an editor on one side, one probe per target on the other.
//!
//! Three kinds of threads: a reader that turns the client's bytes into
//! messages, the session thread that answers requests one at a time, and
//! one events thread per target that long-polls its probe and turns what it
//! reports into DAP events. Both of the last two write to the client,
//! through one locked writer that numbers every message.

use std::collections::HashSet;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};
use thiserror::Error;

use crate::framing::{self, FramingError, MessageReader};
use crate::ids::{Breakpoints, Handle, Handles, Ids};
use crate::paths::PathMap;

/// How long a probe call may take, besides `events` (its wait + 5 s) and
/// `evaluate`, which runs the user's code (the probe's own limit is 30 s).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
const EVALUATE_TIMEOUT: Duration = Duration::from_secs(35);
/// After every target is gone and `terminated` sent, how long the client has
/// to send its `disconnect` before the session ends anyway.
const GRACE_AFTER_TERMINATED: Duration = Duration::from_secs(1);

pub const LAUNCH_REFUSED: &str = "rankscope attaches to running processes; start the program with `rankscope run -- python ...` and attach";

#[derive(Debug, Error)]
pub enum BackendError {
    /// The probe answered with an error, or did not answer in time: the
    /// target lives on.
    #[error("{0}")]
    Failed(String),
    /// The target cannot be reached any more (it exited, or its probe stopped).
    #[error("{0}")]
    Gone(String),
}

/// The probes of a session, as the adapter reaches them. `target` indexes
/// [`Options::targets`]; `request` is one op of the probe's `POST /v1/debug`,
/// and the answer is what the probe put under `ok`.
pub trait Backend: Send + Sync {
    fn call(&self, target: usize, request: Value, timeout: Duration)
        -> Result<Value, BackendError>;
}

/// One process the session debugs.
#[derive(Debug, Clone, Default)]
pub struct Target {
    /// `rank 3` in a `--job` session: named in thread names, stops and errors.
    pub label: Option<String>,
    /// The process's rank in its job (`--job`, `--rank`): a breakpoint
    /// whose condition names ranks goes only to the ranks it names.
    pub rank: Option<i64>,
    pub pid: u32,
    /// The process's working directory: relative remote roots and relative
    /// frame paths are taken from it.
    pub cwd: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct Options {
    pub targets: Vec<Target>,
    /// When set, the attach request must carry it as `rankscopeToken`.
    pub token: Option<String>,
    /// Lines sent to the client as `output` events right after it attached.
    pub notices: Vec<String>,
    /// The `wait_s` of each `events` long poll.
    pub events_wait: Duration,
    /// The probe ends a session that has not polled for this long, so that a
    /// killed adapter leaves no thread paused.
    pub lease: Duration,
    pub max_message: usize,
    /// Every message in and out, on stderr.
    pub trace: bool,
}

impl Options {
    pub fn new(targets: Vec<Target>) -> Self {
        Options {
            targets,
            token: None,
            notices: Vec::new(),
            events_wait: Duration::from_secs(2),
            lease: Duration::from_secs(10),
            max_message: framing::DEFAULT_MAX_MESSAGE,
            trace: false,
        }
    }
}

/// How a session ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    /// The client sent `disconnect`; the targets run on.
    Disconnected,
    /// The client went away without `disconnect` (the adapter detached for it).
    ClientGone,
    /// Every target exited, or its probe ended the session (`terminated` was sent).
    TargetGone,
    /// The attach was refused (a wrong or missing token); the connection is closed.
    Refused(String),
    /// The client's stream could not be read as DAP.
    ProtocolError(String),
}

/// Runs one session to its end. The targets are detached from whatever the
/// ending, so no thread stays paused.
pub fn serve<R, W>(backend: Arc<dyn Backend>, options: Options, input: R, output: W) -> Ending
where
    R: Read + Send + 'static,
    W: Write + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    spawn_reader(input, options.max_message, tx.clone());
    let targets = options.targets.len();
    let paths = vec![PathMap::default(); targets];
    let shared = Arc::new(Shared {
        backend,
        out: Outbox {
            inner: Mutex::new(OutboxInner {
                seq: 0,
                out: Box::new(output),
                broken: false,
            }),
            trace: options.trace,
        },
        options,
        state: Mutex::new(State {
            sessions: vec![None; targets],
            paths,
            threads: Ids::default(),
            frames: Handles::default(),
            refs: Handles::default(),
            sources: Ids::default(),
            bps: Breakpoints::default(),
            line_offset: 0,
            column: 1,
            last_stop_target: 0,
            held: vec![Held::default(); targets],
        }),
        stop: AtomicBool::new(false),
        bp_updates: Mutex::new(0),
        bp_mapped: Condvar::new(),
    });
    let mut session = Session {
        shared,
        tx,
        attached: false,
        everything_gone: false,
        client: "dap".into(),
    };
    let ending = session.run(rx);
    session.finish();
    // An evaluate still running in the target answers no one: the session
    // the editor knew is over.
    session
        .shared
        .out
        .inner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .broken = true;
    ending
}

enum Incoming {
    Message(Value),
    /// Framed, but not JSON: the stream is still in step.
    Garbled(String),
    Closed(Option<FramingError>),
    /// Every target's events thread found its target gone.
    TargetsGone,
}

fn spawn_reader<R: Read + Send + 'static>(input: R, max: usize, tx: Sender<Incoming>) {
    std::thread::Builder::new()
        .name("dap-reader".into())
        .spawn(move || {
            let mut reader = MessageReader::new(BufReader::new(input), max);
            loop {
                let (incoming, last) = match reader.read() {
                    Ok(Some(message)) => (Incoming::Message(message), false),
                    Ok(None) => (Incoming::Closed(None), true),
                    Err(e) if e.recoverable() => (Incoming::Garbled(e.to_string()), false),
                    Err(e) => (Incoming::Closed(Some(e)), true),
                };
                if tx.send(incoming).is_err() || last {
                    return;
                }
            }
        })
        .expect("cannot start the DAP reader thread");
}

struct Outbox {
    inner: Mutex<OutboxInner>,
    trace: bool,
}

struct OutboxInner {
    seq: i64,
    out: Box<dyn Write + Send>,
    /// The client is gone: later messages are dropped (the reader sees the end).
    broken: bool,
}

impl Outbox {
    fn send(&self, mut message: Value) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.broken {
            return;
        }
        inner.seq += 1;
        message["seq"] = inner.seq.into();
        if self.trace {
            eprintln!("dap -> {message}");
        }
        if framing::write_message(&mut *inner.out, &message).is_err() {
            inner.broken = true;
        }
    }

    fn event(&self, event: &str, body: Option<Value>) {
        let mut message = json!({"type": "event", "event": event});
        if let Some(body) = body {
            message["body"] = body;
        }
        self.send(message);
    }

    fn output(&self, category: &str, text: &str) {
        let mut text = text.to_string();
        if !text.ends_with('\n') {
            text.push('\n');
        }
        self.event(
            "output",
            Some(json!({"category": category, "output": text})),
        );
    }

    fn respond(&self, request: &Request, result: Result<Value, String>) {
        let mut message = json!({
            "type": "response",
            "request_seq": request.seq,
            "command": request.command,
        });
        match result {
            Ok(body) => {
                message["success"] = true.into();
                if !body.is_null() {
                    message["body"] = body;
                }
            }
            Err(error) => {
                message["success"] = false.into();
                // A failed initialize or attach is the user's only news of
                // why the session did not start: have the editor show it.
                let show = matches!(request.command.as_str(), "initialize" | "attach" | "launch");
                message["body"] = if show {
                    json!({"error": {"id": 1, "format": error, "showUser": true}})
                } else {
                    json!({})
                };
                message["message"] = error.into();
            }
        }
        self.send(message);
    }
}

struct State {
    /// The probe's session number per target; `None` before attach and
    /// after the target is gone.
    sessions: Vec<Option<i64>>,
    paths: Vec<PathMap>,
    threads: Ids<(usize, i64)>,
    frames: Handles,
    refs: Handles,
    sources: Ids<(usize, String)>,
    bps: Breakpoints,
    /// 1 when the client counts lines from 0 (the probe counts from 1).
    line_offset: i64,
    column: i64,
    /// Where an evaluation without a frame runs in a `--job` session: the
    /// rank that stopped last.
    last_stop_target: usize,
    /// Per target: its threads stopped now, and since when it has been
    /// held (from its first stop until a `continue` leaves none stopped;
    /// steps keep it held, as the other ranks of a job go on waiting).
    held: Vec<Held>,
}

#[derive(Debug, Clone, Default)]
struct Held {
    since: Option<Instant>,
    threads: HashSet<i64>,
    /// When the Debug Console last heard what the hold does to the job:
    /// at its first stop, then at most once a minute (every step stops).
    told: Option<Instant>,
}

const RETELL_HOLD: Duration = Duration::from_secs(60);

struct Shared {
    backend: Arc<dyn Backend>,
    options: Options,
    out: Outbox,
    state: Mutex<State>,
    /// Set when the session ends: events threads stop and say nothing more.
    stop: AtomicBool,
    /// Breakpoint requests whose probe answers are not mapped yet: a hit on
    /// a breakpoint just set can come back before its id is known.
    bp_updates: Mutex<usize>,
    bp_mapped: Condvar,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs a breakpoint request (its probe calls and the mapping of their
    /// answers) while events that name breakpoints wait for it.
    fn updating_breakpoints<T>(&self, update: impl FnOnce() -> T) -> T {
        *self.bp_updates.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let result = update();
        *self.bp_updates.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.bp_mapped.notify_all();
        result
    }

    /// Bounded: the events thread must poll again before the lease lapses.
    fn wait_for_breakpoint_ids(&self) {
        let updates = self.bp_updates.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self
            .bp_mapped
            .wait_timeout_while(updates, self.options.lease / 3, |n| *n > 0);
    }

    fn is_job(&self) -> bool {
        self.options.targets.len() > 1
    }

    fn label(&self, target: usize) -> String {
        let t = &self.options.targets[target];
        t.label
            .clone()
            .unwrap_or_else(|| format!("process {}", t.pid))
    }

    /// In a `--job` session an error says which rank it came from.
    fn labelled(&self, target: usize, message: String) -> String {
        if self.is_job() {
            format!("{}: {message}", self.label(target))
        } else {
            message
        }
    }

    fn call(&self, target: usize, mut request: Value, timeout: Duration) -> Result<Value, String> {
        let session = self.state().sessions[target]
            .ok_or_else(|| self.labelled(target, "the process has exited".into()))?;
        request["session"] = session.into();
        self.backend
            .call(target, request, timeout)
            .map_err(|e| self.labelled(target, e.to_string()))
    }

    /// The same kind of request to every live target at once (one hung
    /// rank must not hold up the others); answers in target order.
    fn each_target(
        &self,
        request: impl Fn(usize) -> Value + Sync,
        timeout: Duration,
    ) -> Vec<(usize, Result<Value, String>)> {
        let live: Vec<usize> = self
            .state()
            .sessions
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(t, _)| t)
            .collect();
        if live.len() == 1 {
            let t = live[0];
            return vec![(t, self.call(t, request(t), timeout))];
        }
        std::thread::scope(|scope| {
            let running: Vec<_> = live
                .iter()
                .map(|&t| {
                    let request = &request;
                    (t, scope.spawn(move || self.call(t, request(t), timeout)))
                })
                .collect();
            running
                .into_iter()
                .map(|(t, h)| {
                    (
                        t,
                        h.join()
                            .unwrap_or_else(|_| Err("a probe call panicked".into())),
                    )
                })
                .collect()
        })
    }

    /// The file a remote path names on this machine, if it is there.
    fn frame(&self, id: i64) -> Result<Handle, String> {
        self.state()
            .frames
            .get(id)
            .ok_or_else(|| format!("frame {id} is gone: its thread has run on since"))
    }

    fn evaluate(&self, args: &Value) -> Result<Value, String> {
        let expression = text(args, "expression")?;
        let context = args
            .get("context")
            .and_then(Value::as_str)
            .unwrap_or("repl");
        self.in_frame(
            args,
            json!({"op": "evaluate", "expression": expression, "context": context}),
            "result",
        )
    }

    /// A Watch entry's value edited in the editor.
    fn set_expression(&self, args: &Value) -> Result<Value, String> {
        let expression = text(args, "expression")?;
        let value = text(args, "value")?;
        self.in_frame(
            args,
            json!({"op": "set_expression", "expression": expression, "value": value}),
            "value",
        )
    }

    /// `request` run in the frame `frameId` names, or in `__main__` of the
    /// target that stopped last; what it printed goes to the Debug Console,
    /// and its value is the answer's `key`.
    fn in_frame(&self, args: &Value, mut request: Value, key: &str) -> Result<Value, String> {
        let (owner, frame) = match args.get("frameId").and_then(Value::as_i64) {
            Some(id) => {
                let f = self.frame(id)?;
                (f, Value::from(f.probe))
            }
            None => {
                let target = self.state().last_stop_target;
                let owner = Handle {
                    target,
                    probe: 0,
                    thread: None,
                };
                (owner, Value::Null)
            }
        };
        request["frame"] = frame;
        let reply = self.call(owner.target, request, EVALUATE_TIMEOUT)?;
        if let Some(printed) = reply.get("output").and_then(Value::as_str) {
            if !printed.is_empty() {
                self.out.event(
                    "output",
                    Some(json!({"category": "stdout", "output": printed})),
                );
            }
        }
        let mut out = Map::new();
        out.insert(key.into(), text_of(&reply, "result"));
        Session::value_fields(&mut self.state(), &owner, &reply, &mut out);
        Ok(Value::Object(out))
    }

    fn on_disk(&self, target: usize, path: &str) -> Option<PathBuf> {
        if path.is_empty() {
            return None;
        }
        let p = Path::new(path);
        let full = if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.options.targets[target].cwd.as_ref()?.join(p)
        };
        full.is_file().then_some(full)
    }
}

struct Request {
    seq: i64,
    command: String,
    args: Value,
}

fn text<'a>(args: &'a Value, key: &str) -> Result<&'a str, String> {
    args.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("the request has no `{key}`"))
}

fn int(args: &Value, key: &str) -> Result<i64, String> {
    args.get(key)
        .and_then(Value::as_i64)
        .ok_or_else(|| format!("the request has no integer `{key}`"))
}

fn opt_str(args: &Value, key: &str) -> Value {
    match args.get(key).and_then(Value::as_str) {
        Some(s) if !s.is_empty() => s.into(),
        _ => Value::Null,
    }
}

/// The probe's bodies may carry `null` for what is absent; DAP wants the key left out.
/// The number of characters in the first `units` UTF-16 code units of `text`.
fn utf16_to_chars(text: &str, units: usize) -> usize {
    let mut seen = 0;
    text.chars()
        .take_while(|c| {
            seen += c.len_utf16();
            seen <= units
        })
        .count()
}

/// The number of UTF-16 code units in the first `chars` characters of `text`.
fn chars_to_utf16(text: &str, chars: usize) -> usize {
    text.chars().take(chars).map(char::len_utf16).sum()
}

fn strip_nulls(value: &mut Value) {
    if let Value::Object(map) = value {
        map.retain(|_, v| !v.is_null());
        for v in map.values_mut() {
            strip_nulls(v);
        }
    }
}

/// Two strings compared in time that does not depend on where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

enum AttachError {
    Failed(String),
    Refused(String),
}

/// The entries of one breakpoint request, per target: (their index in
/// the request, the probe's entry); and those no target gets, with why.
struct Routed {
    per_target: Vec<Vec<(usize, Value)>>,
    nowhere: Vec<(usize, String)>,
}

impl Routed {
    fn entries(&self, target: usize) -> Vec<&Value> {
        self.per_target[target].iter().map(|(_, e)| e).collect()
    }
}

struct Session {
    shared: Arc<Shared>,
    tx: Sender<Incoming>,
    attached: bool,
    everything_gone: bool,
    /// The editor's `clientID`, passed to the probe.
    client: String,
}

impl Session {
    fn run(&mut self, rx: Receiver<Incoming>) -> Ending {
        let mut deadline: Option<Instant> = None;
        loop {
            let incoming = match deadline {
                None => match rx.recv() {
                    Ok(i) => i,
                    Err(_) => return Ending::ClientGone,
                },
                Some(d) => match rx.recv_timeout(d.saturating_duration_since(Instant::now())) {
                    Ok(i) => i,
                    Err(RecvTimeoutError::Timeout) => return Ending::TargetGone,
                    Err(RecvTimeoutError::Disconnected) => return Ending::TargetGone,
                },
            };
            match incoming {
                Incoming::Message(message) => {
                    if self.shared.options.trace {
                        eprintln!("dap <- {message}");
                    }
                    if let Some(ending) = self.handle(message) {
                        return ending;
                    }
                }
                Incoming::Garbled(why) => self
                    .shared
                    .out
                    .output("console", &format!("rankscope: ignored a message: {why}")),
                Incoming::Closed(None) => {
                    return if self.everything_gone {
                        Ending::TargetGone
                    } else {
                        Ending::ClientGone
                    }
                }
                Incoming::Closed(Some(FramingError::Io(_) | FramingError::Truncated)) => {
                    return Ending::ClientGone
                }
                Incoming::Closed(Some(e)) => return Ending::ProtocolError(e.to_string()),
                Incoming::TargetsGone => {
                    self.everything_gone = true;
                    deadline = Some(Instant::now() + GRACE_AFTER_TERMINATED);
                }
            }
        }
    }

    /// Stops the events threads and detaches every target still attached.
    fn finish(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let sessions: Vec<(usize, i64)> = {
            let mut state = self.shared.state();
            let live = state
                .sessions
                .iter()
                .enumerate()
                .filter_map(|(t, s)| Some((t, (*s)?)))
                .collect();
            state.sessions.iter_mut().for_each(|s| *s = None);
            live
        };
        for (t, session) in sessions {
            let _ = self.shared.backend.call(
                t,
                json!({"op": "detach", "session": session}),
                CALL_TIMEOUT,
            );
        }
    }

    /// Answers one message; `Some` when the session ends with it.
    fn handle(&mut self, message: Value) -> Option<Ending> {
        if message.get("type").and_then(Value::as_str) != Some("request") {
            return None;
        }
        let request = Request {
            seq: message.get("seq").and_then(Value::as_i64).unwrap_or(0),
            command: message
                .get("command")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            args: message.get("arguments").cloned().unwrap_or(Value::Null),
        };
        let shared = self.shared.clone();
        let out = &shared.out;
        match request.command.as_str() {
            "initialize" => {
                let result = self.initialize(&request.args);
                out.respond(&request, result);
            }
            "launch" => out.respond(&request, Err(LAUNCH_REFUSED.into())),
            "disconnect" => {
                self.finish();
                out.respond(&request, Ok(Value::Null));
                return Some(if self.everything_gone {
                    Ending::TargetGone
                } else {
                    Ending::Disconnected
                });
            }
            "attach" => match self.attach(&request.args) {
                Ok(notices) => {
                    out.respond(&request, Ok(Value::Null));
                    out.event("initialized", None);
                    for notice in notices {
                        out.output("console", &notice);
                    }
                    self.start_events();
                }
                Err(AttachError::Failed(why)) => out.respond(&request, Err(why)),
                Err(AttachError::Refused(why)) => {
                    out.respond(&request, Err(why.clone()));
                    return Some(Ending::Refused(why));
                }
            },
            // An expression may run for seconds (a sleep, a slow property, a
            // thread stopped in a native call): `pause`, `threads` and the
            // rest are answered meanwhile, as debugpy does.
            "evaluate" if self.attached => {
                let shared = self.shared.clone();
                std::thread::spawn(move || {
                    let result = shared.evaluate(&request.args);
                    shared.out.respond(&request, result);
                });
            }
            command if !self.attached => out.respond(
                &request,
                Err(format!(
                    "`{command}` before `attach`: rankscope only attaches to a running process"
                )),
            ),
            _ => {
                let result = self.request(&request);
                out.respond(&request, result);
            }
        }
        None
    }

    fn request(&mut self, request: &Request) -> Result<Value, String> {
        let args = &request.args;
        match request.command.as_str() {
            "configurationDone" => Ok(Value::Null),
            "setBreakpoints" => {
                let shared = self.shared.clone();
                shared.updating_breakpoints(|| self.set_breakpoints(args))
            }
            "setFunctionBreakpoints" => {
                let shared = self.shared.clone();
                shared.updating_breakpoints(|| self.set_function_breakpoints(args))
            }
            "setExceptionBreakpoints" => self.set_exception_breakpoints(args),
            "dataBreakpointInfo" => self.data_breakpoint_info(args),
            "setDataBreakpoints" => {
                let shared = self.shared.clone();
                shared.updating_breakpoints(|| self.set_data_breakpoints(args))
            }
            "threads" => self.threads(),
            "stackTrace" => self.stack_trace(args),
            "scopes" => self.scopes(args),
            "variables" => self.variables(args),
            "setVariable" => self.set_variable(args),
            "setExpression" => self.shared.set_expression(args),
            "continue" => self
                .resume(args, "continue")
                .map(|()| json!({"allThreadsContinued": false})),
            "next" => self.resume(args, "next").map(|()| Value::Null),
            "stepIn" => self.resume(args, "step_in").map(|()| Value::Null),
            "stepOut" => self.resume(args, "step_out").map(|()| Value::Null),
            "pause" => self.pause(args),
            "exceptionInfo" => self.exception_info(args),
            "completions" => self.completions(args),
            "modules" => self.modules(args),
            "loadedSources" => self.loaded_sources(),
            "source" => self.source(args),
            other => Err(format!(
                "rankscope dap does not support the `{other}` request"
            )),
        }
    }

    fn initialize(&mut self, args: &Value) -> Result<Value, String> {
        {
            let mut state = self.shared.state();
            state.line_offset = match args.get("linesStartAt1").and_then(Value::as_bool) {
                Some(false) => 1,
                _ => 0,
            };
            state.column = match args.get("columnsStartAt1").and_then(Value::as_bool) {
                Some(false) => 0,
                _ => 1,
            };
        }
        if let Some(client) = args.get("clientID").and_then(Value::as_str) {
            self.client = client.to_string();
        }
        // "raised" is offered only where every target can stop on it. A
        // rank that does not answer is left to `attach` to report.
        let mut raised = true;
        let mut errors = Vec::new();
        for t in 0..self.shared.options.targets.len() {
            match self
                .shared
                .backend
                .call(t, json!({"op": "hello"}), CALL_TIMEOUT)
            {
                Ok(hello) => {
                    raised &= hello
                        .pointer("/features/raised_exceptions")
                        .and_then(Value::as_bool)
                        .unwrap_or(false)
                }
                Err(e) => errors.push(format!(
                    "cannot reach the probe of {}: {e}",
                    self.shared.label(t)
                )),
            }
        }
        if errors.len() == self.shared.options.targets.len() {
            return Err(errors.join("; "));
        }
        let mut filters = vec![json!({
            "filter": "uncaught",
            "label": "Uncaught Exceptions",
            "description": "Stop where an exception is raised that nothing will catch",
            "default": true,
        })];
        if raised {
            filters.push(json!({
                "filter": "raised",
                "label": "Raised Exceptions",
                "description": "Stop wherever an exception is raised, caught or not",
                "default": false,
            }));
        }
        Ok(json!({
            "supportsConfigurationDoneRequest": true,
            "supportsConditionalBreakpoints": true,
            "supportsHitConditionalBreakpoints": true,
            "supportsLogPoints": true,
            "supportsFunctionBreakpoints": true,
            "supportsSetVariable": true,
            "supportsEvaluateForHovers": true,
            "supportsDelayedStackTraceLoading": true,
            "supportsDataBreakpoints": true,
            "supportsExceptionInfoRequest": true,
            "supportsCompletionsRequest": true,
            "supportsModulesRequest": true,
            "supportsSetExpression": true,
            "supportsLoadedSourcesRequest": true,
            "completionTriggerCharacters": ["."],
            "exceptionBreakpointFilters": filters,
            "supportTerminateDebuggee": false,
            "supportsTerminateRequest": false,
            "supportsRestartRequest": false,
            "supportsStepBack": false,
        }))
    }

    /// Attaches every target; the notices to show once the client knows.
    fn attach(&mut self, args: &Value) -> Result<Vec<String>, AttachError> {
        if self.attached {
            return Err(AttachError::Failed("already attached".into()));
        }
        let options = &self.shared.options;
        if let Some(token) = &options.token {
            let given = args
                .get("rankscopeToken")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !same_secret(given, token) {
                let why = if given.is_empty() {
                    "this rankscope dap needs its token: put it in the attach configuration as \"rankscopeToken\""
                } else {
                    "wrong \"rankscopeToken\" in the attach configuration"
                };
                return Err(AttachError::Refused(why.into()));
            }
        }
        // debugpy's configurations say "DebugStdLib" for justMyCode false.
        let std_lib = args
            .get("debugOptions")
            .and_then(Value::as_array)
            .is_some_and(|o| o.iter().any(|v| v.as_str() == Some("DebugStdLib")));
        let just_my_code = args
            .get("justMyCode")
            .and_then(Value::as_bool)
            .unwrap_or(!std_lib);
        let mut mappings = args.get("pathMappings").cloned().unwrap_or(Value::Null);
        // The older debugpy form: localRoot and remoteRoot beside the rest.
        if let (Some(l), Some(r)) = (args.get("localRoot"), args.get("remoteRoot")) {
            let legacy = json!({"localRoot": l, "remoteRoot": r});
            match &mut mappings {
                Value::Array(list) => list.push(legacy),
                _ => mappings = json!([legacy]),
            }
        }
        let mut paths = Vec::new();
        for target in &options.targets {
            paths.push(
                PathMap::from_json(Some(&mappings), target.cwd.as_deref())
                    .map_err(AttachError::Failed)?,
            );
        }
        let mut notices = options.notices.clone();
        let mut failures = Vec::new();
        let mut sessions = Vec::new();
        for t in 0..options.targets.len() {
            let request = json!({
                "op": "attach",
                "client": self.client,
                "lease_s": options.lease.as_secs_f64(),
                "just_my_code": just_my_code,
            });
            match self.shared.backend.call(t, request, CALL_TIMEOUT) {
                Ok(reply) => match reply.get("session").and_then(Value::as_i64) {
                    Some(s) => sessions.push((t, s)),
                    None => failures.push(self.shared.labelled(
                        t,
                        format!("the probe's attach answer has no session: {reply}"),
                    )),
                },
                Err(e) => failures.push(self.shared.labelled(t, e.to_string())),
            }
        }
        if sessions.is_empty() {
            return Err(AttachError::Failed(failures.join("; ")));
        }
        for failure in failures {
            notices.push(format!("rankscope: not attached to {failure}"));
        }
        let mut state = self.shared.state();
        state.paths = paths;
        for (t, s) in sessions {
            state.sessions[t] = Some(s);
        }
        self.attached = true;
        Ok(notices)
    }

    fn start_events(&self) {
        let live: Vec<usize> = self
            .shared
            .state()
            .sessions
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(t, _)| t)
            .collect();
        for t in live {
            let shared = self.shared.clone();
            let tx = self.tx.clone();
            std::thread::Builder::new()
                .name(format!("dap-events-{t}"))
                .spawn(move || events_loop(&shared, t, &tx))
                .expect("cannot start a DAP events thread");
        }
    }

    fn thread(&self, args: &Value) -> Result<(i64, usize, i64), String> {
        let id = int(args, "threadId")?;
        let state = self.shared.state();
        let &(target, probe) = state
            .threads
            .key(id)
            .ok_or_else(|| format!("no thread {id} (ask `threads` again)"))?;
        Ok((id, target, probe))
    }

    fn frame(&self, id: i64) -> Result<Handle, String> {
        self.shared.frame(id)
    }

    fn reference(&self, args: &Value) -> Result<Handle, String> {
        let id = int(args, "variablesReference")?;
        self.shared
            .state()
            .refs
            .get(id)
            .ok_or_else(|| format!("variables reference {id} is gone: its thread has run on since"))
    }

    /// Where each entry of a breakpoint request goes. With every target
    /// a rank, a condition's clauses that name ranks ([`RankCondition`])
    /// pick the targets, and the probe gets the rest of it; otherwise every
    /// target gets every entry as written. `probe_entry` makes the probe's
    /// entry from the DAP one and the condition to send.
    fn route(&self, entries: &[Value], probe_entry: impl Fn(&Value, Value) -> Value) -> Routed {
        let targets = &self.shared.options.targets;
        let ranked = targets.iter().all(|t| t.rank.is_some());
        let mut routed = Routed {
            per_target: vec![Vec::new(); targets.len()],
            nowhere: Vec::new(),
        };
        for (i, entry) in entries.iter().enumerate() {
            let condition = opt_str(entry, "condition");
            let by_rank = condition
                .as_str()
                .filter(|_| ranked)
                .and_then(RankCondition::parse);
            let Some(by_rank) = by_rank else {
                for list in &mut routed.per_target {
                    list.push((i, probe_entry(entry, condition.clone())));
                }
                continue;
            };
            let rest = by_rank.rest.clone().map_or(Value::Null, Value::from);
            let mut sent = false;
            for (t, target) in targets.iter().enumerate() {
                if target.rank.is_some_and(|r| by_rank.matches(r)) {
                    routed.per_target[t].push((i, probe_entry(entry, rest.clone())));
                    sent = true;
                }
            }
            if !sent {
                let ranks: Vec<String> = targets
                    .iter()
                    .filter_map(|t| t.rank)
                    .map(|r| r.to_string())
                    .collect();
                routed.nowhere.push((
                    i,
                    format!(
                        "no rank of this session has `{}` (it debugs rank{} {})",
                        by_rank.ranks_text,
                        if ranks.len() == 1 { "" } else { "s" },
                        ranks.join(", ")
                    ),
                ));
            }
        }
        routed
    }

    /// Probe breakpoint replies (one per target, each a list in the order
    /// of what it was sent) merged into one DAP breakpoint per request
    /// entry. Lines are the probe's (from 1) until the end.
    fn merge_breakpoints(
        &self,
        group: &str,
        count: usize,
        routed: &Routed,
        replies: Vec<(usize, Result<Value, String>)>,
        requested_lines: Option<&[i64]>,
    ) -> Result<Vec<Value>, String> {
        some_answered(&replies)?;
        let mut parts = vec![Vec::new(); count];
        let mut merged = vec![json!({"verified": false}); count];
        let mut messages: Vec<Vec<String>> = vec![Vec::new(); count];
        for (t, reply) in &replies {
            let sent = &routed.per_target[*t];
            let list = match reply {
                Ok(v) => v
                    .get("breakpoints")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
                Err(e) => {
                    for (i, _) in sent {
                        messages[*i].push(e.clone());
                    }
                    continue;
                }
            };
            for (&(i, _), bp) in sent.iter().zip(&list) {
                if let Some(id) = bp.get("id").and_then(Value::as_i64) {
                    parts[i].push((*t, id));
                }
                let verified = bp.get("verified").and_then(Value::as_bool).unwrap_or(false);
                if verified && merged[i]["verified"] != true {
                    merged[i]["verified"] = true.into();
                    if let Some(line) = bp.get("line").and_then(Value::as_i64) {
                        merged[i]["line"] = line.into();
                    }
                }
                if merged[i].get("line").is_none() {
                    if let Some(line) = bp.get("line").and_then(Value::as_i64) {
                        merged[i]["line"] = line.into();
                    }
                }
                if let Some(m) = bp.get("message").and_then(Value::as_str) {
                    messages[i].push(self.shared.labelled(*t, m.to_string()));
                }
            }
        }
        for (i, why) in &routed.nowhere {
            messages[*i].push(why.clone());
        }
        let mut state = self.shared.state();
        let ids = state.bps.replace(group, parts);
        let offset = state.line_offset;
        for (i, bp) in merged.iter_mut().enumerate() {
            if let Some(id) = ids[i] {
                bp["id"] = id.into();
            }
            if bp.get("line").is_none() {
                if let Some(line) = requested_lines.and_then(|l| l.get(i)) {
                    bp["line"] = (*line).into();
                }
            }
            if let Some(line) = bp.get("line").and_then(Value::as_i64) {
                bp["line"] = (line - offset).into();
            }
            if !messages[i].is_empty() {
                bp["message"] = messages[i].join("; ").into();
            }
        }
        Ok(merged)
    }

    fn set_breakpoints(&mut self, args: &Value) -> Result<Value, String> {
        let source = args.get("source").cloned().unwrap_or_else(|| json!({}));
        let entries: Vec<Value> = match args.get("breakpoints").and_then(Value::as_array) {
            Some(list) => list.clone(),
            // The deprecated form: bare line numbers.
            None => args
                .get("lines")
                .and_then(Value::as_array)
                .map(|l| l.iter().map(|n| json!({"line": n})).collect())
                .unwrap_or_default(),
        };
        let Some(local) = source.get("path").and_then(Value::as_str) else {
            let unverified: Vec<Value> = entries
                .iter()
                .map(|_| json!({"verified": false, "message": "only files on disk can have breakpoints"}))
                .collect();
            return Ok(json!({"breakpoints": unverified}));
        };
        let offset = self.shared.state().line_offset;
        let lines: Vec<i64> = entries
            .iter()
            .map(|e| e.get("line").and_then(Value::as_i64).unwrap_or(0) + offset)
            .collect();
        let routed = self.route(&entries, |e, condition| {
            json!({
                "line": e.get("line").and_then(Value::as_i64).unwrap_or(0) + offset,
                "condition": condition,
                "hit_condition": opt_str(e, "hitCondition"),
                "log_message": opt_str(e, "logMessage"),
            })
        });
        let remote: Vec<String> = {
            let state = self.shared.state();
            state.paths.iter().map(|p| p.to_remote(local)).collect()
        };
        // Every target gets its list, an empty one too: that clears what it had.
        let replies = self.shared.each_target(
            |t| json!({"op": "set_breakpoints", "path": remote[t], "breakpoints": routed.entries(t)}),
            CALL_TIMEOUT,
        );
        let mut merged = self.merge_breakpoints(
            &format!("line:{local}"),
            entries.len(),
            &routed,
            replies,
            Some(&lines),
        )?;
        for bp in &mut merged {
            bp["source"] = source.clone();
        }
        Ok(json!({"breakpoints": merged}))
    }

    fn set_function_breakpoints(&mut self, args: &Value) -> Result<Value, String> {
        let entries = args
            .get("breakpoints")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let routed = self.route(&entries, |e, condition| {
            json!({
                "name": e.get("name").and_then(Value::as_str).unwrap_or_default(),
                "condition": condition,
                "hit_condition": opt_str(e, "hitCondition"),
            })
        });
        let replies = self.shared.each_target(
            |t| json!({"op": "set_function_breakpoints", "breakpoints": routed.entries(t)}),
            CALL_TIMEOUT,
        );
        let merged = self.merge_breakpoints("function", entries.len(), &routed, replies, None)?;
        Ok(json!({"breakpoints": merged}))
    }

    fn set_exception_breakpoints(&mut self, args: &Value) -> Result<Value, String> {
        let filters = args
            .get("filters")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let replies = self.shared.each_target(
            |_| json!({"op": "set_exception_breakpoints", "filters": filters}),
            CALL_TIMEOUT,
        );
        // Exception filters have no ids: only whether each took.
        some_answered(&replies)?;
        let mut merged = vec![json!({"verified": true}); filters.len()];
        for (t, reply) in &replies {
            let Ok(reply) = reply else { continue };
            let list = reply.get("breakpoints").and_then(Value::as_array);
            for (i, bp) in list.into_iter().flatten().take(filters.len()).enumerate() {
                if bp.get("verified").and_then(Value::as_bool) == Some(false) {
                    merged[i]["verified"] = false.into();
                }
                if let Some(m) = bp.get("message").and_then(Value::as_str) {
                    merged[i]["message"] = self.shared.labelled(*t, m.to_string()).into();
                }
            }
        }
        Ok(json!({"breakpoints": merged}))
    }

    /// A data id names its target in a `--job` session; with one target it
    /// is the probe's own.
    fn encode_data_id(&self, target: usize, id: &str) -> String {
        if self.shared.is_job() {
            format!("{target}|{id}")
        } else {
            id.to_string()
        }
    }

    fn decode_data_id<'a>(&self, id: &'a str) -> Option<(usize, &'a str)> {
        if !self.shared.is_job() {
            return Some((0, id));
        }
        let (t, rest) = id.split_once('|')?;
        let t: usize = t.parse().ok()?;
        (t < self.shared.options.targets.len()).then_some((t, rest))
    }

    fn data_breakpoint_info(&mut self, args: &Value) -> Result<Value, String> {
        let name = args.get("name").and_then(Value::as_str).unwrap_or_default();
        if args
            .get("variablesReference")
            .and_then(Value::as_i64)
            .unwrap_or(0)
            == 0
        {
            return Ok(json!({
                "dataId": null,
                "description": "a data breakpoint is set on a variable of the Variables view",
            }));
        }
        let handle = self.reference(args)?;
        let mut reply = self.shared.call(
            handle.target,
            json!({"op": "data_breakpoint_info", "ref": handle.probe, "name": name}),
            CALL_TIMEOUT,
        )?;
        let data_id = reply
            .get("dataId")
            .and_then(Value::as_str)
            .map(|id| self.encode_data_id(handle.target, id));
        reply["dataId"] = data_id.map(Value::from).unwrap_or(Value::Null);
        if reply.get("description").and_then(Value::as_str).is_none() {
            reply["description"] = name.into();
        }
        if let Some(map) = reply.as_object_mut() {
            map.retain(|k, v| k == "dataId" || !v.is_null());
        }
        Ok(reply)
    }

    fn set_data_breakpoints(&mut self, args: &Value) -> Result<Value, String> {
        let entries = args
            .get("breakpoints")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let targets = self.shared.options.targets.len();
        // Per target: the entries it gets, and where each sits in the request.
        let mut per_target: Vec<Vec<(usize, Value)>> = vec![Vec::new(); targets];
        let mut unknown = Vec::new();
        let mut other_rank = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let id = e.get("dataId").and_then(Value::as_str).unwrap_or_default();
            let Some((t, probe_id)) = self.decode_data_id(id) else {
                unknown.push(i);
                continue;
            };
            // A data breakpoint is on one rank already: a condition that
            // names ranks is decided here, as for line breakpoints.
            let mut condition = opt_str(e, "condition");
            let rank = self.shared.options.targets[t].rank;
            if let (Some(rank), Some(by_rank)) =
                (rank, condition.as_str().and_then(RankCondition::parse))
            {
                if !by_rank.matches(rank) {
                    other_rank.push((
                        i,
                        format!("rank {rank} does not have `{}`", by_rank.ranks_text),
                    ));
                    continue;
                }
                condition = by_rank.rest.map_or(Value::Null, Value::from);
            }
            per_target[t].push((
                i,
                json!({
                    "dataId": probe_id,
                    "condition": condition,
                    "hit_condition": opt_str(e, "hitCondition"),
                }),
            ));
        }
        // Every target gets its list, empty ones too: that clears what it had.
        let replies = self.shared.each_target(
            |t| {
                let list: Vec<&Value> = per_target[t].iter().map(|(_, v)| v).collect();
                json!({"op": "set_data_breakpoints", "breakpoints": list})
            },
            CALL_TIMEOUT,
        );
        let answered = replies.len();
        let mut parts = vec![Vec::new(); entries.len()];
        let mut merged = vec![json!({"verified": false}); entries.len()];
        for i in unknown {
            merged[i]["message"] = "unknown dataId".into();
        }
        for (i, why) in other_rank {
            merged[i]["message"] = why.into();
        }
        let mut errors = Vec::new();
        for (t, reply) in replies {
            match reply {
                Ok(reply) => {
                    let list = reply
                        .get("breakpoints")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    for ((i, _), bp) in per_target[t].iter().zip(list) {
                        if let Some(id) = bp.get("id").and_then(Value::as_i64) {
                            parts[*i].push((t, id));
                        }
                        merged[*i]["verified"] = bp
                            .get("verified")
                            .and_then(Value::as_bool)
                            .unwrap_or(false)
                            .into();
                        if let Some(m) = bp.get("message").and_then(Value::as_str) {
                            merged[*i]["message"] = m.into();
                        }
                    }
                }
                Err(e) => {
                    for (i, _) in &per_target[t] {
                        merged[*i]["message"] = e.clone().into();
                    }
                    errors.push(e);
                }
            }
        }
        if answered == 0 {
            return Err("the process has exited".into());
        }
        if !entries.is_empty() && errors.len() == answered {
            return Err(errors.join("; "));
        }
        let ids = self.shared.state().bps.replace("data", parts);
        for (bp, id) in merged.iter_mut().zip(ids) {
            if let Some(id) = id {
                bp["id"] = id.into();
            }
        }
        Ok(json!({"breakpoints": merged}))
    }

    fn threads(&mut self) -> Result<Value, String> {
        let replies = self
            .shared
            .each_target(|_| json!({"op": "threads"}), CALL_TIMEOUT);
        let mut errors = Vec::new();
        let mut threads = Vec::new();
        let total = replies.len();
        for (t, reply) in replies {
            let reply = match reply {
                Ok(r) => r,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            let list = reply
                .get("threads")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let mut state = self.shared.state();
            for thread in list {
                let Some(probe) = thread.get("id").and_then(Value::as_i64) else {
                    continue;
                };
                let name = thread
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("thread");
                let name = if self.shared.is_job() {
                    format!("{} / {name}", self.shared.label(t))
                } else {
                    name.to_string()
                };
                threads.push(json!({"id": state.threads.id((t, probe)), "name": name}));
            }
        }
        if total > 0 && errors.len() == total {
            return Err(errors.join("; "));
        }
        // A rank that did not answer must not hide the others' threads.
        for e in errors {
            self.shared
                .out
                .output("console", &format!("rankscope: no threads from {e}"));
        }
        Ok(json!({"threads": threads}))
    }

    fn stack_trace(&mut self, args: &Value) -> Result<Value, String> {
        let (thread, target, probe_thread) = self.thread(args)?;
        let start = args.get("startFrame").and_then(Value::as_i64).unwrap_or(0);
        let levels = args.get("levels").and_then(Value::as_i64).unwrap_or(0);
        let reply = self.shared.call(
            target,
            json!({"op": "stack", "thread": probe_thread, "start": start, "levels": levels}),
            CALL_TIMEOUT,
        )?;
        let frames = reply
            .get("frames")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        // Whether each file is here is asked before the lock is taken.
        let paths: Vec<(String, bool)> = frames
            .iter()
            .map(|f| {
                let path = f.get("path").and_then(Value::as_str).unwrap_or_default();
                (
                    path.to_string(),
                    self.shared.on_disk(target, path).is_some(),
                )
            })
            .collect();
        let mut state = self.shared.state();
        let mut out = Vec::with_capacity(frames.len());
        for (frame, (path, here)) in frames.iter().zip(paths) {
            let Some(probe_id) = frame.get("id").and_then(Value::as_i64) else {
                continue;
            };
            let id = state.frames.id(target, probe_id, Some(thread));
            let line = frame.get("line").and_then(Value::as_i64).unwrap_or(1);
            let mut dap = json!({
                "id": id,
                "name": frame.get("name").and_then(Value::as_str).unwrap_or("?"),
                "line": (line - state.line_offset).max(0),
                "column": state.column,
            });
            if here {
                let name = Path::new(&path)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| path.clone());
                dap["source"] = json!({"name": name, "path": state.paths[target].to_local(&path)});
            } else if !path.is_empty() {
                // `<string>`, `<frozen ...>`, a file deleted since: the
                // editor asks the probe for the text through `source`.
                let reference = state.sources.id((target, path.clone()));
                dap["source"] = json!({"name": path, "sourceReference": reference});
            }
            if frame.get("subtle").and_then(Value::as_bool) == Some(true) {
                dap["presentationHint"] = "subtle".into();
            }
            out.push(dap);
        }
        let mut body = json!({"stackFrames": out});
        if let Some(total) = reply.get("total").and_then(Value::as_i64) {
            body["totalFrames"] = total.into();
        }
        Ok(body)
    }

    fn scopes(&mut self, args: &Value) -> Result<Value, String> {
        let frame = self.frame(int(args, "frameId")?)?;
        let reply = self.shared.call(
            frame.target,
            json!({"op": "scopes", "frame": frame.probe}),
            CALL_TIMEOUT,
        )?;
        let mut state = self.shared.state();
        let scopes: Vec<Value> = reply
            .get("scopes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|s| {
                let name = s.get("name").and_then(Value::as_str).unwrap_or("?");
                let r = s.get("ref").and_then(Value::as_i64).unwrap_or(0);
                let mut scope = json!({
                    "name": name,
                    "variablesReference": if r == 0 { 0 } else { state.refs.id(frame.target, r, frame.thread) },
                    "expensive": s.get("expensive").and_then(Value::as_bool).unwrap_or(false),
                });
                if let Some(n) = s.get("named").and_then(Value::as_i64) {
                    scope["namedVariables"] = n.into();
                }
                if name == "Locals" {
                    scope["presentationHint"] = "locals".into();
                }
                scope
            })
            .collect();
        Ok(json!({"scopes": scopes}))
    }

    /// A probe value (`ref` 0: no children) as the DAP fields that carry it.
    fn value_fields(state: &mut State, owner: &Handle, v: &Value, into: &mut Map<String, Value>) {
        let r = v.get("ref").and_then(Value::as_i64).unwrap_or(0);
        let reference = if r == 0 {
            0
        } else {
            state.refs.id(owner.target, r, owner.thread)
        };
        into.insert("variablesReference".into(), reference.into());
        if let Some(t) = v.get("type").and_then(Value::as_str) {
            into.insert("type".into(), t.into());
        }
        if let Some(n) = v.get("named").and_then(Value::as_i64) {
            into.insert("namedVariables".into(), n.into());
        }
        if let Some(n) = v.get("indexed").and_then(Value::as_i64) {
            into.insert("indexedVariables".into(), n.into());
        }
    }

    fn variables(&mut self, args: &Value) -> Result<Value, String> {
        let handle = self.reference(args)?;
        let filter = match args.get("filter").and_then(Value::as_str) {
            Some(f @ ("named" | "indexed")) => Value::from(f),
            _ => Value::Null,
        };
        let reply = self.shared.call(
            handle.target,
            json!({
                "op": "variables",
                "ref": handle.probe,
                "start": args.get("start").and_then(Value::as_i64).unwrap_or(0),
                "count": args.get("count").and_then(Value::as_i64).unwrap_or(0),
                "filter": filter,
            }),
            CALL_TIMEOUT,
        )?;
        let mut state = self.shared.state();
        let variables: Vec<Value> = reply
            .get("variables")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|v| {
                let mut out = Map::new();
                out.insert(
                    "name".into(),
                    v.get("name").and_then(Value::as_str).unwrap_or("?").into(),
                );
                out.insert(
                    "value".into(),
                    v.get("value").and_then(Value::as_str).unwrap_or("").into(),
                );
                Self::value_fields(&mut state, &handle, v, &mut out);
                if let Some(e) = v.get("evaluate_name").and_then(Value::as_str) {
                    out.insert("evaluateName".into(), e.into());
                }
                Value::Object(out)
            })
            .collect();
        Ok(json!({"variables": variables}))
    }

    fn set_variable(&mut self, args: &Value) -> Result<Value, String> {
        let handle = self.reference(args)?;
        let name = text(args, "name")?;
        let value = text(args, "value")?;
        let reply = self.shared.call(
            handle.target,
            json!({"op": "set_variable", "ref": handle.probe, "name": name, "value": value}),
            CALL_TIMEOUT,
        )?;
        let mut out = Map::new();
        out.insert("value".into(), text_of(&reply, "value"));
        Self::value_fields(&mut self.shared.state(), &handle, &reply, &mut out);
        Ok(Value::Object(out))
    }

    fn resume(&mut self, args: &Value, op: &str) -> Result<(), String> {
        let (thread, target, probe_thread) = self.thread(args)?;
        self.shared.call(
            target,
            json!({"op": op, "thread": probe_thread}),
            CALL_TIMEOUT,
        )?;
        let mut state = self.shared.state();
        state.frames.forget_thread(thread);
        state.refs.forget_thread(thread);
        let held = &mut state.held[target];
        held.threads.remove(&thread);
        if op == "continue" && held.threads.is_empty() {
            held.since = None;
            held.told = None;
        }
        Ok(())
    }

    /// Every target's modules (name, path, version, whether the user wrote
    /// it), sorted by name: a job's are named per rank.
    fn all_modules(&self) -> Result<Vec<(usize, Value)>, String> {
        let replies = self
            .shared
            .each_target(|_| json!({"op": "modules"}), CALL_TIMEOUT);
        some_answered(&replies)?;
        let mut out = Vec::new();
        for (target, reply) in replies {
            let Ok(reply) = reply else { continue };
            if let Some(modules) = reply.get("modules").and_then(Value::as_array) {
                out.extend(modules.iter().map(|m| (target, m.clone())));
            }
        }
        Ok(out)
    }

    fn modules(&mut self, args: &Value) -> Result<Value, String> {
        let all = self.all_modules()?;
        let start = args.get("startModule").and_then(Value::as_u64).unwrap_or(0) as usize;
        let count = match args.get("moduleCount").and_then(Value::as_u64) {
            Some(n) if n > 0 => n as usize,
            _ => usize::MAX,
        };
        let state = self.shared.state();
        let modules: Vec<Value> = all
            .iter()
            .skip(start)
            .take(count)
            .map(|(target, m)| {
                let name = m.get("name").and_then(Value::as_str).unwrap_or("?");
                let id = if self.shared.is_job() {
                    format!("{}/{name}", self.shared.label(*target))
                } else {
                    name.to_string()
                };
                let mut module = json!({"id": id, "name": name});
                if let Some(path) = m.get("path").and_then(Value::as_str) {
                    module["path"] = state.paths[*target].to_local(path).into();
                }
                if let Some(user) = m.get("user").and_then(Value::as_bool) {
                    module["isUserCode"] = user.into();
                }
                if let Some(version) = m.get("version").and_then(Value::as_str) {
                    module["version"] = version.into();
                }
                module
            })
            .collect();
        Ok(json!({"modules": modules, "totalModules": all.len()}))
    }

    /// The source files of the loaded modules, each once.
    fn loaded_sources(&mut self) -> Result<Value, String> {
        let all = self.all_modules()?;
        let state = self.shared.state();
        let mut seen = std::collections::BTreeMap::new();
        for (target, m) in &all {
            let Some(path) = m.get("path").and_then(Value::as_str) else {
                continue;
            };
            if !path.ends_with(".py") {
                continue;
            }
            let local = state.paths[*target].to_local(path);
            let name = Path::new(&local)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| local.clone());
            seen.entry(local.clone())
                .or_insert_with(|| json!({"name": name, "path": local}));
        }
        Ok(json!({"sources": seen.into_values().collect::<Vec<_>>()}))
    }

    /// The Debug Console's completions at the cursor. DAP counts `column`
    /// and each target's `start` from the client's column base; the probe
    /// from 0. A multi-line text completes on its `line`.
    fn completions(&mut self, args: &Value) -> Result<Value, String> {
        let text = text(args, "text")?;
        let base = self.shared.state().column;
        let column = int(args, "column")? - base;
        let line_base = 1 - self.shared.state().line_offset;
        let line = args
            .get("line")
            .and_then(Value::as_i64)
            .map_or(0, |l| (l - line_base).max(0) as usize);
        let text = text.split('\n').nth(line).unwrap_or_default();
        let (target, frame) = match args.get("frameId").and_then(Value::as_i64) {
            Some(id) => {
                let f = self.frame(id)?;
                (f.target, Value::from(f.probe))
            }
            None => (self.shared.state().last_stop_target, Value::Null),
        };
        // The probe counts characters; DAP counts UTF-16 code units.
        let offset = utf16_to_chars(text, column.max(0) as usize);
        let reply = self.shared.call(
            target,
            json!({"op": "completions", "text": text, "offset": offset, "frame": frame}),
            EVALUATE_TIMEOUT,
        )?;
        let targets: Vec<Value> = reply
            .get("targets")
            .and_then(Value::as_array)
            .map(|targets| {
                targets
                    .iter()
                    .map(|t| {
                        let mut t = t.clone();
                        let start = t["start"].as_u64().unwrap_or(0) as usize;
                        t["start"] = (chars_to_utf16(text, start) as i64 + base).into();
                        t
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(json!({ "targets": targets }))
    }

    /// The exception a thread stopped on, for the editor's exception widget;
    /// the probe made the body when the thread stopped.
    fn exception_info(&mut self, args: &Value) -> Result<Value, String> {
        let (_, target, probe_thread) = self.thread(args)?;
        let mut body = self.shared.call(
            target,
            json!({"op": "exception_info", "thread": probe_thread}),
            CALL_TIMEOUT,
        )?;
        strip_nulls(&mut body);
        Ok(body)
    }

    fn pause(&mut self, args: &Value) -> Result<Value, String> {
        let (_, target, probe_thread) = self.thread(args)?;
        self.shared.call(
            target,
            json!({"op": "pause", "thread": probe_thread}),
            CALL_TIMEOUT,
        )?;
        Ok(Value::Null)
    }

    fn source(&mut self, args: &Value) -> Result<Value, String> {
        let reference = args
            .get("sourceReference")
            .and_then(Value::as_i64)
            .filter(|&r| r > 0)
            .or_else(|| {
                args.pointer("/source/sourceReference")
                    .and_then(Value::as_i64)
                    .filter(|&r| r > 0)
            });
        let (target, path) = match reference {
            Some(r) => self
                .shared
                .state()
                .sources
                .key(r)
                .cloned()
                .ok_or_else(|| format!("no source {r}"))?,
            None => {
                let local = args
                    .pointer("/source/path")
                    .and_then(Value::as_str)
                    .ok_or("the request names no source")?;
                let state = self.shared.state();
                let target = state.last_stop_target;
                (target, state.paths[target].to_remote(local))
            }
        };
        let reply =
            self.shared
                .call(target, json!({"op": "source", "path": path}), CALL_TIMEOUT)?;
        let content = reply
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("the probe has no text for {path}"))?;
        Ok(json!({"content": content, "mimeType": "text/x-python"}))
    }
}

/// Long-polls one target's probe until the session stops or the target is gone.
fn events_loop(shared: &Shared, target: usize, tx: &Sender<Incoming>) {
    let wait = shared.options.events_wait;
    let mut after: i64 = 0;
    let mut last_answer = Instant::now();
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Some(session) = shared.state().sessions[target] else {
            return;
        };
        let request = json!({
            "op": "events",
            "session": session,
            "after": after,
            "wait_s": wait.as_secs_f64(),
        });
        let answer = shared
            .backend
            .call(target, request, wait + Duration::from_secs(5));
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        match answer {
            Ok(reply) => {
                last_answer = Instant::now();
                for event in reply
                    .get("events")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if let Some(seq) = event.get("seq").and_then(Value::as_i64) {
                        after = after.max(seq);
                    }
                    forward_event(shared, target, event);
                }
                // Ended on the probe's side while we waited (a new client
                // took over a lapsed session).
                if reply.get("closed").and_then(Value::as_bool) == Some(true) {
                    let why = format!(
                        "the probe of {} ended the debug session",
                        shared.label(target)
                    );
                    return target_gone(shared, target, &why, tx);
                }
            }
            Err(BackendError::Gone(why)) => {
                // The reason is a failed connection: worth a trace only.
                if shared.options.trace {
                    eprintln!("dap: {} is gone: {why}", shared.label(target));
                }
                let exited = format!("{} exited", shared.label(target));
                return target_gone(shared, target, &exited, tx);
            }
            Err(BackendError::Failed(why)) if why.starts_with("no such debug session") => {
                return target_gone(
                    shared,
                    target,
                    &format!(
                        "the probe of {} ended the debug session: {why}",
                        shared.label(target)
                    ),
                    tx,
                );
            }
            Err(BackendError::Failed(why)) => {
                // A thread holding the GIL in native code delays the probe;
                // past the lease the probe has dropped the session anyway.
                if last_answer.elapsed() > shared.options.lease {
                    return target_gone(
                        shared,
                        target,
                        &format!("lost the probe of {}: {why}", shared.label(target)),
                        tx,
                    );
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

fn target_gone(shared: &Shared, target: usize, why: &str, tx: &Sender<Incoming>) {
    let (exited_threads, all_gone) = {
        let mut state = shared.state();
        state.sessions[target] = None;
        state.held[target] = Held::default();
        state.frames.forget_target(target);
        state.refs.forget_target(target);
        let threads: Vec<i64> = state
            .threads
            .keys()
            .filter(|(_, (t, _))| *t == target)
            .map(|(id, _)| id)
            .collect();
        (threads, state.sessions.iter().all(Option::is_none))
    };
    shared.out.output("console", &format!("rankscope: {why}"));
    if all_gone {
        shared.out.event("terminated", None);
        let _ = tx.send(Incoming::TargetsGone);
    } else {
        for id in exited_threads {
            shared
                .out
                .event("thread", Some(json!({"reason": "exited", "threadId": id})));
        }
    }
}

/// One probe event as the DAP event the editor gets: ids made the
/// adapter's, paths the editor's, a `--job` session's rank named.
fn forward_event(shared: &Shared, target: usize, event: &Value) {
    let Some(name) = event.get("event").and_then(Value::as_str) else {
        return;
    };
    let mut body = event.get("body").cloned().unwrap_or_else(|| json!({}));
    strip_nulls(&mut body);
    // The probe's own part of a stop (its job's collectives), not DAP's.
    let collectives = body
        .as_object_mut()
        .and_then(|b| b.remove("collectives"))
        .unwrap_or(Value::Null);
    let mut notice = None;
    let names_breakpoints = match name {
        "stopped" => body.get("hitBreakpointIds").is_some(),
        "breakpoint" => true,
        _ => false,
    };
    if names_breakpoints {
        shared.wait_for_breakpoint_ids();
    }
    let job = shared.is_job();
    let label = shared.label(target);
    {
        let mut guard = shared.state();
        let state: &mut State = &mut guard;
        let offset = state.line_offset;
        let thread_id = |state: &mut State, body: &mut Value| -> Option<i64> {
            let probe = body.get("threadId").and_then(Value::as_i64)?;
            let id = state.threads.id((target, probe));
            body["threadId"] = id.into();
            Some(id)
        };
        match name {
            "stopped" => {
                if let Some(id) = thread_id(state, &mut body) {
                    // A new stop hands out new probe ids.
                    state.frames.forget_thread(id);
                    state.refs.forget_thread(id);
                    state.held[target].threads.insert(id);
                }
                let held = &mut state.held[target];
                let since = *held.since.get_or_insert_with(Instant::now);
                if held.told.is_none_or(|t| t.elapsed() >= RETELL_HOLD) {
                    notice = collective_notice(
                        &label,
                        job,
                        &collectives,
                        since.elapsed(),
                        SystemTime::now(),
                    );
                    if notice.is_some() {
                        held.told = Some(Instant::now());
                    }
                }
                state.last_stop_target = target;
                if let Some(hits) = body.get("hitBreakpointIds").and_then(Value::as_array) {
                    let mapped: Vec<i64> = hits
                        .iter()
                        .filter_map(Value::as_i64)
                        .filter_map(|probe| state.bps.dap_id(target, probe))
                        .collect();
                    body["hitBreakpointIds"] = mapped.into();
                }
                body["allThreadsStopped"] = false.into();
                if job {
                    let description = match body.get("description").and_then(Value::as_str) {
                        Some(d) => format!("{label}: {d}"),
                        None => label.clone(),
                    };
                    body["description"] = description.into();
                }
            }
            "continued" => {
                if let Some(id) = thread_id(state, &mut body) {
                    state.frames.forget_thread(id);
                    state.refs.forget_thread(id);
                }
            }
            "thread" => {
                thread_id(state, &mut body);
            }
            "output" => {
                if let Some(path) = body.pointer("/source/path").and_then(Value::as_str) {
                    let local = state.paths[target].to_local(path);
                    body["source"]["path"] = local.into();
                }
                if let Some(line) = body.get("line").and_then(Value::as_i64) {
                    body["line"] = (line - offset).into();
                }
                if job {
                    if let Some(text) = body.get("output").and_then(Value::as_str) {
                        body["output"] = format!("[{label}] {text}").into();
                    }
                }
            }
            "breakpoint" => {
                let probe = body.pointer("/breakpoint/id").and_then(Value::as_i64);
                // Not one of this session's (or no longer set): the editor
                // has nothing to update.
                let Some(id) = probe.and_then(|p| state.bps.dap_id(target, p)) else {
                    return;
                };
                body["breakpoint"]["id"] = id.into();
                if job {
                    if let Some(m) = body.pointer("/breakpoint/message").and_then(Value::as_str) {
                        body["breakpoint"]["message"] = format!("{label}: {m}").into();
                    }
                }
                if let Some(line) = body.pointer("/breakpoint/line").and_then(Value::as_i64) {
                    body["breakpoint"]["line"] = (line - offset).into();
                }
                if let Some(path) = body
                    .pointer("/breakpoint/source/path")
                    .and_then(Value::as_str)
                {
                    let local = state.paths[target].to_local(path);
                    body["breakpoint"]["source"]["path"] = local.into();
                }
            }
            _ => return,
        }
    }
    if shared.stop.load(Ordering::SeqCst) {
        return;
    }
    shared.out.event(name, Some(body));
    if let Some(notice) = notice {
        shared.out.output("console", &notice);
    }
}

/// What a stopped rank does to the rest of its job, for the Debug Console:
/// the others wait for it in their next collective, until the backend's
/// timeout fails it. `info` is what the probe read of torch.distributed
/// (`rank`, `world_size`, `backend`, `timeout_s`; null where it has none);
/// `held_for`: how long the rank has been held. Said in a `--job` session,
/// and in any session on a rank of a group of two or more.
pub fn collective_notice(
    label: &str,
    job: bool,
    info: &Value,
    held_for: Duration,
    now: SystemTime,
) -> Option<String> {
    let world = info.get("world_size").and_then(Value::as_i64);
    if !job && world.unwrap_or(0) < 2 {
        return None;
    }
    let who = match info.get("rank").and_then(Value::as_i64) {
        Some(rank) => format!("rank {rank}"),
        None => label.to_string(),
    };
    let others = match world {
        Some(2) => "the other rank waits for it in its".to_string(),
        Some(n) if n > 2 => format!("the other {} ranks wait for it in their", n - 1),
        _ => "the other ranks wait for it in their".to_string(),
    };
    let mut text = format!("rankscope: {who} is stopped: {others} next collective");
    match info.get("timeout_s").and_then(Value::as_f64) {
        Some(timeout) if timeout > 0.0 => {
            let backend = info
                .get("backend")
                .and_then(Value::as_str)
                .unwrap_or("the backend");
            let left = timeout - held_for.as_secs_f64();
            if left >= 1.0 {
                let until = now + Duration::from_secs_f64(left);
                text += &format!(
                    "; {backend} fails a collective that waits {}: about {} left (until {} UTC)",
                    span(timeout),
                    span(left),
                    clock(until)
                );
            } else {
                text += &format!(
                    "; {backend} fails a collective that waits {}, and {who} has been held longer: the others may have failed",
                    span(timeout)
                );
            }
        }
        _ => text += " (the backend's collective timeout could not be read)",
    }
    Some(text)
}

/// `45 s`, `5 min`, `29 min 58 s`, `2 h 5 min`.
fn span(seconds: f64) -> String {
    let s = seconds.round().max(0.0) as u64;
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 if s.is_multiple_of(60) => format!("{} min", s / 60),
        120..=7199 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

/// The time of day, `HH:MM:SS` in UTC.
fn clock(at: SystemTime) -> String {
    let s = at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
        % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s % 3600 / 60, s % 60)
}

/// A string field of a probe reply, empty when absent.
fn text_of(reply: &Value, key: &str) -> Value {
    reply.get(key).and_then(Value::as_str).unwrap_or("").into()
}

/// The clauses of a breakpoint condition that name ranks (`rank == 1`,
/// `rank in (1, 2)`, `rank != 0`, `rank >= 4`, `rank in range(2, 6)`),
/// joined by `and` to the rest: the adapter decides them itself, from the
/// ranks it debugs, and sends the breakpoint only to the ranks they pick,
/// with what is left of the condition for the probe to evaluate.
#[derive(Debug, Clone, PartialEq)]
pub struct RankCondition {
    tests: Vec<RankTest>,
    /// The clauses that name ranks, as written.
    pub ranks_text: String,
    /// What the probe evaluates at each pass (`None`: nothing more).
    pub rest: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum RankTest {
    Compare(&'static str, i64),
    In(RankSet),
    NotIn(RankSet),
}

#[derive(Debug, Clone, PartialEq)]
enum RankSet {
    List(Vec<i64>),
    /// `range(start, stop)`
    Range(i64, i64),
}

impl RankSet {
    fn contains(&self, rank: i64) -> bool {
        match self {
            RankSet::List(list) => list.contains(&rank),
            RankSet::Range(start, stop) => (*start..*stop).contains(&rank),
        }
    }
}

impl RankCondition {
    /// `None` when the condition names no rank in a form decided here
    /// (an `or`, a conditional expression, `rank % 2 == 0`): it goes to
    /// every rank as written, and the program's own names answer it.
    pub fn parse(condition: &str) -> Option<RankCondition> {
        let clauses = top_level_clauses(condition)?;
        let mut tests = Vec::new();
        let mut ranks = Vec::new();
        let mut rest = Vec::new();
        for clause in clauses {
            let clause = clause.trim();
            match rank_test(strip_parens(clause)) {
                Some(test) => {
                    tests.push(test);
                    ranks.push(clause);
                }
                None => rest.push(clause),
            }
        }
        if tests.is_empty() || rest.iter().any(|c| c.is_empty()) {
            return None;
        }
        Some(RankCondition {
            tests,
            ranks_text: ranks.join(" and "),
            rest: (!rest.is_empty()).then(|| rest.join(" and ")),
        })
    }

    pub fn matches(&self, rank: i64) -> bool {
        self.tests.iter().all(|test| match test {
            RankTest::Compare(op, n) => match *op {
                "==" => rank == *n,
                "!=" => rank != *n,
                "<" => rank < *n,
                "<=" => rank <= *n,
                ">" => rank > *n,
                _ => rank >= *n,
            },
            RankTest::In(set) => set.contains(rank),
            RankTest::NotIn(set) => !set.contains(rank),
        })
    }
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
}

/// The condition cut at each `and` outside brackets and strings; `None`
/// where `and` would not be the outermost operator (`or`, `if ... else`,
/// `lambda`) or the text is not plain enough to cut (a comment, a
/// triple-quoted string, unbalanced brackets).
fn top_level_clauses(text: &str) -> Option<Vec<&str>> {
    if text.contains("'''") || text.contains("\"\"\"") {
        return None;
    }
    let bytes = text.as_bytes();
    let mut clauses = Vec::new();
    let (mut depth, mut start, mut i) = (0i32, 0usize, 0usize);
    let mut quote: Option<u8> = None;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some(q) = quote {
            if b == b'\\' {
                i += 2;
                continue;
            }
            if b == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        match b {
            b'\'' | b'"' => quote = Some(b),
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => {
                depth -= 1;
                if depth < 0 {
                    return None;
                }
            }
            b'#' => return None,
            _ if is_word_byte(b) => {
                let end = bytes[i..]
                    .iter()
                    .position(|&c| !is_word_byte(c))
                    .map_or(bytes.len(), |n| i + n);
                if depth == 0 {
                    match &text[i..end] {
                        "and" => {
                            clauses.push(&text[start..i]);
                            start = end;
                        }
                        "or" | "if" | "else" | "lambda" => return None,
                        _ => {}
                    }
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    if quote.is_some() || depth != 0 {
        return None;
    }
    clauses.push(&text[start..]);
    Some(clauses)
}

/// `(x)` as `x`, where the outer brackets enclose the whole clause.
fn strip_parens(mut clause: &str) -> &str {
    while clause.starts_with('(') && clause.ends_with(')') {
        let inner = &clause[1..clause.len() - 1];
        let mut depth = 0i32;
        let balanced = inner.bytes().all(|b| {
            match b {
                b'(' => depth += 1,
                b')' => depth -= 1,
                _ => {}
            }
            depth >= 0
        });
        if !balanced || depth != 0 {
            break;
        }
        clause = inner.trim();
    }
    clause
}

fn rank_test(clause: &str) -> Option<RankTest> {
    let rest = clause.strip_prefix("rank")?;
    if rest.bytes().next().is_some_and(is_word_byte) {
        return None; // `ranks`, `rank_id`
    }
    let rest = rest.trim_start();
    for op in ["==", "!=", "<=", ">=", "<", ">"] {
        if let Some(number) = rest.strip_prefix(op) {
            return Some(RankTest::Compare(op, integer(number)?));
        }
    }
    if let Some(set) = rest.strip_prefix("not") {
        let set = set.trim_start().strip_prefix("in")?;
        return Some(RankTest::NotIn(rank_set(set)?));
    }
    let set = rest.strip_prefix("in")?;
    Some(RankTest::In(rank_set(set)?))
}

fn integer(text: &str) -> Option<i64> {
    let text = text.trim();
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// `(1, 2)`, `[1, 2]`, `{1, 2}` or `range(a[, b])` of integer literals.
fn rank_set(text: &str) -> Option<RankSet> {
    let text = text.trim();
    if let Some(args) = text
        .strip_prefix("range")
        .map(str::trim_start)
        .and_then(|t| t.strip_prefix('('))
        .and_then(|t| t.strip_suffix(')'))
    {
        let bounds: Vec<i64> = args.split(',').map(integer).collect::<Option<_>>()?;
        return match bounds.as_slice() {
            [stop] => Some(RankSet::Range(0, *stop)),
            [start, stop] => Some(RankSet::Range(*start, *stop)),
            _ => None,
        };
    }
    let close = match text.chars().next()? {
        '(' => ')',
        '[' => ']',
        '{' => '}',
        _ => return None,
    };
    let inner = text[1..].strip_suffix(close)?;
    let items: Vec<&str> = inner.split(',').map(str::trim).collect();
    let items = match items.split_last() {
        // A trailing comma: `(1,)`.
        Some((last, before)) if last.is_empty() && !before.is_empty() => before,
        _ => &items[..],
    };
    items
        .iter()
        .map(|i| integer(i))
        .collect::<Option<Vec<_>>>()
        .map(RankSet::List)
}

/// An error unless at least one target answered: the process has exited,
/// or every rank's error, joined.
fn some_answered(replies: &[(usize, Result<Value, String>)]) -> Result<(), String> {
    if replies.is_empty() {
        return Err("the process has exited".into());
    }
    let failed: Vec<&str> = replies
        .iter()
        .filter_map(|(_, r)| r.as_ref().err().map(String::as_str))
        .collect();
    if failed.len() == replies.len() {
        return Err(failed.join("; "));
    }
    Ok(())
}
