//! `rankscope PID query SQL`: the probe hands over rows, the CLI runs the SQL.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use std::collections::HashMap;

use rankscope_core::protocol::{ProcessMeta, StacksQuery, StacksReply};
use rankscope_core::tables::{self, Rows, TableDef};
use rankscope_query::{run_sql, CmpOp, Fetched, OutputFormat, QueryError, RowSource, Scan};

use crate::client::Probe;
use crate::hint::Hinted;
use crate::QueryFormat;

const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Per group, more than any Flight Recorder ring holds: all of it.
const FLIGHT_RECORDER_ROWS: usize = 1 << 20;

/// Rows of one live probe. Each distinct request is made at most once per
/// query, so a query that reads backtrace and threads the same way sees one
/// consistent moment.
pub struct LiveProbe {
    probe: Probe,
    /// Stacks come from outside, with native frames merged in.
    native: bool,
    /// python.backtrace keeps rankscope's own frames.
    all_frames: bool,
    meta: Mutex<Option<ProcessMeta>>,
    stacks: Mutex<HashMap<StacksQuery, StacksReply>>,
}

impl LiveProbe {
    /// A table the probe finds on demand (`python.tensors`, `python.objects`):
    /// only the columns the query reads are asked for, so a scan of 100 k
    /// tensors for a count sends a few fields a row.
    fn memory_table(&self, table: &TableDef, columns: Option<&[&str]>) -> Result<Rows, String> {
        let meta = self.meta()?;
        let mut request = serde_json::json!({"action": table.name});
        if let Some(columns) = columns {
            request["columns"] = serde_json::json!(columns);
        }
        let reply = self.probe.memory(&request).map_err(|e| format!("{e:#}"))?;
        let reply: rankscope_core::protocol::ProbeTableReply =
            serde_json::from_value(reply).map_err(|e| e.to_string())?;
        Ok(tables::probe_table_rows(table, &meta, &reply))
    }

    /// torch's Flight Recorder, all it keeps (none in a process without
    /// torch.distributed: the probe answers no rows, so a job's ranks
    /// answer alike).
    fn flight_recorder_table(&self, table: &TableDef) -> Result<Rows, String> {
        let meta = self.meta()?;
        let reply = self
            .probe
            .flight_recorder(FLIGHT_RECORDER_ROWS, Duration::from_secs(30))
            .map_err(|e| format!("{e:#}"))?;
        Ok(tables::probe_table_rows(table, &meta, &reply))
    }

    /// The target's run directory, from the target's environment.
    fn run_dir(&self) -> Result<PathBuf, String> {
        let env = self
            .probe
            .env(PROBE_TIMEOUT)
            .map_err(|e| format!("{e:#}"))?;
        Ok(rankscope_core::crash::run_dir_of(|name| {
            env.vars
                .iter()
                .find(|v| v.name == name && !v.hidden)
                .map(|v| v.value.clone())
        }))
    }

    pub fn new(probe: Probe, native: bool, all_frames: bool) -> LiveProbe {
        LiveProbe {
            probe,
            native,
            all_frames,
            meta: Mutex::new(None),
            stacks: Mutex::new(HashMap::new()),
        }
    }

    fn meta(&self) -> Result<ProcessMeta, String> {
        let mut cached = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        if cached.is_none() {
            *cached = Some(
                self.probe
                    .meta(PROBE_TIMEOUT)
                    .map_err(|e| format!("{e:#}"))?,
            );
        }
        Ok(cached.clone().expect("set above"))
    }

    fn stacks(&self, query: &StacksQuery) -> Result<StacksReply, String> {
        // An outside read cannot leave anything out: it reads everything once.
        let query = if self.native {
            StacksQuery::default()
        } else {
            query.clone()
        };
        let query = StacksQuery {
            all_frames: self.all_frames,
            ..query
        };
        let mut cached = self.stacks.lock().unwrap_or_else(|e| e.into_inner());
        if !cached.contains_key(&query) {
            let stacks = if self.native {
                crate::outside::read_stacks(self.probe.pid, false, true, self.all_frames)
                    .map(|(s, _)| s)
            } else {
                self.probe.stacks_query(&query, PROBE_TIMEOUT)
            };
            cached.insert(query.clone(), stacks.map_err(|e| format!("{e:#}"))?);
        }
        Ok(cached[&query].clone())
    }
}

