//! The JSON messages exchanged between the CLI and a probe.
//!
//! Endpoints (all under `/v1`):
//! - `GET  /v1/meta`             -> [`ProcessMeta`]
//! - `GET  /v1/stacks[?locals]`  -> [`StacksReply`]
//! - `POST /v1/eval`             [`EvalRequest`] -> [`EvalReply`]
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
    pub rankscope_version: String,
    pub protocol: u32,
    /// `tcp://host:port` when TCP is on.
    #[serde(default)]
    pub tcp: Option<String>,
    /// The job this process is a rank of, from the launcher
    /// (TORCHELASTIC_RUN_ID, SLURM_JOB_ID, Open MPI's job id); None outside a job.
    #[serde(default)]
    pub job_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Local {
    pub name: String,
    pub repr: String,
    #[serde(rename = "type")]
    pub type_name: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Frame {
    pub func: String,
    #[serde(default)]
    pub qualname: String,
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
