//! Whole sessions against a fake probe.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

use crate::framing::{write_message, MessageReader};
use crate::{serve, Backend, BackendError, Ending, Options, Target};

const MAIN: i64 = 140_000_000_000_001;
const WORKER: i64 = 140_000_000_000_002;

/// A probe that answers every op from a script, and records what it was asked.
struct Fake {
    calls: Mutex<Vec<(usize, Value)>>,
    events: Mutex<Vec<VecDeque<Value>>>,
    gone: Vec<AtomicBool>,
    raised: bool,
}

impl Fake {
    fn new(targets: usize) -> Arc<Fake> {
        Arc::new(Fake {
            calls: Mutex::new(Vec::new()),
            events: Mutex::new(vec![VecDeque::new(); targets]),
            gone: (0..targets).map(|_| AtomicBool::new(false)).collect(),
            raised: true,
        })
    }

    fn push_event(&self, target: usize, event: Value) {
        self.events.lock().unwrap()[target].push_back(event);
    }

    /// The ops asked so far, without the event polls.
    fn ops(&self) -> Vec<(usize, Value)> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, c)| c["op"] != "events")
            .cloned()
            .collect()
    }

    fn last(&self, op: &str) -> Value {
        self.ops()
            .into_iter()
            .rev()
            .find(|(_, c)| c["op"] == op)
            .unwrap_or_else(|| panic!("no {op} call"))
            .1
    }
}

fn here() -> String {
    format!("{}/src/lib.rs", env!("CARGO_MANIFEST_DIR"))
}