/// What of a scan the probe's stacks request can leave out.
fn stacks_query(table: &TableDef, scan: &Scan) -> StacksQuery {
    let mut query = StacksQuery::default();
    if scan.reads_identity_only() {
        query.count_only = true;
        return query;
    }
    query.thread_name = scan
        .literal("thread_name", CmpOp::Eq)
        .and_then(|v| v.as_str())
        .map(str::to_string);
    query.thread_id = scan
        .literal("thread_id", CmpOp::Eq)
        .and_then(serde_json::Value::as_i64);
    if table.name == "backtrace" {
        // depth < N keeps the N innermost frames; depth <= N and depth = N one more.
        let below = scan
            .literal("depth", CmpOp::Lt)
            .and_then(serde_json::Value::as_i64);
        let up_to = [CmpOp::LtEq, CmpOp::Eq]
            .iter()
            .find_map(|&op| scan.literal("depth", op))
            .and_then(serde_json::Value::as_i64)
            .map(|d| d + 1);
        query.max_depth = below.into_iter().chain(up_to).min().map(|d| d.max(0));
        if let Some(columns) = &scan.columns {
            query.fields = Some(
                ["file", "qualname"]
                    .into_iter()
                    .filter(|f| columns.contains(f))
                    .collect(),
            );
        }
    }
    query
}

impl RowSource for LiveProbe {
    fn rows(&self, table: &TableDef) -> Result<Rows, String> {
        let meta = self.meta()?;
        match (table.schema, table.name) {
            ("python", "backtrace") => Ok(tables::backtrace_rows(
                &meta,
                &self.stacks(&StacksQuery::default())?,
            )),
            ("python", "threads") => Ok(tables::threads_rows(
                &meta,
                &self.stacks(&StacksQuery::default())?,
            )),
            ("process", "info") => Ok(tables::info_rows(
                &meta,
                rankscope_core::host::now_seconds(),
            )),
            ("process", "env") => {
                let env = self
                    .probe
                    .env(PROBE_TIMEOUT)
                    .map_err(|e| format!("{e:#}"))?;
                Ok(tables::env_rows(
                    &meta,
                    &env,
                    rankscope_core::host::now_seconds(),
                ))
            }
            ("python", "tensors") | ("python", "objects") => self.memory_table(table, None),
            ("python", "flight_recorder") => self.flight_recorder_table(table),
            _ if tables::is_probe_table(table) => {
                match self.probe_table(table, &Scan::default())? {
                    Fetched::Rows(rows) => Ok(rows),
                    Fetched::Counts(_) | Fetched::Batches(_) => {
                        Err("a full scan came back as counts".into())
                    }
                }
            }
            ("python", "crashes") => {
                let dir = self.run_dir()?;
                if !dir.is_dir() {
                    return Ok(Vec::new());
                }
                super::crashes::table_rows(Some(dir), Some(meta.pid), true)
                    .map_err(|e| format!("{e:#}"))
            }
            _ => Err(format!("no rows for {}", table.qualified_name())),
        }
    }

    fn scan(&self, table: &TableDef, scan: &Scan) -> Result<Fetched, String> {
        if tables::is_probe_table(table) {
            return self.probe_table(table, scan);
        }
        if table.schema == "python" && matches!(table.name, "tensors" | "objects") {
            return self
                .memory_table(table, scan.columns.as_deref())
                .map(Fetched::Rows);
        }
        if tables::is_store_table(table) {
            // Written by the CLI into the process's run store (a profile):
            // that process's files in its run directory, its last profile
            // (`query --run` reads them all). Rows older than the process
            // are another's that had its PID before.
            let meta = self.meta()?;
            let batches = rankscope_store::read_table_of(
                &[self.run_dir()?],
                table,
                None,
                Some((&meta.host, meta.pid)),
            )
            .map_err(|e| e.to_string())?;
            let started = meta.process_started_at.unwrap_or(meta.started_at);
            let since_us = ((started - 0.05) * 1e6) as i64;
            return rankscope_query::last_since(batches, since_us, scan.columns.as_deref())
                .map(Fetched::Batches)
                .map_err(|e| e.to_string());
        }
        if table.schema != "python" || !matches!(table.name, "backtrace" | "threads") || self.native
        {
            return self.rows(table).map(Fetched::Rows);
        }
        let meta = self.meta()?;
        let stacks = self.stacks(&stacks_query(table, scan))?;
        if let Some(counts) = stacks.counts {
            let count = if table.name == "backtrace" {
                counts.frames
            } else {
                counts.threads
            };
            return Ok(Fetched::Counts(vec![(
                tables::identity(&meta, stacks.taken_at),
                count as usize,
            )]));
        }
        Ok(Fetched::Rows(if table.name == "backtrace" {
            tables::backtrace_rows(&meta, &stacks)
        } else {
            tables::threads_rows(&meta, &stacks)
        }))
    }
}

