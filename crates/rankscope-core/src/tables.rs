//! The tables a probe's data is queried as, and how replies become rows.
//!
//! Schemas live here (not in the query crate) so the probe, the CLI and the
//! run directory agree on names and types without depending on an SQL engine.
//! Every table starts with the same four columns, so one query works for one
//! process or a whole job.

use serde_json::{json, Value};

use crate::protocol::{EnvReply, ProbeTableReply, ProcessMeta, StacksReply};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    Int64,
    Float64,
    Bool,
    Utf8,
    /// Microseconds since the Unix epoch, UTC.
    Timestamp,
    /// Text keys to text values (a JSON object in a row): `locals['loss']`.
    MapUtf8,
}

#[derive(Debug, Clone, Copy)]
pub struct Column {
    pub name: &'static str,
    pub ty: ColumnType,
}

const fn col(name: &'static str, ty: ColumnType) -> Column {
    Column { name, ty }
}

use ColumnType::*;

/// Columns every table starts with.
pub const IDENTITY_COLUMNS: [Column; 4] = [
    col("pid", Int64),
    col("rank", Int64),
    col("host", Utf8),
    col("ts", Timestamp),
];

#[derive(Debug, Clone, Copy)]
pub struct TableDef {
    pub schema: &'static str,
    pub name: &'static str,
    pub description: &'static str,
    /// Columns after the identity columns.
    pub columns: &'static [Column],
}

impl TableDef {
    pub fn qualified_name(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }

    pub fn all_columns(&self) -> impl Iterator<Item = Column> + '_ {
        IDENTITY_COLUMNS
            .iter()
            .copied()
            .chain(self.columns.iter().copied())
    }
}

pub const BACKTRACE: TableDef = TableDef {
    schema: "python",
    name: "backtrace",
    description: "one row per frame of every thread; depth 0 is the innermost frame (rankscope's own frames are left out unless --all-frames)",
    columns: &[
        col("thread_id", Int64),
        col("native_id", Int64),
        col("thread_name", Utf8),
        col("depth", Int64),
        col("func", Utf8),
        col("qualname", Utf8),
        col("file", Utf8),
        col("lineno", Int64),
        col("frame_type", Utf8),
    ],
};

pub const THREADS: TableDef = TableDef {
    schema: "python",
    name: "threads",
    description: "one row per Python thread, with its innermost frame",
    columns: &[
        col("thread_id", Int64),
        col("native_id", Int64),
        col("thread_name", Utf8),
        col("daemon", Bool),
        col("is_main", Bool),
        col("stack_depth", Int64),
        col("func", Utf8),
        col("file", Utf8),
        col("lineno", Int64),
    ],
};

pub const PROCESS_INFO: TableDef = TableDef {
    schema: "process",
    name: "info",
    description: "one row per process: command line, interpreter, rank and uptime",
    columns: &[
        col("ppid", Int64),
        col("local_rank", Int64),
        col("world_size", Int64),
        col("cmdline", Utf8),
        col("exe", Utf8),
        col("cwd", Utf8),
        col("python_version", Utf8),
        col("rankscope_version", Utf8),
        col("started_at", Timestamp),
        col("uptime_s", Float64),
    ],
};

pub const PROCESS_ENV: TableDef = TableDef {
    schema: "process",
    name: "env",
    description: "the environment; values whose names look secret are hidden",
    columns: &[col("name", Utf8), col("value", Utf8), col("hidden", Bool)],
};

pub const CRASHES: TableDef = TableDef {
    schema: "python",
    name: "crashes",
    description: "one row per crash recorded in the run directory (ts is when it happened); id is the one `rankscope crashes` shows; \
        func/file/lineno: the innermost frame, user_*: the innermost in the user's own code; \
        the job launcher's records (launcher = true) only with `rankscope query --all`",
    columns: &[
        col("id", Int64),
        col("kind", Utf8),
        col("launcher", Bool),
        col("thread", Utf8),
        col("exc_type", Utf8),
        col("message", Utf8),
        col("func", Utf8),
        col("file", Utf8),
        col("lineno", Int64),
        col("source_line", Utf8),
        col("user_func", Utf8),
        col("user_file", Utf8),
        col("user_lineno", Int64),
        col("job", Utf8),
        col("path", Utf8),
    ],
};