impl Backend for Fake {
    fn call(&self, target: usize, request: Value, _: Duration) -> Result<Value, BackendError> {
        self.calls.lock().unwrap().push((target, request.clone()));
        if self.gone[target].load(Ordering::SeqCst) {
            return Err(BackendError::Gone("no such process".into()));
        }
        let op = request["op"].as_str().unwrap_or_default();
        if !matches!(op, "hello" | "attach") && request["session"] != 7 {
            return Err(BackendError::Failed(format!(
                "no such debug session {}",
                request["session"]
            )));
        }
        Ok(match op {
            "hello" => {
                json!({"pid": 100, "python": "3.11.9", "features": {"raised_exceptions": self.raised}})
            }
            "attach" => json!({"session": 7, "pid": 100}),
            "detach" => json!({"resumed": 0}),
            "events" => {
                let next = self.events.lock().unwrap()[target].pop_front();
                match next {
                    Some(e) => json!({"events": [e]}),
                    None => {
                        std::thread::sleep(Duration::from_millis(5));
                        json!({"events": []})
                    }
                }
            }
            "threads" => json!({"threads": [
                {"id": MAIN, "name": "MainThread", "stopped": true},
                {"id": WORKER, "name": "loader", "stopped": false},
            ]}),
            "stack" => json!({"total": 5, "frames": [
                {"id": 1, "name": "train_step", "path": here(), "line": 10, "subtle": false},
                {"id": 2, "name": "<module>", "path": "<string>", "line": 1, "subtle": true},
            ]}),
            "scopes" => json!({"scopes": [
                {"name": "Locals", "ref": 3, "named": 2, "expensive": false},
                {"name": "Globals", "ref": 4, "named": 9, "expensive": true},
            ]}),
            "variables" => json!({"variables": [
                {"name": "x", "value": "1", "type": "int", "ref": 0},
                {"name": "d", "value": "{'a': 1}", "type": "dict", "ref": 5, "named": 1, "evaluate_name": "d"},
            ]}),
            "evaluate" if request["expression"] == "boom" => {
                return Err(BackendError::Failed(
                    "NameError: name 'boom' is not defined".into(),
                ))
            }
            "evaluate" if request["expression"] == "slow()" => {
                std::thread::sleep(Duration::from_millis(400));
                json!({"result": "None", "type": "NoneType", "ref": 0})
            }
            "evaluate" => json!({"result": "3", "type": "int", "ref": 6, "output": "hi\n"}),
            "set_expression" => json!({"result": "7", "type": "int", "ref": 0}),
            "set_variable" => json!({"value": "5", "type": "int", "ref": 0}),
            "set_breakpoints" => {
                // The breakpoint is hit before the probe's answer is back.
                if request["breakpoints"][0]["line"] == 77 {
                    self.push_event(
                        target,
                        json!({"seq": 1, "event": "stopped", "body": {
                        "reason": "breakpoint", "threadId": MAIN, "hitBreakpointIds": [100]}}),
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
                let bps: Vec<Value> = request["breakpoints"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .enumerate()
                    .map(|(i, b)| json!({"id": 100 + i, "verified": b["line"] != 99, "line": b["line"], "message": null}))
                    .collect();
                json!({"breakpoints": bps})
            }
            "source" => json!({"content": "x = 1\n"}),
            "modules" => json!({"modules": [
                {"name": "__main__", "path": here(), "user": true},
                {"name": "json", "path": "/usr/lib/python3.11/json/__init__.py", "user": false, "version": "2.0.9"},
                {"name": "sys", "path": null, "user": false},
            ]}),
            "completions" => {
                let start = request["offset"].as_i64().unwrap() - 2;
                json!({"targets": [{"label": "step", "type": "variable", "start": start, "length": 2}]})
            }
            "exception_info" => {
                json!({"exceptionId": "ValueError", "description": "bad", "breakMode": "unhandled",
                "details": {"message": "bad", "typeName": "ValueError", "fullTypeName": "ValueError", "stackTrace": "Traceback ..."}})
            }
            "continue" | "next" | "step_in" | "step_out" | "pause" => json!({}),
            other => return Err(BackendError::Failed(format!("unknown op {other}"))),
        })
    }
}

/// A pipe end that reads what another thread sends.
struct PipeReader {
    rx: Receiver<Vec<u8>>,
    pending: Vec<u8>,
}

impl Read for PipeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pending.is_empty() {
            match self.rx.recv() {
                Ok(bytes) => self.pending = bytes,
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.pending.len());
        buf[..n].copy_from_slice(&self.pending[..n]);
        self.pending.drain(..n);
        Ok(n)
    }
}

struct PipeWriter(Sender<Vec<u8>>);

impl Write for PipeWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .send(buf.to_vec())
            .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An editor: sends requests, collects what the adapter sends back.
struct Client {
    to_adapter: Option<Sender<Vec<u8>>>,
    from_adapter: Receiver<Value>,
    seq: i64,
    /// Everything received, in order.
    log: Vec<Value>,
    unread_events: Vec<Value>,
    session: Option<JoinHandle<Ending>>,
}

impl Client {
    fn start(fake: Arc<Fake>, options: Options) -> Client {
        let (in_tx, in_rx) = mpsc::channel();
        let (out_tx, out_rx) = mpsc::channel();
        let input = PipeReader {
            rx: in_rx,
            pending: Vec::new(),
        };
        let session = std::thread::spawn(move || serve(fake, options, input, PipeWriter(out_tx)));
        let (msg_tx, msg_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let reader = PipeReader {
                rx: out_rx,
                pending: Vec::new(),
            };
            let mut reader = MessageReader::new(io::BufReader::new(reader), 1 << 20);
            while let Ok(Some(m)) = reader.read() {
                if msg_tx.send(m).is_err() {
                    return;
                }
            }
        });
        Client {
            to_adapter: Some(in_tx),
            from_adapter: msg_rx,
            seq: 0,
            log: Vec::new(),
            unread_events: Vec::new(),
            session: Some(session),
        }
    }

    fn receive(&mut self) -> Value {
        let m = self
            .from_adapter
            .recv_timeout(Duration::from_secs(5))
            .expect("the adapter said nothing for 5 s");
        check_shape(&m);
        self.log.push(m.clone());
        m
    }

    fn send(&mut self, command: &str, arguments: Value) -> i64 {
        self.seq += 1;
        let mut out = Vec::new();
        let request =
            json!({"seq": self.seq, "type": "request", "command": command, "arguments": arguments});
        write_message(&mut out, &request).unwrap();
        self.to_adapter.as_ref().unwrap().send(out).unwrap();
        self.seq
    }

    fn request(&mut self, command: &str, arguments: Value) -> Value {
        let seq = self.send(command, arguments);
        loop {
            let m = self.receive();
            if m["type"] == "response" && m["request_seq"] == seq {
                assert_eq!(m["command"], command);
                return m;
            }
            if m["type"] == "event" {
                self.unread_events.push(m);
            }
        }
    }

    fn ok(&mut self, command: &str, arguments: Value) -> Value {
        let r = self.request(command, arguments);
        assert_eq!(r["success"], true, "{r}");
        r.get("body").cloned().unwrap_or(Value::Null)
    }

    fn event(&mut self, name: &str) -> Value {
        if let Some(i) = self.unread_events.iter().position(|e| e["event"] == name) {
            return self.unread_events.remove(i);
        }
        loop {
            let m = self.receive();
            if m["type"] == "event" && m["event"] == name {
                return m;
            }
            if m["type"] == "event" {
                self.unread_events.push(m);
            }
        }
    }

    fn attach(&mut self, args: Value) {
        self.ok(
            "initialize",
            json!({"clientID": "vscode", "adapterID": "debugpy", "linesStartAt1": true}),
        );
        self.ok("attach", args);
        self.event("initialized");
    }

    fn end(mut self) -> Ending {
        self.to_adapter = None;
        let ending = self.session.take().unwrap().join().unwrap();
        // Numbered from 1, with no gap, across responses and events.
        let seqs: Vec<i64> = self
            .log
            .iter()
            .map(|m| m["seq"].as_i64().unwrap())
            .collect();
        assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
        ending
    }
}

/// The fields the DAP schema requires of every message this test sees.
fn check_shape(m: &Value) {
    assert!(m["seq"].is_i64(), "{m}");
    match m["type"].as_str() {
        Some("response") => {
            assert!(m["request_seq"].is_i64() && m["command"].is_string(), "{m}");
            if m["success"] == false {
                assert!(m["message"].is_string() && m["body"].is_object(), "{m}");
            } else {
                assert_eq!(m["success"], true, "{m}");
            }
        }
        Some("event") => {
            assert!(m["event"].is_string(), "{m}");
            let body = &m["body"];
            let required: &[&str] = match m["event"].as_str().unwrap() {
                "stopped" => &["reason"],
                "output" => &["output"],
                "thread" => &["reason", "threadId"],
                "continued" => &["threadId"],
                "breakpoint" => &["reason", "breakpoint"],
                _ => &[],
            };
            for field in required {
                assert!(!body[field].is_null(), "{field} missing: {m}");
            }
            if let Value::Object(map) = body {
                assert!(map.values().all(|v| !v.is_null()), "a null in {m}");
            }
        }
        _ => panic!("not a response or an event: {m}"),
    }
}

fn one() -> Options {
    let mut o = Options::new(vec![Target {
        label: None,
        rank: None,
        pid: 100,
        cwd: Some(env!("CARGO_MANIFEST_DIR").into()),
    }]);
    o.events_wait = Duration::from_millis(50);
    o
}

#[test]
fn initialize_attach_initialized_configuration_done() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    let caps = c.ok(
        "initialize",
        json!({"clientID": "vscode", "adapterID": "debugpy"}),
    );
    assert_eq!(caps["supportsConfigurationDoneRequest"], true);
    assert_eq!(caps["supportsDataBreakpoints"], true);
    let filters: Vec<&str> = caps["exceptionBreakpointFilters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["filter"].as_str().unwrap())
        .collect();
    assert_eq!(filters, ["uncaught", "raised"]);
    assert_eq!(caps["exceptionBreakpointFilters"][0]["default"], true);
    // What VSCode's "Remote Attach" sends, extra keys and all.
    let attach = c.request(
        "attach",
        json!({
            "name": "Python Debugger: Remote Attach", "type": "debugpy", "request": "attach",
            "connect": {"host": "localhost", "port": 5678},
            "pathMappings": [{"localRoot": "/home/me/proj", "remoteRoot": "."}],
            "justMyCode": false, "__configurationTarget": 6, "__sessionId": "abc",
            "debugOptions": ["RedirectOutput", "ShowReturnValue"], "showReturnValue": true,
            "workspaceFolder": "/home/me/proj", "clientOS": "unix",
        }),
    );
    assert_eq!(attach["success"], true);
    c.event("initialized");
    let at = |c: &Client, f: &dyn Fn(&Value) -> bool| c.log.iter().position(f).unwrap();
    assert!(
        at(&c, &|m| m["command"] == "attach") < at(&c, &|m| m["event"] == "initialized"),
        "initialized comes after the attach response"
    );
    c.ok("configurationDone", json!({}));
    let probe_attach = fake.last("attach");
    assert_eq!(probe_attach["just_my_code"], false);
    assert_eq!(probe_attach["client"], "vscode");
    c.ok("disconnect", json!({"terminateDebuggee": true}));
    assert_eq!(c.end(), Ending::Disconnected);
    let ops: Vec<String> = fake
        .ops()
        .iter()
        .map(|(_, c)| c["op"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        ops,
        ["hello", "attach", "detach"],
        "never anything that ends the target"
    );
}

#[test]
fn raised_is_offered_only_where_the_probe_has_it() {
    let fake = Arc::new(Fake {
        raised: false,
        ..Arc::into_inner(Fake::new(1)).unwrap()
    });
    let mut c = Client::start(fake, one());
    let caps = c.ok("initialize", json!({}));
    assert_eq!(
        caps["exceptionBreakpointFilters"].as_array().unwrap().len(),
        1
    );
    c.end();
}

#[test]
fn only_initialize_comes_before_attach() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.ok("initialize", json!({}));
    let r = c.request("threads", json!({}));
    assert_eq!(r["success"], false);
    assert!(r["message"].as_str().unwrap().contains("attach"), "{r}");
    let r = c.request("launch", json!({"program": "x.py"}));
    assert_eq!(r["success"], false);
    assert!(
        r["message"]
            .as_str()
            .unwrap()
            .contains("rankscope run -- python"),
        "{r}"
    );
    c.attach(json!({}));
    assert_eq!(
        fake.last("attach")["just_my_code"],
        true,
        "justMyCode defaults to true"
    );
    let r = c.request("stepBack", json!({"threadId": 1}));
    assert_eq!(r["success"], false);
    assert!(r["message"].as_str().unwrap().contains("`stepBack`"), "{r}");
    assert_eq!(c.end(), Ending::ClientGone);
    assert_eq!(
        fake.last("detach")["session"],
        7,
        "a client gone without disconnect still detaches"
    );
}

#[test]
fn a_wrong_or_missing_token_is_refused_and_closes_the_session() {
    for given in [json!({}), json!({"rankscopeToken": "guess"})] {
        let fake = Fake::new(1);
        let mut options = one();
        options.token = Some("s3cret".into());
        let mut c = Client::start(fake.clone(), options);
        c.ok("initialize", json!({}));
        let r = c.request("attach", given);
        assert_eq!(r["success"], false);
        assert!(
            r["message"].as_str().unwrap().contains("rankscopeToken"),
            "{r}"
        );
        let ending = c.session.take().unwrap().join().unwrap();
        assert!(matches!(ending, Ending::Refused(_)), "{ending:?}");
        assert!(fake.ops().iter().all(|(_, c)| c["op"] != "attach"));
    }
    let fake = Fake::new(1);
    let mut options = one();
    options.token = Some("s3cret".into());
    let mut c = Client::start(fake, options);
    c.attach(json!({"rankscopeToken": "s3cret"}));
    c.end();
}

#[test]
fn ids_are_the_adapters_and_paths_are_mapped_both_ways() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({"pathMappings": [{"localRoot": "/home/me/proj", "remoteRoot": "."}]}));
    let threads = c.ok("threads", json!({}));
    assert_eq!(
        threads["threads"],
        json!([{"id": 1, "name": "MainThread"}, {"id": 2, "name": "loader"}])
    );
    let stack = c.ok(
        "stackTrace",
        json!({"threadId": 1, "startFrame": 0, "levels": 20}),
    );
    assert_eq!(fake.last("stack")["thread"], MAIN);
    assert_eq!(stack["totalFrames"], 5);
    let frames = stack["stackFrames"].as_array().unwrap();
    assert_eq!(frames[0]["source"]["path"], "/home/me/proj/src/lib.rs");
    assert_eq!(frames[0]["column"], 1);
    assert!(frames[0].get("presentationHint").is_none());
    assert_eq!(frames[1]["presentationHint"], "subtle");
    let reference = frames[1]["source"]["sourceReference"].as_i64().unwrap();
    assert!(reference > 0 && frames[1]["source"].get("path").is_none());
    let text = c.ok(
        "source",
        json!({"sourceReference": reference, "source": {"sourceReference": reference}}),
    );
    assert_eq!(text["content"], "x = 1\n");
    assert_eq!(fake.last("source")["path"], "<string>");

    let frame = frames[1]["id"].as_i64().unwrap();
    let scopes = c.ok("scopes", json!({"frameId": frame}));
    assert_eq!(fake.last("scopes")["frame"], 2);
    let locals = &scopes["scopes"][0];
    assert_eq!(locals["expensive"], false);
    let vars = c.ok(
        "variables",
        json!({"variablesReference": locals["variablesReference"], "start": 0, "count": 10}),
    );
    assert_eq!(fake.last("variables")["ref"], 3);
    assert_eq!(fake.last("variables")["count"], 10);
    assert_eq!(vars["variables"][0]["variablesReference"], 0);
    let child = vars["variables"][1]["variablesReference"].as_i64().unwrap();
    assert!(child > 0);
    assert_eq!(vars["variables"][1]["evaluateName"], "d");
    c.ok(
        "variables",
        json!({"variablesReference": child, "filter": "named"}),
    );
    assert_eq!(fake.last("variables")["ref"], 5);
    assert_eq!(fake.last("variables")["filter"], "named");

    let set = c.ok(
        "setVariable",
        json!({"variablesReference": child, "name": "a", "value": "5"}),
    );
    assert_eq!(set["value"], "5");
    assert_eq!(fake.last("set_variable")["ref"], 5);

    // A resumed thread's frames and references are gone.
    let r = c.ok("continue", json!({"threadId": 1}));
    assert_eq!(r["allThreadsContinued"], false);
    assert_eq!(fake.last("continue")["thread"], MAIN);
    let stale = c.request("scopes", json!({"frameId": frame}));
    assert_eq!(stale["success"], false);
    let stale = c.request("variables", json!({"variablesReference": child}));
    assert_eq!(stale["success"], false);
    c.ok("next", json!({"threadId": 2}));
    assert_eq!(fake.last("next")["thread"], WORKER);
    c.ok("disconnect", json!({}));
    c.end();
}