impl LiveProbe {
    /// A table the probe keeps in memory: the scan's columns and
    /// `column op literal` filters go to the probe; a scan of the identity
    /// columns only is answered with a count.
    fn probe_table(&self, table: &TableDef, scan: &Scan) -> Result<Fetched, String> {
        let meta = self.meta()?;
        let filters: Vec<serde_json::Value> = scan
            .filters
            .iter()
            // The probe keeps ts in seconds; the engine compares it in microseconds.
            .filter(|f| f.column != "ts")
            .map(|f| {
                let op = match f.op {
                    CmpOp::Eq => "=",
                    CmpOp::Lt => "<",
                    CmpOp::LtEq => "<=",
                    CmpOp::Gt => ">",
                    CmpOp::GtEq => ">=",
                };
                serde_json::json!([f.column, op, f.value])
            })
            .collect();
        // Every row has its own ts, so only pid, rank and host make a count enough.
        let count =
            scan.reads_identity_only() && scan.columns.as_ref().is_some_and(|c| !c.contains(&"ts"));
        let reply = self
            .probe
            .probe_table(
                &table.qualified_name(),
                scan.columns.as_deref(),
                &filters,
                count,
                PROBE_TIMEOUT,
            )
            .map_err(|e| format!("{e:#}"))?;
        if count {
            let n = reply.count.unwrap_or(0) as usize;
            return Ok(Fetched::Counts(vec![(
                tables::identity(&meta, rankscope_core::host::now_seconds()),
                n,
            )]));
        }
        Ok(Fetched::Rows(tables::probe_table_rows(
            table, &meta, &reply,
        )))
    }
}

/// What is left on disk when no process is asked: the run directories.
/// A job's run directories, and its processes (host, PID).
pub type JobFiles = (Vec<PathBuf>, Vec<(String, u32)>);

#[derive(Default)]
struct RunDirs {
    run: Option<PathBuf>,
    /// python.crashes keeps the job launcher's records (`--all`).
    all: bool,
    /// A job's: its run directories, and the processes whose files are
    /// read (None: every process's).
    job: Option<JobFiles>,
}

impl RowSource for RunDirs {
    fn scan(&self, table: &TableDef, scan: &Scan) -> Result<Fetched, String> {
        if tables::is_store_table(table) {
            // The run store's files, read as they are (Arrow batches), the
            // query's columns only.
            let read = match &self.job {
                Some((dirs, processes)) => rankscope_store::read_table_of_processes(
                    dirs,
                    table,
                    scan.columns.as_deref(),
                    processes,
                ),
                None => rankscope_store::read_table(
                    &rankscope_core::crash::run_dirs(self.run.clone()),
                    table,
                    scan.columns.as_deref(),
                ),
            };
            return read.map(Fetched::Batches).map_err(|e| e.to_string());
        }
        self.rows(table).map(Fetched::Rows)
    }

    fn rows(&self, table: &TableDef) -> Result<Rows, String> {
        match (table.schema, table.name) {
            ("python", "crashes") => super::crashes::table_rows(self.run.clone(), None, self.all).map_err(|e| format!("{e:#}")),
            _ => Err(format!(
                "{} is read from a live process: run `rankscope PID query ...` (`rankscope list` shows the PIDs)",
                table.qualified_name()
            )),
        }
    }
}