pub const SNAPSHOTS: TableDef = TableDef {
    schema: "python",
    name: "snapshots",
    description: "one row per breakpoint hit recorded (ts is the hit's time), at the hit frame",
    columns: &[
        col("id", Int64),
        col("bp_id", Int64),
        col("hit", Int64),
        col("thread", Utf8),
        col("func", Utf8),
        col("file", Utf8),
        col("lineno", Int64),
        col("log", Utf8),
        col("locals", MapUtf8),
    ],
};

pub const SNAPSHOT_LOCALS: TableDef = TableDef {
    schema: "python",
    name: "snapshot_locals",
    description: "one row per local of the hit frame of each snapshot (safe reprs)",
    columns: &[
        col("snapshot_id", Int64),
        col("bp_id", Int64),
        col("hit", Int64),
        col("name", Utf8),
        col("repr", Utf8),
        col("type", Utf8),
    ],
};

pub const TORCH_TRACE: TableDef = TableDef {
    schema: "python",
    name: "torch_trace",
    description: "per module per sampled step (`torch trace on`): forward (and backward) time; ts is the step's end",
    columns: &[
        col("step", Int64),
        col("module", Utf8),
        col("module_type", Utf8),
        col("depth", Int64),
        col("stage", Utf8),
        col("calls", Int64),
        col("duration_ms", Float64),
        col("gpu_ms", Float64),
        // CUDA only: the caching allocator's allocated bytes after minus
        // before, and the peak above the start (exact when the module set
        // a new peak; torch's peak counter is never reset).
        col("alloc_delta_mb", Float64),
        col("peak_delta_mb", Float64),
    ],
};

pub const TORCH_STEPS: TableDef = TableDef {
    schema: "python",
    name: "torch_steps",
    description:
        "one row per training step while the torch trace is on; the phases on sampled steps only",
    columns: &[
        col("step", Int64),
        col("sampled", Bool),
        // The step's wall time, end to end (named as the queries
        // and Probing's users name it).
        col("step_ms", Float64),
        col("dataloader_wait_ms", Float64),
        col("forward_ms", Float64),
        col("backward_ms", Float64),
        col("optimizer_ms", Float64),
        col("loss", Float64),
        col("samples", Int64),
        col("samples_per_s", Float64),
    ],
};

pub const NAN_EVENTS: TableDef = TableDef {
    schema: "python",
    name: "nan_events",
    description: "where a non-finite value first appeared (`torch nan on`): the module, step and stage, with its inputs' and weights' ranges",
    columns: &[
        col("step", Int64),
        col("stage", Utf8),
        col("module", Utf8),
        col("module_type", Utf8),
        col("what", Utf8),
        col("nonfinite", Int64),
        col("input_min", Float64),
        col("input_max", Float64),
        col("input_nonfinite", Int64),
        col("weight_min", Float64),
        col("weight_max", Float64),
        col("weight_nonfinite", Int64),
        col("loss", Float64),
        col("detail", Utf8),
        col("record", Utf8),
    ],
};

pub const GRAD_STATS: TableDef = TableDef {
    schema: "python",
    name: "grad_stats",
    description: "per parameter per sampled step (`torch grads`): gradient norm, max |g|, non-finite count, update/weight ratio, and a flag against the parameter's own history; a sharded (DTensor) parameter's row is this rank's shard",
    columns: &[
        col("step", Int64),
        col("param", Utf8),
        col("module", Utf8),
        col("numel", Int64),
        col("norm", Float64),
        col("max_abs", Float64),
        col("nonfinite", Int64),
        col("weight_norm", Float64),
        col("update_ratio", Float64),
        col("flag", Utf8),
    ],
};