#[test]
fn breakpoints_map_paths_and_keep_the_requests_order() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({"pathMappings": [{"localRoot": "/home/me/proj", "remoteRoot": "/app"}]}));
    let source = json!({"name": "train.py", "path": "/home/me/proj/train.py"});
    let reply = c.ok(
        "setBreakpoints",
        json!({"source": source, "breakpoints": [
            {"line": 12, "condition": "step > 3"},
            {"line": 99},
            {"line": 20, "hitCondition": ">=5", "logMessage": "loss {loss}"},
        ]}),
    );
    let sent = fake.last("set_breakpoints");
    assert_eq!(sent["path"], "/app/train.py");
    assert_eq!(
        sent["breakpoints"][0],
        json!({"line": 12, "condition": "step > 3", "hit_condition": null, "log_message": null})
    );
    assert_eq!(sent["breakpoints"][2]["hit_condition"], ">=5");
    assert_eq!(sent["breakpoints"][2]["log_message"], "loss {loss}");
    let bps = reply["breakpoints"].as_array().unwrap();
    assert_eq!(bps.len(), 3);
    let lines: Vec<i64> = bps.iter().map(|b| b["line"].as_i64().unwrap()).collect();
    assert_eq!(lines, [12, 99, 20]);
    assert_eq!(bps[1]["verified"], false);
    assert!(bps.iter().all(|b| b["source"] == source));
    assert!(bps.iter().all(|b| b.get("message").is_none()));
    let ids: Vec<i64> = bps.iter().map(|b| b["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, [1, 2, 3]);

    // A stop at probe breakpoint 102 names DAP breakpoint 3 on DAP thread 1.
    c.ok("threads", json!({}));
    fake.push_event(
        0,
        json!({"seq": 1, "event": "stopped", "body": {
        "reason": "breakpoint", "threadId": MAIN, "allThreadsStopped": false,
        "hitBreakpointIds": [102], "description": "Paused on breakpoint", "text": null}}),
    );
    let stopped = c.event("stopped");
    assert_eq!(stopped["body"]["threadId"], 1);
    assert_eq!(stopped["body"]["hitBreakpointIds"], json!([3]));
    assert_eq!(stopped["body"]["description"], "Paused on breakpoint");
    // An armed pending breakpoint.
    fake.push_event(0, json!({"seq": 2, "event": "breakpoint", "body": {"reason": "changed", "breakpoint": {"id": 101, "verified": true, "line": 100}}}));
    let changed = c.event("breakpoint");
    assert_eq!(changed["body"]["breakpoint"]["id"], 2);
    // A logpoint's line, with its file as the editor knows it.
    fake.push_event(0, json!({"seq": 3, "event": "output", "body": {"category": "console", "output": "loss 0.5\n", "source": {"path": "/app/train.py"}, "line": 20}}));
    let out = c.event("output");
    assert_eq!(out["body"]["source"]["path"], "/home/me/proj/train.py");
    fake.push_event(
        0,
        json!({"seq": 4, "event": "thread", "body": {"reason": "started", "threadId": 99}}),
    );
    assert_eq!(c.event("thread")["body"]["threadId"], 3);
    // Each poll asks for what came after the last event seen.
    let asked_after = |n: i64| {
        let calls = fake.calls.lock().unwrap();
        calls
            .iter()
            .any(|(_, c)| c["op"] == "events" && c["after"] == n)
    };
    for _ in 0..100 {
        if asked_after(4) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(asked_after(4) && asked_after(0));
    c.ok("disconnect", json!({}));
    c.end();
}

#[test]
fn evaluate_sends_what_was_printed_before_its_answer() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    let body = c.ok("evaluate", json!({"expression": "f()", "context": "repl"}));
    assert_eq!(body["result"], "3");
    assert!(body["variablesReference"].as_i64().unwrap() > 0);
    assert_eq!(fake.last("evaluate")["frame"], Value::Null);
    let printed = c.log.iter().position(|m| m["event"] == "output").unwrap();
    let answer = c
        .log
        .iter()
        .position(|m| m["command"] == "evaluate")
        .unwrap();
    assert!(printed < answer);
    assert_eq!(
        c.log[printed]["body"],
        json!({"category": "stdout", "output": "hi\n"})
    );
    let failed = c.request(
        "evaluate",
        json!({"expression": "boom", "context": "watch"}),
    );
    assert_eq!(failed["success"], false);
    assert_eq!(failed["message"], "NameError: name 'boom' is not defined");
    c.end();
}

#[test]
fn a_slow_evaluate_does_not_hold_up_pause_or_threads() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    let slow = c.send(
        "evaluate",
        json!({"expression": "slow()", "context": "repl"}),
    );
    c.ok("threads", json!({}));
    c.ok("pause", json!({"threadId": 1}));
    // Both answered while the expression still ran; its answer comes after.
    assert!(!c
        .log
        .iter()
        .any(|m| m["type"] == "response" && m["request_seq"] == slow));
    loop {
        let m = c.receive();
        if m["type"] == "response" && m["request_seq"] == slow {
            assert_eq!(m["success"], true, "{m}");
            assert_eq!(m["body"]["result"], "None");
            break;
        }
    }
    c.end();
}

