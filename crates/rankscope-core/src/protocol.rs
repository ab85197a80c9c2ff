//! The JSON messages exchanged between the CLI and a probe.
//!
//! Endpoints (all under `/v1`):
//! - `GET  /v1/meta`             -> [`ProcessMeta`]
//! - `GET  /v1/stacks[?locals]`  -> [`StacksReply`] (see [`StacksQuery`] for what it may leave out)
//! - `POST /v1/eval`             [`EvalRequest`] -> [`EvalReply`]
//! - `POST /v1/eval/interrupt`   [`EvalInterrupt`] -> [`EvalInterruptReply`]
//! - `GET  /v1/env`              -> [`EnvReply`] (secret values masked by the probe)

use serde::{Deserialize, Serialize};

/// Who a probe is. Written next to the socket at start and served on `/v1/meta`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcessMeta {
    pub pid: u32,
    pub ppid: u32,
    pub host: String,
    /// Global rank from the launcher's environment; 0 outside a job.
    pub rank: i64,
    pub local_rank: i64,
    pub world_size: i64,
    pub cmdline: Vec<String>,
    pub exe: String,
    pub cwd: String,
    pub python_version: String,
    /// Seconds since the Unix epoch at which the probe started.
    pub started_at: f64,
    /// Seconds since the Unix epoch at which the process started (from
    /// `/proc/self/stat`): an injected probe starts long after its process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_started_at: Option<f64>,
    pub rankscope_version: String,
    pub protocol: u32,
    /// `tcp://host:port` when TCP is on.
    #[serde(default)]
    pub tcp: Option<String>,
    /// The job this process is a rank of, from the launcher
    /// (TORCHELASTIC_RUN_ID, SLURM_JOB_ID, Open MPI's job id); None outside a job.
    #[serde(default)]
    pub job_id: Option<String>,
    /// Where in the process's memory the probe keeps the torch step (an
    /// i64, `i64::MIN` while no step is known): a profiler reading the
    /// process from outside reads it at each sample, without a request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_address: Option<u64>,
}