pub const ACTIVATION_STATS: TableDef = TableDef {
    schema: "python",
    name: "activation_stats",
    description: "per chosen module per sampled step (`torch activations`): its output's mean, std, max |x|, zero fraction and non-finite count",
    columns: &[
        col("step", Int64),
        col("module", Utf8),
        col("module_type", Utf8),
        col("calls", Int64),
        col("shape", Utf8),
        col("dtype", Utf8),
        col("mean", Float64),
        col("std", Float64),
        col("max_abs", Float64),
        col("zero_frac", Float64),
        col("nonfinite", Int64),
    ],
};

pub const COLLECTIVES: TableDef = TableDef {
    schema: "python",
    name: "collectives",
    description: "each torch.distributed collective called from Python: op, group, its number in the group, sizes, start and end, and the torch step it was called in; `in flight` until it returns (ts is its start). Point-to-point calls (send, recv, isend, irecv) too, with their peer and tag, numbered by peer: a send's seq is its number among this rank's sends to that peer (with that tag, on that group), a receive's among its receives from it",
    columns: &[
        col("seq", Int64),
        col("op", Utf8),
        col("process_group", Utf8),
        col("group_size", Int64),
        col("group_rank", Int64),
        col("group_ranks", Utf8),
        col("state", Utf8),
        col("shapes", Utf8),
        col("dtype", Utf8),
        col("bytes", Int64),
        col("async_op", Bool),
        col("end_ts", Timestamp),
        col("duration_ms", Float64),
        col("caller", Utf8),
        col("thread", Utf8),
        col("step", Int64),
        col("peer", Int64),
        col("tag", Int64),
    ],
};

pub const FLIGHT_RECORDER: TableDef = TableDef {
    schema: "python",
    name: "flight_recorder",
    description: "torch's Flight Recorder, read on request: every collective of every process group it kept, those issued from C++ (DDP's gradient buckets) included, with its number in the group and whether it finished; empty unless the job started with TORCH_FR_BUFFER_SIZE set (ts is when it was issued)",
    columns: &[
        col("seq", Int64),
        col("op", Utf8),
        col("process_group", Utf8),
        col("group_ranks", Utf8),
        col("state", Utf8),
    ],
};

pub const MEMORY: TableDef = TableDef {
    schema: "python",
    name: "memory",
    description: "the process's memory over time: RSS, USS, PSS and swap from /proc every interval (and at each look), CUDA's allocator at torch steps where CUDA is in use",
    columns: &[
        col("step", Int64),
        col("source", Utf8),
        col("rss_mb", Float64),
        col("rss_peak_mb", Float64),
        col("uss_mb", Float64),
        col("pss_mb", Float64),
        col("swap_mb", Float64),
        col("python_traced_mb", Float64),
        col("cuda_allocated_mb", Float64),
        col("cuda_reserved_mb", Float64),
        col("cuda_peak_mb", Float64),
        col("cuda_alloc_retries", Int64),
        col("cuda_ooms", Int64),
    ],
};

pub const TENSORS: TableDef = TableDef {
    schema: "python",
    name: "tensors",
    description: "the live torch tensors, found on demand (storages counted once): shape, dtype, device, size, what they are and the best path that holds them",
    columns: &[
        col("shape", Utf8),
        col("dtype", Utf8),
        col("device", Utf8),
        col("mb", Float64),
        col("bytes", Int64),
        col("requires_grad", Bool),
        col("kind", Utf8),
        col("holder", Utf8),
        col("views", Int64),
        col("scan_complete", Bool),
    ],
};

pub const OBJECTS: TableDef = TableDef {
    schema: "python",
    name: "objects",
    description:
        "Python objects by type, found on demand: count, size, and growth since the last look",
    columns: &[
        col("type", Utf8),
        col("count", Int64),
        col("mb", Float64),
        col("count_growth", Int64),
        col("mb_growth", Float64),
    ],
};