#[test]
fn completions_count_columns_in_utf16_from_the_clients_base() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    // "é" is one UTF-16 unit, "😀" two; the cursor is after "st" (1-based 7).
    let body = c.ok(
        "completions",
        json!({"text": "x = 1\né😀 st", "column": 7, "line": 2}),
    );
    let asked = fake.last("completions");
    assert_eq!(asked["text"], "é😀 st");
    assert_eq!(asked["offset"], 5);
    assert_eq!(asked["frame"], Value::Null);
    assert_eq!(body["targets"][0]["label"], "step");
    assert_eq!(body["targets"][0]["start"], 5);
    c.end();
}

#[test]
fn modules_are_paged_and_loaded_sources_are_their_python_files() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    let all = c.ok("modules", json!({}));
    assert_eq!(all["totalModules"], 3);
    assert_eq!(all["modules"][0]["id"], "__main__");
    assert_eq!(all["modules"][0]["isUserCode"], true);
    assert_eq!(all["modules"][1]["version"], "2.0.9");
    assert!(all["modules"][2].get("path").is_none());
    let page = c.ok("modules", json!({"startModule": 1, "moduleCount": 1}));
    assert_eq!(page["modules"].as_array().unwrap().len(), 1);
    assert_eq!(page["modules"][0]["name"], "json");
    let sources = c.ok("loadedSources", json!({}));
    let paths: Vec<&str> = sources["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths.len(), 1, "{paths:?}");
    assert!(paths.contains(&"/usr/lib/python3.11/json/__init__.py"));
    c.end();
}