/// `rankscope query SQL`: no process, only what the run directories hold.
pub fn run_offline(run: Option<PathBuf>, all: bool, sql: &str, format: QueryFormat) -> Result<u8> {
    if let Some(dir) = &run {
        check_run_dir(dir)?;
    }
    execute(
        Arc::new(RunDirs {
            run,
            all,
            ..RunDirs::default()
        }),
        sql,
        format,
    )
}

/// The same over a job's run directories, its processes' rows only.
pub fn run_offline_of(
    dirs: Vec<PathBuf>,
    processes: Vec<(String, u32)>,
    sql: &str,
    format: QueryFormat,
) -> Result<u8> {
    execute(
        Arc::new(RunDirs {
            run: dirs.first().cloned(),
            job: Some((dirs, processes)),
            ..RunDirs::default()
        }),
        sql,
        format,
    )
}

/// The rows `sql` gives over the run directory `run` (no process), as JSON
/// objects: for commands that answer from what a job left.
/// With `job`, only that job's processes' rows (its run directories,
/// its processes).
pub fn offline_rows(
    run: &std::path::Path,
    job: Option<JobFiles>,
    sql: &str,
) -> Result<Vec<serde_json::Value>> {
    check_run_dir(run)?;
    let source = Arc::new(RunDirs {
        run: Some(run.to_path_buf()),
        job,
        ..RunDirs::default()
    });
    let (schema, batches) = run_sql(source, sql).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let text = rankscope_query::render(&schema, &batches, OutputFormat::Json, None)?;
    Ok(serde_json::from_str(&text)?)
}

/// A mistyped `--run` would read as a run with no rows. A run directory
/// holds what its processes left (`tables/`, `ranks/`, crash records,
/// native logs, post-mortem sockets), or nothing yet.
fn check_run_dir(dir: &std::path::Path) -> Result<()> {
    let hint = "--run names the folder a job's processes write to (their RANKSCOPE_RUN_DIR); \
                leave it out to read every job under ~/.local/state/rankscope/runs";
    let entries: Vec<String> = match std::fs::read_dir(dir) {
        Ok(read) => read
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Hinted::new(format!("no run directory at {}", dir.display()), hint).into())
        }
        Err(e) => {
            return Err(Hinted::new(format!("cannot read {}: {e}", dir.display()), hint).into())
        }
    };
    let left_by_a_run = |name: &str| {
        matches!(name, "tables" | "ranks")
            || (name.starts_with("crash-") && name.ends_with(".json"))
            || (name.starts_with("native-") && name.ends_with(".log"))
            || (name.starts_with("debug-") && name.ends_with(".sock"))
    };
    if entries.is_empty() || entries.iter().any(|name| left_by_a_run(name)) {
        return Ok(());
    }
    Err(Hinted::new(
        format!(
            "{} is not a run directory (no tables/, ranks/ or crash records in it)",
            dir.display()
        ),
        hint,
    )
    .into())
}

pub fn run(
    probe: Probe,
    sql: &str,
    native: bool,
    all_frames: bool,
    format: QueryFormat,
) -> Result<u8> {
    if native {
        // Said before any SQL runs, whatever tables the query names.
        crate::outside::require_native()?;
    }
    execute(
        Arc::new(LiveProbe::new(probe, native, all_frames)),
        sql,
        format,
    )
}

pub fn execute(source: Arc<dyn RowSource>, sql: &str, format: QueryFormat) -> Result<u8> {
    let (schema, batches) = run_sql(source, sql).map_err(|e| match e {
        QueryError::Sql(message) => Hinted::new(
            format!("query failed: {message}"),
            "`SHOW TABLES` lists the tables; `DESCRIBE python.torch_steps` (any table) shows its columns",
        ),
        QueryError::Render(message) => Hinted::new(format!("cannot print the result: {message}"), "try --format csv"),
    })?;
    let format = match format {
        QueryFormat::Table => OutputFormat::Table,
        QueryFormat::Csv => OutputFormat::Csv,
        QueryFormat::Json => OutputFormat::Json,
    };
    let text = rankscope_query::render(&schema, &batches, format, crate::term::width())?;
    print!("{text}");
    Ok(0)
}