pub const PROFILE: TableDef = TableDef {
    schema: "python",
    name: "profile",
    description: "the last profile taken of the process (`rankscope PID profile`, `cluster profile`): one row per stack, thread and torch step, with its samples; ts is the profile's start (`query --run` reads every profile kept: the last has the largest ts)",
    columns: &[
        col("thread", Utf8),
        col("thread_id", Int64),
        // The innermost frame: `GROUP BY func` gives each function's own time.
        col("func", Utf8),
        col("file", Utf8),
        col("line", Int64),
        // The stack's number of frames (python.backtrace's depth is a
        // frame's place, 0 innermost).
        col("depth", Int64),
        // Outermost first, `;` between frames, as folded text has it.
        col("stack", Utf8),
        col("samples", Int64),
        col("idle", Bool),
        col("gil", Bool),
        // The torch step the samples were taken in, where the process's
        // probe knew it (its torch features on); a stack seen in several
        // steps has a row for each.
        col("step", Int64),
        col("rate_hz", Float64),
        col("duration_s", Float64),
    ],
};

/// Where the run store keeps rows that were still open (a collective in
/// flight) when it last wrote: a folder of their own, with the table's
/// columns, so that the table's own files hold finished rows only and are
/// read as they are by any engine. A row lands there once it has been open
/// a while (a hung collective); a job killed in a hang leaves it behind.
pub const COLLECTIVES_IN_FLIGHT: TableDef = TableDef {
    schema: "python",
    name: "collectives_in_flight",
    description: "collectives still in flight when the run store last wrote (read into python.collectives by `query --run`)",
    columns: COLLECTIVES.columns,
};

/// The folder of `def`'s rows that were still open when written, and the
/// columns (after host and pid) that name one row across the two: a row
/// there counts only while the table has no finished row of that name.
pub fn in_flight_of(def: &TableDef) -> Option<(&'static TableDef, &'static [&'static str])> {
    (def.schema == COLLECTIVES.schema && def.name == COLLECTIVES.name)
        .then_some((&COLLECTIVES_IN_FLIGHT, &["process_group", "seq", "op"][..]))
}

/// Tables the CLI writes into a process's run store itself (a profile is
/// taken from outside the process, and kept like the probe's own tables).
pub const CLI_STORE_TABLES: &[TableDef] = &[PROFILE];

/// Tables whose rows a probe keeps itself (bounded rings), read through
/// `GET /v1/table?name=...`.
pub const PROBE_TABLES: &[TableDef] = &[
    SNAPSHOTS,
    SNAPSHOT_LOCALS,
    TORCH_TRACE,
    TORCH_STEPS,
    NAN_EVENTS,
    GRAD_STATS,
    ACTIVATION_STATS,
    COLLECTIVES,
    MEMORY,
];

pub const ALL_TABLES: &[TableDef] = &[
    BACKTRACE,
    THREADS,
    PROCESS_INFO,
    PROCESS_ENV,
    CRASHES,
    SNAPSHOTS,
    SNAPSHOT_LOCALS,
    TORCH_TRACE,
    TORCH_STEPS,
    NAN_EVENTS,
    GRAD_STATS,
    ACTIVATION_STATS,
    COLLECTIVES,
    FLIGHT_RECORDER,
    MEMORY,
    TENSORS,
    OBJECTS,
    PROFILE,
];

pub fn is_probe_table(def: &TableDef) -> bool {
    PROBE_TABLES
        .iter()
        .any(|t| t.schema == def.schema && t.name == def.name)
}

/// A table whose rows are kept in the run store's files (by the probe or
/// by the CLI), which `query --run` reads.
pub fn is_store_table(def: &TableDef) -> bool {
    is_probe_table(def)
        || CLI_STORE_TABLES
            .iter()
            .any(|t| t.schema == def.schema && t.name == def.name)
}

/// A probe table's rows as the probe sends them: its own column names
/// (`ts` in seconds), without pid, rank and host, which come from the
/// probe's metadata. Columns the table does not know are dropped, and
/// those the probe did not send are null.
pub fn probe_table_rows(def: &TableDef, meta: &ProcessMeta, reply: &ProbeTableReply) -> Rows {
    let index: Vec<Option<usize>> = def
        .columns
        .iter()
        .map(|c| reply.columns.iter().position(|n| n == c.name))
        .collect();
    let ts = reply.columns.iter().position(|n| n == "ts");
    reply
        .rows
        .iter()
        .map(|cells| {
            let at = ts
                .and_then(|i| cells.get(i))
                .and_then(Value::as_f64)
                .unwrap_or(0.0);
            let mut row = identity(meta, at).to_vec();
            row.extend(
                index
                    .iter()
                    .map(|i| i.and_then(|i| cells.get(i)).cloned().unwrap_or(Value::Null)),
            );
            row
        })
        .collect()
}

pub fn find_table(schema: &str, name: &str) -> Option<&'static TableDef> {
    ALL_TABLES
        .iter()
        .find(|t| t.schema.eq_ignore_ascii_case(schema) && t.name.eq_ignore_ascii_case(name))
}