#[test]
fn set_expression_answers_with_the_new_value() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    let body = c.ok("setExpression", json!({"expression": "lr", "value": "7"}));
    assert_eq!(body["value"], "7");
    assert_eq!(body["variablesReference"], 0);
    let asked = fake.last("set_expression");
    assert_eq!(
        (&asked["expression"], &asked["value"]),
        (&json!("lr"), &json!("7"))
    );
    c.end();
}

#[test]
fn exception_info_is_asked_of_the_threads_probe() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    let threads = c.ok("threads", json!({}));
    let main = threads["threads"][0]["id"].clone();
    let body = c.ok("exceptionInfo", json!({"threadId": main}));
    assert_eq!(body["exceptionId"], "ValueError");
    assert_eq!(body["breakMode"], "unhandled");
    assert_eq!(fake.last("exception_info")["thread"], MAIN);
    let unknown = c.request("exceptionInfo", json!({"threadId": 999}));
    assert_eq!(unknown["success"], false);
    c.end();
}

#[test]
fn the_target_exiting_ends_the_session_with_terminated() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    fake.gone[0].store(true, Ordering::SeqCst);
    c.event("terminated");
    let r = c.request("disconnect", json!({}));
    assert_eq!(r["success"], true);
    assert_eq!(c.end(), Ending::TargetGone);
}

