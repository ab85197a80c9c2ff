//! Answers the CLI's requests. Metadata and the environment are served
//! without touching Python; stacks and eval attach to the interpreter only
//! for as long as the Python helper (`rankscope._probe`) runs.

use std::io::{self, Write};

use pyo3::prelude::*;
use rankscope_core::http::{self, Request, Response};
use rankscope_core::protocol::{EnvReply, EnvVar, EvalInterrupt, EvalInterruptReply, EvalRequest};
use rankscope_core::secrets;
use rankscope_server::Handler;

use crate::pyjson::Sink;

/// Its metadata is set right after the server binds (the TCP port is known
/// only then); requests that arrive before that get a 503. It changes once
/// more if `torch.distributed` assigns the rank.
#[derive(Default)]
pub struct ProbeHandler {
    meta_json: std::sync::RwLock<Option<String>>,
}

impl ProbeHandler {
    pub fn set_meta(&self, meta_json: String) {
        *self.meta_json.write().unwrap_or_else(|e| e.into_inner()) = Some(meta_json);
    }

    pub fn meta(&self) -> Option<String> {
        self.meta_json
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Handler for ProbeHandler {
    /// `/v1/memory` answers with `python.tensors`' rows, 100 k of them in a
    /// big program: streamed (see `stream_helper`).
    fn respond(&self, request: &Request, out: &mut (dyn Write + Send)) -> io::Result<()> {
        match (
            request.method.as_str(),
            request.path.as_str(),
            std::str::from_utf8(&request.body),
        ) {
            ("POST", "/v1/memory", Ok(body)) if self.meta().is_some() => stream_helper(
                "rankscope._probe.memory",
                "handle",
                (body.to_string(),),
                out,
            ),
            ("GET", "/v1/table", _)
                if self.meta().is_some() && request.query_param("name").is_some() =>
            {
                let mut reply = Spilling::new(out);
                match table_reply(request, &mut reply) {
                    Ok(()) => reply.finish(),
                    Err(e) if !reply.started => {
                        http::write_response(reply.out, &Response::error(404, &e))
                    }
                    Err(e) => Err(io::Error::other(e)),
                }
            }
            _ => http::write_response(out, &self.handle(request)),
        }
    }

    fn respond_watching(
        &self,
        request: &Request,
        out: &mut (dyn Write + Send),
        gone: &dyn Fn() -> bool,
    ) -> io::Result<()> {
        match (request.method.as_str(), request.path.as_str()) {
            // A sampling ends when its client hangs up (a CLI killed): it
            // would sample for nobody, on a thread of the program's process.
            ("POST", "/v1/profile") if self.meta().is_some() => {
                // Until the answer is written: a probe that stops waits for it.
                let _answering = crate::profile_self::answering();
                http::write_response(
                    out,
                    &crate::profile_self::handle(&request.body, self.meta(), gone),
                )
            }
            _ => self.respond(request, out),
        }
    }

    fn handle(&self, request: &Request) -> Response {
        let route = (request.method.as_str(), request.path.as_str());
        match route {
            _ if self.meta().is_none() => Response::error(503, "probe is starting"),
            ("GET", "/v1/meta") => Response::json(200, self.meta().unwrap_or_default()),
            ("GET", "/v1/env") => env_reply(),
            ("GET", "/v1/stacks") => {
                let with_locals = request.query_flag("locals");
                let count_only = request.query_flag("count");
                let max_depth = request
                    .query_param("max_depth")
                    .and_then(|v| v.parse::<i64>().ok());
                let thread_name = request.query_param("thread_name").map(percent_decode);
                let thread_id = request
                    .query_param("thread_id")
                    .and_then(|v| v.parse::<i64>().ok());
                let fields = request.query_param("fields").map(percent_decode);
                let all_frames = request.query_flag("all_frames");
                call_helper(
                    "rankscope._probe.stacks",
                    "collect",
                    (
                        with_locals,
                        count_only,
                        max_depth,
                        thread_name,
                        thread_id,
                        fields,
                        all_frames,
                    ),
                )
            }
            ("POST", "/v1/eval") => match serde_json::from_slice::<EvalRequest>(&request.body) {
                Ok(eval) => call_helper(
                    "rankscope._probe.evaluate",
                    "run",
                    (
                        eval.code,
                        eval.timeout_s,
                        eval.check_only,
                        eval.thread,
                        eval.frame,
                        eval.id,
                    ),
                ),
                Err(e) => Response::error(400, &format!("bad eval request: {e}")),
            },
            ("POST", "/v1/eval/interrupt") => {
                match serde_json::from_slice::<EvalInterrupt>(&request.body) {
                    Ok(which) => interrupt_eval(&which.id),
                    Err(e) => Response::error(400, &format!("bad interrupt request: {e}")),
                }
            }
            ("GET", "/v1/job") => Response::json(200, crate::registry::job_entries()),
            ("POST", "/v1/breakpoints") => match std::str::from_utf8(&request.body) {
                Ok(body) => call_helper(
                    "rankscope._probe.breakpoints",
                    "handle",
                    (body.to_string(),),
                ),
                Err(_) => Response::error(400, "a breakpoint request is JSON text"),
            },
            ("POST", "/v1/debug") => match std::str::from_utf8(&request.body) {
                Ok(body) => debug_request(body),
                Err(_) => Response::error(400, "a debug request is JSON text"),
            },
            ("POST", "/v1/torch") => match std::str::from_utf8(&request.body) {
                Ok(body) => call_helper("rankscope._probe.torch", "handle", (body.to_string(),)),
                Err(_) => Response::error(400, "a torch request is JSON text"),
            },
            ("POST", "/v1/memory") => match std::str::from_utf8(&request.body) {
                Ok(body) => call_helper("rankscope._probe.memory", "handle", (body.to_string(),)),
                Err(_) => Response::error(400, "a memory request is JSON text"),
            },
            ("POST", "/v1/profile") => {
                crate::profile_self::handle(&request.body, self.meta(), &|| false)
            }
            ("POST", "/v1/profile/stop") => crate::profile_self::stop(&request.body),
            ("GET", "/v1/table") => match request.query_param("name") {
                // Answered by `respond`, streamed; here for a name missing.
                Some(_) => {
                    let mut text = Vec::new();
                    match table_reply(request, &mut text) {
                        Ok(()) => Response::json(200, text),
                        Err(e) => Response::error(404, &e),
                    }
                }
                None => Response::error(400, "which table? /v1/table?name=python.torch_trace"),
            },
            (
                _,
                "/v1/meta" | "/v1/env" | "/v1/stacks" | "/v1/eval" | "/v1/eval/interrupt"
                | "/v1/breakpoints" | "/v1/debug" | "/v1/job" | "/v1/torch" | "/v1/memory"
                | "/v1/table" | "/v1/profile" | "/v1/profile/stop",
            ) => Response::error(
                405,
                &format!("{} is not allowed on {}", request.method, request.path),
            ),
            _ => Response::error(404, &format!("no endpoint {}", request.path)),
        }
    }
}

/// A table's rows from the run store, without the GIL: those the Python
/// side holds are asked for first, briefly, so that a busy or stuck
/// interpreter still hands over its rows.
fn table_reply(request: &Request, out: &mut dyn Write) -> Result<(), String> {
    let name = request
        .query_param("name")
        .map(percent_decode)
        .unwrap_or_default();
    let columns = request.query_param("columns").map(percent_decode);
    let filters = request.query_param("filter").map(percent_decode);
    crate::store::take_rows_from_python();
    crate::store::write_json(
        &name,
        columns.as_deref(),
        filters.as_deref(),
        request.query_flag("count"),
        out,
    )
}

/// A reply held until it outgrows `SPILL_BYTES`, then sent as it is
/// written, ended by the connection's end: a big table's text is never
/// whole in the target.
struct Spilling<'a> {
    out: &'a mut (dyn Write + Send),
    buf: Vec<u8>,
    started: bool,
}

const SPILL_BYTES: usize = 128 * 1024;

impl<'a> Spilling<'a> {
    fn new(out: &'a mut (dyn Write + Send)) -> Self {
        Spilling {
            out,
            buf: Vec::new(),
            started: false,
        }
    }