/// Rows as JSON values in the order of [`TableDef::all_columns`];
/// timestamps are microseconds since the epoch.
pub type Rows = Vec<Vec<Value>>;

fn micros(seconds: f64) -> Value {
    json!((seconds * 1e6).round() as i64)
}

/// The columns every row of one process shares at one moment.
pub fn identity(meta: &ProcessMeta, taken_at: f64) -> [Value; 4] {
    [
        json!(meta.pid),
        json!(meta.job_rank()),
        json!(meta.host),
        micros(taken_at),
    ]
}

fn as_i64(v: u64) -> Value {
    // Thread idents are addresses; they fit in i64 on every platform we run on,
    // and SQL users expect a signed integer column.
    json!(v as i64)
}

pub fn backtrace_rows(meta: &ProcessMeta, stacks: &StacksReply) -> Rows {
    let mut rows = Vec::new();
    for thread in &stacks.threads {
        for (depth, frame) in thread.frames.iter().enumerate() {
            let mut row = identity(meta, stacks.taken_at).to_vec();
            row.extend([
                as_i64(thread.thread_id),
                thread.native_id.map(as_i64).unwrap_or(Value::Null),
                json!(thread.name),
                json!(depth),
                json!(frame.func),
                json!(frame.qualname),
                json!(frame.file),
                json!(frame.lineno),
                json!(if frame.is_native() {
                    "Native"
                } else {
                    "Python"
                }),
            ]);
            rows.push(row);
        }
    }
    rows
}

pub fn threads_rows(meta: &ProcessMeta, stacks: &StacksReply) -> Rows {
    stacks
        .threads
        .iter()
        .map(|thread| {
            let top = thread.frames.first();
            let mut row = identity(meta, stacks.taken_at).to_vec();
            row.extend([
                as_i64(thread.thread_id),
                thread.native_id.map(as_i64).unwrap_or(Value::Null),
                json!(thread.name),
                json!(thread.daemon),
                json!(thread.is_main),
                json!(thread.frames.len()),
                top.map(|f| json!(f.func)).unwrap_or(Value::Null),
                top.map(|f| json!(f.file)).unwrap_or(Value::Null),
                top.map(|f| json!(f.lineno)).unwrap_or(Value::Null),
            ]);
            row
        })
        .collect()
}

/// When the process started; a probe too old to say gives its own start.
fn process_start(meta: &ProcessMeta) -> f64 {
    meta.process_started_at.unwrap_or(meta.started_at)
}

pub fn info_rows(meta: &ProcessMeta, now: f64) -> Rows {
    let mut row = identity(meta, now).to_vec();
    row.extend([
        json!(meta.ppid),
        json!(meta.local_rank),
        json!(meta.world_size),
        json!(meta.cmdline.join(" ")),
        json!(meta.exe),
        json!(meta.cwd),
        json!(meta.python_version),
        json!(meta.rankscope_version),
        micros(process_start(meta)),
        json!((now - process_start(meta)).max(0.0)),
    ]);
    vec![row]
}