#[test]
fn a_job_session_names_ranks_and_sets_breakpoints_on_each() {
    let fake = Fake::new(2);
    let mut options = Options::new(
        (0..2)
            .map(|r| Target {
                label: Some(format!("rank {r}")),
                rank: Some(r as i64),
                pid: 100 + r,
                cwd: None,
            })
            .collect(),
    );
    options.events_wait = Duration::from_millis(50);
    let mut c = Client::start(fake.clone(), options);
    c.attach(json!({}));
    let threads = c.ok("threads", json!({}));
    let names: Vec<&str> = threads["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "rank 0 / MainThread",
            "rank 0 / loader",
            "rank 1 / MainThread",
            "rank 1 / loader"
        ]
    );
    let reply = c.ok(
        "setBreakpoints",
        json!({"source": {"path": "/x/train.py"}, "breakpoints": [{"line": 5}]}),
    );
    assert_eq!(reply["breakpoints"][0]["id"], 1);
    let set_on: Vec<usize> = fake
        .ops()
        .iter()
        .filter(|(_, c)| c["op"] == "set_breakpoints")
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(set_on.len(), 2);
    fake.push_event(1, json!({"seq": 1, "event": "stopped", "body": {"reason": "breakpoint", "threadId": MAIN, "hitBreakpointIds": [100], "description": "Paused on breakpoint"}}));
    let stopped = c.event("stopped");
    assert_eq!(stopped["body"]["threadId"], 3);
    assert_eq!(stopped["body"]["hitBreakpointIds"], json!([1]));
    assert_eq!(
        stopped["body"]["description"],
        "rank 1: Paused on breakpoint"
    );
    // One rank exits: its threads go; the session goes on with the other.
    fake.gone[0].store(true, Ordering::SeqCst);
    let exited = c.event("thread");
    assert_eq!(exited["body"]["reason"], "exited");
    c.ok("threads", json!({}));
    fake.gone[1].store(true, Ordering::SeqCst);
    c.event("terminated");
    assert_eq!(c.end(), Ending::TargetGone);
}

#[test]
fn a_hit_that_overtakes_the_breakpoints_answer_still_names_it() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    let reply = c.ok(
        "setBreakpoints",
        json!({"source": {"path": "/x.py"}, "breakpoints": [{"line": 77}]}),
    );
    assert_eq!(reply["breakpoints"][0]["id"], 1);
    let stopped = c.event("stopped");
    assert_eq!(stopped["body"]["hitBreakpointIds"], json!([1]));
    c.end();
}