    fn finish(self) -> io::Result<()> {
        if self.started {
            self.out.write_all(&self.buf)?;
            self.out.flush()
        } else {
            http::write_response(self.out, &Response::json(200, self.buf))
        }
    }
}

impl Write for Spilling<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= SPILL_BYTES {
            if !self.started {
                http::write_streamed_head(&mut *self.out, "application/json")?;
                self.started = true;
            }
            self.out.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The editor's debug session. Its long poll for events (`"op": "events"`)
/// asks the helper without waiting and waits between asks here, outside
/// the GIL (see `debug_wait`).
fn debug_request(body: &str) -> Response {
    let helper = |text: String| call_helper("rankscope._probe.debugger", "handle", (text,));
    let mut parsed = match serde_json::from_str::<serde_json::Value>(body) {
        Ok(parsed) if parsed.get("op").and_then(|op| op.as_str()) == Some("events") => parsed,
        _ => return helper(body.to_string()),
    };
    let wait = parsed
        .get("wait_s")
        .and_then(|w| w.as_f64())
        .unwrap_or(2.0)
        .clamp(0.0, 30.0);
    parsed["wait_s"] = 0.into();
    let ask = parsed.to_string();
    let until = std::time::Instant::now() + std::time::Duration::from_secs_f64(wait);
    loop {
        let seen = crate::debug_wait::generation();
        let response = helper(ask.clone());
        if std::time::Instant::now() >= until || !nothing_new(&response) {
            return response;
        }
        crate::debug_wait::wait_for_post(seen, until);
    }
}

/// An answer to `events` with no event, from a session still open.
fn nothing_new(response: &Response) -> bool {
    if response.status != 200 {
        return false;
    }
    let Ok(reply) = serde_json::from_slice::<serde_json::Value>(&response.body) else {
        return false;
    };
    let Some(ok) = reply.get("ok") else {
        return false;
    };
    ok.get("closed").and_then(|c| c.as_bool()) == Some(false)
        && ok
            .get("events")
            .and_then(|e| e.as_array())
            .is_some_and(|events| events.is_empty())
}

fn env_reply() -> Response {
    let mut vars: Vec<EnvVar> = std::env::vars_os()
        .map(|(k, v)| {
            let name = k.to_string_lossy().into_owned();
            let hidden = secrets::looks_secret(&name);
            let value = if hidden {
                secrets::HIDDEN.to_string()
            } else {
                v.to_string_lossy().into_owned()
            };
            EnvVar {
                name,
                value,
                hidden,
            }
        })
        .collect();
    vars.sort_by(|a, b| a.name.cmp(&b.name));
    match serde_json::to_vec(&EnvReply { vars }) {
        Ok(body) => Response::json(200, body),
        Err(e) => Response::error(500, &e.to_string()),
    }
}

/// The REPL's Ctrl-C: `KeyboardInterrupt` in the eval's own thread only (it
/// is a probe thread), never in the program's.
fn interrupt_eval(eval_id: &str) -> Response {
    let interrupted = crate::gil::attach(|py| {
        let exception = py.get_type::<pyo3::exceptions::PyKeyboardInterrupt>();
        crate::deadline::interrupt(py, eval_id, exception.as_any())
    });
    match interrupted {
        None => Response::error(503, "the interpreter is shutting down"),
        Some(interrupted) => match serde_json::to_vec(&EvalInterruptReply { interrupted }) {
            Ok(body) => Response::json(200, body),
            Err(e) => Response::error(500, &e.to_string()),
        },
    }
}

/// Calls a function of the probe's Python helper, which returns JSON text.
/// Any Python error becomes a 500 for the client; none reaches user code,
/// because this runs on a probe thread.
fn call_helper<A>(module: &str, function: &str, args: A) -> Response
where
    A: for<'py> pyo3::call::PyCallArgs<'py>,
{
    let mut sink = Sink::new(None);
    match run_helper(module, function, args, &mut sink) {
        None => Response::error(503, "the interpreter is shutting down"),
        Some(Ok(())) => Response::json(200, sink.into_text()),
        Some(Err(err)) => helper_failed(&err),
    }
}

/// `call_helper` for a reply that may be too big to hold whole in the
/// target: once its text outgrows the sink's limit it goes out as it is
/// written, and the connection's end ends it. A helper that fails after
/// that leaves the client a reply cut short.
fn stream_helper<A>(
    module: &str,
    function: &str,
    args: A,
    out: &mut (dyn Write + Send),
) -> io::Result<()>
where
    A: for<'py> pyo3::call::PyCallArgs<'py>,
{
    let mut sink = Sink::new(Some(&mut *out));
    let outcome = run_helper(module, function, args, &mut sink);
    let started = sink.started();
    let rest = sink.into_text();
    match (outcome, started) {
        (Some(Ok(())), true) => {
            out.write_all(&rest)?;
            out.flush()
        }
        (_, true) => Err(io::Error::other("the helper failed after its reply began")),
        (None, false) => http::write_response(
            out,
            &Response::error(503, "the interpreter is shutting down"),
        ),
        (Some(Ok(())), false) => http::write_response(out, &Response::json(200, rest)),
        (Some(Err(err)), false) => http::write_response(out, &helper_failed(&err)),
    }
}

fn run_helper<A>(module: &str, function: &str, args: A, sink: &mut Sink<'_>) -> Option<PyResult<()>>
where
    A: for<'py> pyo3::call::PyCallArgs<'py>,
{
    crate::gil::attach(|py| -> PyResult<()> {
        let had_threading = threading_imported(py);
        let result = py.import(module).and_then(|m| {
            let reply = m.call_method1(function, args)?;
            match reply.extract::<String>() {
                Ok(text) => {
                    sink.set_text(text);
                    Ok(())
                }
                // Plain dicts and lists: turned into JSON here, so the
                // helper needs no `json` import in the program.
                Err(_) => crate::pyjson::write_json(&reply, sink),
            }
        });
        if !had_threading && threading_imported(py) {
            // This probe thread imported threading first (user code in an
            // eval, or a helper): it must not stay threading's main thread.
            py.import("rankscope._probe.mainthread")?
                .call_method0("repair")?;
        }
        result
    })
}

fn helper_failed(err: &PyErr) -> Response {
    let message =
        Python::try_attach(|py| err.to_string() + &traceback_of(py, err)).unwrap_or_default();
    Response::error(500, &format!("probe helper failed: {message}"))
}

fn threading_imported(py: Python<'_>) -> bool {
    py.import("sys")
        .and_then(|sys| sys.getattr("modules")?.contains("threading"))
        .unwrap_or(false)
}

fn traceback_of(py: Python<'_>, err: &PyErr) -> String {
    err.traceback(py)
        .and_then(|tb| tb.format().ok())
        .map(|text| format!("\n{text}"))
        .unwrap_or_default()
}

/// `%XX` escapes of a query parameter (a thread name may hold anything).
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], bytes.get(i + 1..i + 3)) {
            (b'%', Some(hex)) => match std::str::from_utf8(hex)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(byte) => {
                    out.push(byte);
                    i += 3;
                    continue;
                }
                None => out.push(b'%'),
            },
            (byte, _) => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