pub fn env_rows(meta: &ProcessMeta, env: &EnvReply, now: f64) -> Rows {
    env.vars
        .iter()
        .map(|var| {
            let mut row = identity(meta, now).to_vec();
            row.extend([json!(var.name), json!(var.value), json!(var.hidden)]);
            row
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{EnvVar, Frame, ThreadStack};

    fn meta() -> ProcessMeta {
        ProcessMeta {
            pid: 42,
            ppid: 1,
            host: "h".into(),
            rank: 3,
            local_rank: 1,
            world_size: 4,
            cmdline: vec!["python".into(), "train.py".into()],
            exe: "/usr/bin/python".into(),
            cwd: "/".into(),
            python_version: "3.11.7".into(),
            started_at: 100.0,
            process_started_at: None,
            rankscope_version: "0".into(),
            protocol: 1,
            tcp: None,
            job_id: None,
            step_address: None,
        }
    }

    fn frame(func: &str, lineno: i64) -> Frame {
        Frame {
            func: func.into(),
            qualname: func.into(),
            file: "t.py".into(),
            lineno,
            locals: None,
            native_module: None,
        }
    }

    fn stacks() -> StacksReply {
        StacksReply {
            taken_at: 101.5,
            threads: vec![
                ThreadStack {
                    thread_id: 7,
                    native_id: Some(70),
                    name: "MainThread".into(),
                    daemon: false,
                    is_main: true,
                    holds_gil: None,
                    frames: vec![frame("inner", 5), frame("outer", 9)],
                },
                ThreadStack {
                    thread_id: 8,
                    native_id: None,
                    name: "worker".into(),
                    daemon: true,
                    is_main: false,
                    holds_gil: None,
                    frames: vec![],
                },
            ],
            counts: None,
        }
    }

    #[test]
    fn every_row_matches_its_schema_width() {
        let m = meta();
        let s = stacks();
        let env = EnvReply {
            vars: vec![EnvVar {
                name: "A".into(),
                value: "b".into(),
                hidden: false,
            }],
        };
        for (def, rows) in [
            (BACKTRACE, backtrace_rows(&m, &s)),
            (THREADS, threads_rows(&m, &s)),
            (PROCESS_INFO, info_rows(&m, 102.0)),
            (PROCESS_ENV, env_rows(&m, &env, 102.0)),
        ] {
            assert!(!rows.is_empty());
            for row in rows {
                assert_eq!(
                    row.len(),
                    def.all_columns().count(),
                    "{}",
                    def.qualified_name()
                );
            }
        }
    }

    #[test]
    fn backtrace_depth_counts_from_the_innermost_frame() {
        let rows = backtrace_rows(&meta(), &stacks());
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0][7], json!(0));
        assert_eq!(rows[0][8], json!("inner"));
        assert_eq!(rows[1][7], json!(1));
        assert_eq!(rows[0][1], json!(3), "rank column");
        assert_eq!(rows[0][3], json!(101_500_000), "ts in microseconds");
    }

    #[test]
    fn a_thread_without_frames_still_has_a_threads_row() {
        let rows = threads_rows(&meta(), &stacks());
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1][9], json!(0));
        assert_eq!(rows[1][10], Value::Null);
    }

    #[test]
    fn probe_table_rows_follow_the_schema_by_column_name() {
        let reply = ProbeTableReply {
            columns: vec![
                "ts".into(),
                "module".into(),
                "step".into(),
                "unknown".into(),
            ],
            rows: vec![vec![json!(101.5), json!("fc1"), json!(4), json!("x")]],
            count: None,
        };
        let rows = probe_table_rows(&TORCH_TRACE, &meta(), &reply);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].len(), TORCH_TRACE.all_columns().count());
        assert_eq!(rows[0][1], json!(3), "rank from the metadata");
        assert_eq!(rows[0][3], json!(101_500_000), "ts in microseconds");
        assert_eq!(rows[0][4], json!(4), "step");
        assert_eq!(rows[0][5], json!("fc1"), "module");
        assert_eq!(rows[0][6], Value::Null, "a column the probe did not send");
    }

    #[test]
    fn tables_are_found_case_insensitively() {
        assert!(find_table("PYTHON", "Backtrace").is_some());
        assert!(find_table("python", "nope").is_none());
    }
}