fn job(ranks: i64) -> Options {
    let mut options = Options::new(
        (0..ranks)
            .map(|r| Target {
                label: Some(format!("rank {r}")),
                rank: Some(r),
                pid: 100 + r as u32,
                cwd: None,
            })
            .collect(),
    );
    options.events_wait = Duration::from_millis(50);
    options
}

#[test]
fn a_condition_splits_into_the_ranks_it_names_and_the_rest() {
    use crate::adapter::RankCondition;

    let picks = |condition: &str| {
        RankCondition::parse(condition).map(|c| {
            let ranks: Vec<i64> = (0..8).filter(|&r| c.matches(r)).collect();
            (ranks, c.rest)
        })
    };
    assert_eq!(picks("rank == 1"), Some((vec![1], None)));
    assert_eq!(
        picks("rank == 1 and step % 10 == 0"),
        Some((vec![1], Some("step % 10 == 0".into())))
    );
    assert_eq!(
        picks("step > 3 and (rank in (1, 2)) and loss != loss"),
        Some((vec![1, 2], Some("step > 3 and loss != loss".into())))
    );
    assert_eq!(picks("rank in [5,]"), Some((vec![5], None)));
    assert_eq!(picks("rank not in {0, 7}"), Some(((1..7).collect(), None)));
    assert_eq!(picks("rank in range(2, 4)"), Some((vec![2, 3], None)));
    assert_eq!(picks("rank in range(3)"), Some((vec![0, 1, 2], None)));
    assert_eq!(picks("rank != 0"), Some(((1..8).collect(), None)));
    assert_eq!(picks("rank>=6"), Some((vec![6, 7], None)));
    assert_eq!(
        picks("rank < 2 and rank > 0"),
        Some((vec![1], None)),
        "clauses that name ranks all hold"
    );
    // An `and` inside brackets or a string is not a clause's end.
    assert_eq!(
        picks("rank == 0 and f(a and b, 'x and y')"),
        Some((vec![0], Some("f(a and b, 'x and y')".into())))
    );
    // Where `and` is not the outermost operator, or the rank is the
    // program's to compute, the probe gets the condition as written.
    for left in [
        "rank == 1 or step > 3",
        "rank == 1 and x if y else z",
        "rank % 2 == 0",
        "ranks == 1",
        "rank_id == 1",
        "rank == world - 1",
        "rank in group",
        "rank in ()",
        "not rank == 1",
        "step > 3",
        "rank == 1 and",
        "rank == 1 # why",
        "rank == (1",
        "s == '''a and b''' and rank == 1",
    ] {
        assert_eq!(picks(left), None, "{left}");
    }
}

#[test]
fn a_breakpoint_goes_only_to_the_ranks_its_condition_names() {
    let fake = Fake::new(3);
    let mut c = Client::start(fake.clone(), job(3));
    c.attach(json!({}));
    let reply = c.ok(
        "setBreakpoints",
        json!({"source": {"path": "/x/train.py"}, "breakpoints": [
            {"line": 5, "condition": "rank == 1 and step > 3"},
            {"line": 6},
            {"line": 7, "condition": "rank in (0, 2)"},
            {"line": 8, "condition": "rank == 9"},
        ]}),
    );
    // What each rank was sent: the lines it has, each with what is left of its condition.
    let mut sent = vec![Value::Null; 3];
    for (t, call) in fake.ops() {
        if call["op"] == "set_breakpoints" {
            sent[t] = call["breakpoints"].clone();
        }
    }
    let lines_and_conditions = |t: usize| -> Vec<(i64, Value)> {
        sent[t]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| (b["line"].as_i64().unwrap(), b["condition"].clone()))
            .collect()
    };
    assert_eq!(
        lines_and_conditions(0),
        [(6, Value::Null), (7, Value::Null)]
    );
    assert_eq!(
        lines_and_conditions(1),
        [(5, json!("step > 3")), (6, Value::Null)]
    );
    assert_eq!(
        lines_and_conditions(2),
        [(6, Value::Null), (7, Value::Null)]
    );
    let bps = reply["breakpoints"].as_array().unwrap();
    let verified: Vec<bool> = bps.iter().map(|b| b["verified"] == true).collect();
    assert_eq!(verified, [true, true, true, false]);
    assert_eq!(
        bps[3]["message"],
        "no rank of this session has `rank == 9` (it debugs ranks 0, 1, 2)"
    );
    let ids: Vec<i64> = bps[..3].iter().map(|b| b["id"].as_i64().unwrap()).collect();
    // Each rank's probe ids (100, 101 in what it was sent) name the right
    // DAP breakpoint: rank 1's first is line 5, rank 2's second is line 7.
    c.ok("threads", json!({}));
    fake.push_event(1, json!({"seq": 1, "event": "stopped", "body": {"reason": "breakpoint", "threadId": MAIN, "hitBreakpointIds": [100]}}));
    let stopped = c.event("stopped");
    assert_eq!(stopped["body"]["hitBreakpointIds"], json!([ids[0]]));
    assert_eq!(stopped["body"]["description"], "rank 1");
    fake.push_event(2, json!({"seq": 1, "event": "stopped", "body": {"reason": "breakpoint", "threadId": MAIN, "hitBreakpointIds": [101]}}));
    assert_eq!(
        c.event("stopped")["body"]["hitBreakpointIds"],
        json!([ids[2]])
    );
    // Clearing the file clears it on every rank, those it was never sent to too.
    c.ok(
        "setBreakpoints",
        json!({"source": {"path": "/x/train.py"}, "breakpoints": []}),
    );
    let cleared = fake
        .ops()
        .iter()
        .filter(|(_, call)| call["op"] == "set_breakpoints" && call["breakpoints"] == json!([]))
        .count();
    assert_eq!(cleared, 3);
    c.ok("disconnect", json!({}));
    c.end();
}