impl ProcessMeta {
    /// The rank, for a process that is a rank of a job; None for one of no
    /// job (its `rank` is 0 there, which a table must not show as rank 0:
    /// `rankscope list` shows `-`).
    pub fn job_rank(&self) -> Option<i64> {
        (self.world_size > 1 || self.job_id.is_some()).then_some(self.rank)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Local {
    pub name: String,
    pub repr: String,
    #[serde(rename = "type")]
    pub type_name: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Frame {
    pub func: String,
    #[serde(default)]
    pub qualname: String,
    #[serde(default)]
    pub file: String,
    /// The line being executed now, not the line of the `def`.
    pub lineno: i64,
    #[serde(default)]
    pub locals: Option<Vec<Local>>,
    /// The shared object a native (C, C++, Rust) frame runs in; None for a
    /// Python frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub native_module: Option<String>,
}

impl Frame {
    pub fn is_native(&self) -> bool {
        self.native_module.is_some()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ThreadStack {
    /// `threading.get_ident()` of the thread.
    pub thread_id: u64,
    /// The kernel's thread id, when Python knows it.
    #[serde(default)]
    pub native_id: Option<u64>,
    pub name: String,
    #[serde(default)]
    pub daemon: bool,
    #[serde(default)]
    pub is_main: bool,
    /// Known only when read from outside: a probe runs holding the GIL itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holds_gil: Option<bool>,
    /// Innermost frame first.
    pub frames: Vec<Frame>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StacksReply {
    /// Seconds since the Unix epoch at which the stacks were read.
    pub taken_at: f64,
    pub threads: Vec<ThreadStack>,
    /// Only how many threads and frames there are (`threads` is empty): what
    /// a query that reads no per-frame column needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counts: Option<StackCounts>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct StackCounts {
    pub threads: u64,
    pub frames: u64,
}

/// What a stacks request may leave out: pushed down from SQL, so that the
/// wire carries only the rows and columns a query reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct StacksQuery {
    pub locals: bool,
    pub count_only: bool,
    /// At most this many frames per thread, innermost first.
    pub max_depth: Option<i64>,
    pub thread_name: Option<String>,
    pub thread_id: Option<i64>,
    /// Frame fields beyond func and lineno (`file`, `qualname`); None: all.
    pub fields: Option<Vec<&'static str>>,
    /// Keep rankscope's own frames (left out by default, and not counted
    /// in `depth`).
    pub all_frames: bool,
}

impl StacksQuery {
    /// The request path, `/v1/stacks?...`.
    pub fn path(&self) -> String {
        let mut params = Vec::new();
        if self.locals {
            params.push("locals=1".to_string());
        }
        if self.count_only {
            params.push("count=1".to_string());
        }
        if let Some(depth) = self.max_depth {
            params.push(format!("max_depth={depth}"));
        }
        if let Some(name) = &self.thread_name {
            params.push(format!("thread_name={}", percent_encode(name)));
        }
        if let Some(id) = self.thread_id {
            params.push(format!("thread_id={id}"));
        }
        if let Some(fields) = &self.fields {
            params.push(format!("fields={}", fields.join(",")));
        }
        if self.all_frames {
            params.push("all_frames=1".to_string());
        }
        if params.is_empty() {
            "/v1/stacks".to_string()
        } else {
            format!("/v1/stacks?{}", params.join("&"))
        }
    }
}

fn percent_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvalRequest {
    pub code: String,
    /// Interrupt the code after this many seconds (it may still be stuck in C).
    pub timeout_s: f64,
    /// With `check_only`, the probe only reports whether `code` is a complete
    /// statement (what a REPL needs for multi-line input), and runs nothing.
    #[serde(default)]
    pub check_only: bool,
    /// Names this eval for `POST /v1/eval/interrupt` (the REPL's Ctrl-C);
    /// chosen by the client, unique enough among the evals running at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Run in a frame of this thread (a name, `threading` ident in hex or
    /// decimal, or kernel tid) instead of `__main__`; with `frame` alone,
    /// the main thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<String>,
    /// The frame's depth as `bt` and `python.backtrace` number it (0 =
    /// innermost; rankscope's own frames are not counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame: Option<u32>,
}

impl EvalRequest {
    /// Code to run in `__main__`.
    pub fn new(code: impl Into<String>, timeout_s: f64) -> EvalRequest {
        EvalRequest {
            code: code.into(),
            timeout_s,
            check_only: false,
            id: None,
            thread: None,
            frame: None,
        }
    }

    /// The same request aimed at a thread and frame (None, None: `__main__`).
    pub fn at(mut self, thread: Option<String>, frame: Option<u32>) -> EvalRequest {
        self.thread = thread;
        self.frame = frame;
        self
    }

    /// Whether it names a thread or frame rather than `__main__`.
    pub fn in_frame(&self) -> bool {
        self.thread.is_some() || self.frame.is_some()
    }
}

/// Raise `KeyboardInterrupt` in the thread that runs the eval named `id`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvalInterrupt {
    pub id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvalInterruptReply {
    /// False when no eval of that id runs (it has just ended, or never began).
    pub interrupted: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EvalReply {
    pub stdout: String,
    pub stderr: String,
    /// `repr()` of a trailing expression, when there is one and it is not None.
    pub value: Option<String>,
    /// A formatted traceback when the code raised.
    pub error: Option<String>,
    /// True when the code was interrupted by the timeout.
    #[serde(default)]
    pub timed_out: bool,
    /// With `check_only`: the code needs more lines.
    #[serde(default)]
    pub incomplete: bool,
    /// With `thread`/`frame`: the frame the code ran in, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame: Option<String>,
    /// The code did not run: the request named a thread or frame that is
    /// not there. `error` says which in one line; this says what to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// What the user should know about the run, e.g. that Python 3.11 and
    /// 3.12 drop writes to a running function's locals.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EnvVar {
    pub name: String,
    pub value: String,
    pub hidden: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EnvReply {
    pub vars: Vec<EnvVar>,
}

/// Body of every non-200 answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorReply {
    pub error: String,
}

/// `GET /v1/table?name=python.torch_trace[&columns=a,b][&filter=JSON][&count=1]`:
/// the rows of a table the probe keeps in memory, in its own column order
/// (`columns`), or with `count=1` only how many rows match.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ProbeTableReply {
    pub columns: Vec<String>,
    #[serde(default)]
    pub rows: Vec<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
}

/// The request path for a probe table; `filters` are `[column, op, value]`.
pub fn probe_table_path(
    name: &str,
    columns: Option<&[&str]>,
    filters: &[serde_json::Value],
    count: bool,
) -> String {
    let mut path = format!("/v1/table?name={}", percent_encode(name));
    if let Some(columns) = columns {
        path.push_str(&format!("&columns={}", percent_encode(&columns.join(","))));
    }
    if !filters.is_empty() {
        path.push_str(&format!(
            "&filter={}",
            percent_encode(&serde_json::Value::from(filters.to_vec()).to_string())
        ));
    }
    if count {
        path.push_str("&count=1");
    }
    path
}