#[test]
fn a_pid_session_leaves_a_rank_condition_to_the_program() {
    let fake = Fake::new(1);
    let mut c = Client::start(fake.clone(), one());
    c.attach(json!({}));
    c.ok(
        "setBreakpoints",
        json!({"source": {"path": "/x.py"}, "breakpoints": [{"line": 3, "condition": "rank == 1"}]}),
    );
    assert_eq!(
        fake.last("set_breakpoints")["breakpoints"][0]["condition"],
        "rank == 1"
    );
    c.ok("disconnect", json!({}));
    c.end();
}

#[test]
fn a_stopped_rank_says_the_others_wait_until_the_backends_timeout() {
    use crate::adapter::collective_notice;
    use std::time::UNIX_EPOCH;

    let fake = Fake::new(2);
    let mut c = Client::start(fake.clone(), job(2));
    c.attach(json!({}));
    c.ok("threads", json!({}));
    let gloo = json!({"rank": 1, "world_size": 2, "backend": "gloo", "timeout_s": 300.0});
    fake.push_event(1, json!({"seq": 1, "event": "stopped", "body": {"reason": "breakpoint", "threadId": MAIN, "description": "breakpoint at train.py:5", "collectives": gloo}}));
    let stopped = c.event("stopped");
    // The probe's part of the stop is the adapter's to read, not the editor's.
    assert!(stopped["body"].get("collectives").is_none(), "{stopped}");
    assert_eq!(
        stopped["body"]["description"],
        "rank 1: breakpoint at train.py:5"
    );
    let said = c.event("output")["body"]["output"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        said.starts_with("rankscope: rank 1 is stopped: the other rank waits for it in its next collective; gloo fails a collective that waits 5 min: about 5 min left (until "),
        "{said}"
    );
    let stop = |c: &mut Client, seq: i64| {
        fake.push_event(1, json!({"seq": seq, "event": "stopped", "body": {"reason": "step", "threadId": MAIN, "collectives": gloo}}));
        c.event("stopped");
        // Whatever the events thread sends with the stop is in before this answer.
        c.ok("threads", json!({}));
        c.unread_events
            .drain(..)
            .filter(|e| e["event"] == "output")
            .count()
    };
    // A step keeps the rank held: its next stop says nothing again (within a minute).
    c.ok("next", json!({"threadId": 3}));
    assert_eq!(stop(&mut c, 2), 0);
    // A continue lets it go: a new hold is told again.
    c.ok("continue", json!({"threadId": 3}));
    assert_eq!(stop(&mut c, 3), 1);
    c.ok("disconnect", json!({}));
    c.end();

    // The time left counts from the rank's first stop; past the timeout it says so.
    let five = UNIX_EPOCH + Duration::from_secs(5 * 3600);
    let nccl = json!({"rank": 3, "world_size": 8, "backend": "nccl", "timeout_s": 600.0});
    assert_eq!(
        collective_notice("rank 3", true, &nccl, Duration::from_secs(100), five).unwrap(),
        "rankscope: rank 3 is stopped: the other 7 ranks wait for it in their next collective; nccl fails a collective that waits 10 min: about 8 min 20 s left (until 05:08:20 UTC)"
    );
    let late = collective_notice("rank 3", true, &nccl, Duration::from_secs(700), five).unwrap();
    assert!(late.ends_with("; nccl fails a collective that waits 10 min, and rank 3 has been held longer: the others may have failed"), "{late}");
    // Nothing read of torch.distributed: said in a job session, without the time.
    assert_eq!(
        collective_notice("rank 0", true, &Value::Null, Duration::ZERO, five).unwrap(),
        "rankscope: rank 0 is stopped: the other ranks wait for it in their next collective (the backend's collective timeout could not be read)"
    );
    // One process on its own: nothing to say.
    assert_eq!(
        collective_notice("process 9", false, &Value::Null, Duration::ZERO, five),
        None
    );
    let alone = json!({"rank": 0, "world_size": 1, "backend": "gloo", "timeout_s": 1800.0});
    assert_eq!(
        collective_notice("process 9", false, &alone, Duration::ZERO, five),
        None
    );
}
