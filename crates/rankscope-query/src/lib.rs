//! SQL over rankscope's tables, on the user's side.
//!
//! Tables are resolved lazily: a query fetches only the tables it names, from
//! whatever [`RowSource`] the caller gives (one live probe today; run
//! directories and every rank of a job later). The probe never plans or runs
//! a query: a sick target only hands over rows.

mod arrow_rows;
mod render;
pub mod table;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::{
    MemTable, MemoryCatalogProvider, SchemaProvider, Session, TableProvider,
};
use datafusion::error::DataFusionError;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown, TableType};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use rankscope_core::tables::{Rows, TableDef, ALL_TABLES, IDENTITY_COLUMNS};
use thiserror::Error;

pub use arrow_rows::{arrow_schema, rows_to_batch};
pub use render::{render, OutputFormat};

/// Hands over the rows of a table; implemented by the CLI for live probes.
pub trait RowSource: Send + Sync {
    fn rows(&self, table: &TableDef) -> Result<Rows, String>;

    /// The rows a scan needs: a source that can leave rows or columns out
    /// (a probe, over the wire) overrides this; the engine still applies
    /// every filter itself, so leaving out too little is never wrong.
    fn scan(&self, table: &TableDef, _scan: &Scan) -> Result<Fetched, String> {
        self.rows(table).map(Fetched::Rows)
    }
}

/// What a query reads of one table: pushed down to the source.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scan {
    /// The columns read; None: all. Empty: only how many rows there are.
    pub columns: Option<Vec<&'static str>>,
    /// `column op literal` conditions that every returned row must meet
    /// (the engine checks them again).
    pub filters: Vec<Filter>,
}

impl Scan {
    /// Whether the query reads only the identity columns (pid, rank, host,
    /// ts): one process's rows then differ in nothing, and a count is enough.
    pub fn reads_identity_only(&self) -> bool {
        self.columns.as_ref().is_some_and(|cols| {
            cols.iter()
                .all(|c| IDENTITY_COLUMNS.iter().any(|i| i.name == *c))
        })
    }

    /// The literal a column is compared to with `op`, if the query says so.
    pub fn literal(&self, column: &str, op: CmpOp) -> Option<&serde_json::Value> {
        self.filters
            .iter()
            .find(|f| f.column == column && f.op == op)
            .map(|f| &f.value)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    pub column: &'static str,
    pub op: CmpOp,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Lt,
    LtEq,
    Gt,
    GtEq,
}

/// A source's answer to a scan.
pub enum Fetched {
    /// Full rows (every column; those not read may be null).
    Rows(Rows),
    /// For a scan that reads identity columns only: per process, its
    /// identity values (pid, rank, host, ts) and how many rows it has.
    Counts(Vec<([serde_json::Value; 4], usize)>),
    /// Arrow batches in the table's schema (from the run store's files).
    Batches(Vec<RecordBatch>),
}

#[derive(Debug, Error)]
pub enum QueryError {
    /// The engine's own message: a parse, plan or execution error.
    #[error("{0}")]
    Sql(String),
    #[error("{0}")]
    Render(String),
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        // Strip the wrapping a lazy table adds, so the user sees the cause.
        QueryError::Sql(e.strip_backtrace())
    }
}

pub const CATALOG: &str = "rankscope";

struct LazySchema {
    schema: &'static str,
    source: Arc<dyn RowSource>,
}

impl fmt::Debug for LazySchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LazySchema({})", self.schema)
    }
}

impl LazySchema {
    fn def(&self, name: &str) -> Option<&'static TableDef> {
        ALL_TABLES
            .iter()
            .find(|t| t.schema == self.schema && t.name == name)
    }
}

#[async_trait]
impl SchemaProvider for LazySchema {
    fn table_names(&self) -> Vec<String> {
        ALL_TABLES
            .iter()
            .filter(|t| t.schema == self.schema)
            .map(|t| t.name.to_string())
            .collect()
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>, DataFusionError> {
        Ok(self.def(name).map(|def| {
            Arc::new(LazyTable {
                def,
                source: self.source.clone(),
            }) as Arc<dyn TableProvider>
        }))
    }

    fn table_exist(&self, name: &str) -> bool {
        self.def(name).is_some()
    }
}

/// A table whose schema is known up front and whose rows are fetched only
/// when a plan scans it: `SHOW TABLES` and `information_schema` never reach a
/// probe, and a query fetches only the tables it reads.
struct LazyTable {
    def: &'static TableDef,
    source: Arc<dyn RowSource>,
}

impl fmt::Debug for LazyTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LazyTable({})", self.def.qualified_name())
    }
}

#[async_trait]
impl TableProvider for LazyTable {
    fn schema(&self) -> SchemaRef {
        arrow_schema(self.def)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>, DataFusionError> {
        // Inexact: the source may return more rows than match, and the
        // engine filters again, so a source that ignores a filter is correct.
        Ok(filters
            .iter()
            .map(|f| {
                if pushed_filter(self.def, f).is_some() {
                    TableProviderFilterPushDown::Inexact
                } else {
                    TableProviderFilterPushDown::Unsupported
                }
            })
            .collect())
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        let def = self.def;
        let names: Vec<&'static str> = def.all_columns().map(|c| c.name).collect();
        let scan = Scan {
            columns: projection.map(|p| p.iter().map(|&i| names[i]).collect()),
            filters: filters
                .iter()
                .filter_map(|f| pushed_filter(def, f))
                .collect(),
        };
        let fetched = self.source.scan(def, &scan).map_err(|e| {
            DataFusionError::Execution(format!("cannot read {}: {e}", def.qualified_name()))
        })?;
        match fetched {
            Fetched::Rows(rows) => {
                let batch = rows_to_batch(def, &rows)?;
                MemTable::try_new(batch.schema(), vec![vec![batch]])?
                    .scan(state, projection, filters, limit)
                    .await
            }
            Fetched::Batches(batches) => {
                // The source may have read the projected columns only: map
                // the projection onto the columns it has.
                let schema = batches
                    .first()
                    .map(|b| b.schema())
                    .unwrap_or_else(|| arrow_schema(def));
                let projection = projection
                    .map(|p| {
                        p.iter()
                            .map(|&i| schema.index_of(names[i]))
                            .collect::<Result<Vec<usize>, _>>()
                    })
                    .transpose()?;
                MemTable::try_new(schema, vec![batches])?
                    .scan(state, projection.as_ref(), filters, limit)
                    .await
            }
            Fetched::Counts(groups) => {
                let projection: Vec<usize> = projection
                    .cloned()
                    .unwrap_or_else(|| (0..names.len()).collect());
                let (schema, batches) = arrow_rows::uniform_batches(def, &projection, &groups)?;
                MemTable::try_new(schema, vec![batches])?
                    .scan(state, None, filters, limit)
                    .await
            }
        }
    }
}

/// `column op literal` (either way round) on a column of this table.
fn pushed_filter(def: &TableDef, expr: &Expr) -> Option<Filter> {
    use datafusion::logical_expr::{BinaryExpr, Operator};
    use datafusion::scalar::ScalarValue;
    let Expr::BinaryExpr(BinaryExpr { left, op, right }) = expr else {
        return None;
    };
    let (column, literal, flipped) = match (left.as_ref(), right.as_ref()) {
        (Expr::Column(c), Expr::Literal(v, _)) => (c, v, false),
        (Expr::Literal(v, _), Expr::Column(c)) => (c, v, true),
        _ => return None,
    };
    let column = def.all_columns().find(|c| c.name == column.name)?.name;
    let op = match (op, flipped) {
        (Operator::Eq, _) => CmpOp::Eq,
        (Operator::Lt, false) | (Operator::Gt, true) => CmpOp::Lt,
        (Operator::LtEq, false) | (Operator::GtEq, true) => CmpOp::LtEq,
        (Operator::Gt, false) | (Operator::Lt, true) => CmpOp::Gt,
        (Operator::GtEq, false) | (Operator::LtEq, true) => CmpOp::GtEq,
        _ => return None,
    };
    let value = match literal {
        ScalarValue::Int64(Some(v)) => serde_json::json!(v),
        ScalarValue::Int32(Some(v)) => serde_json::json!(v),
        ScalarValue::Utf8(Some(v))
        | ScalarValue::LargeUtf8(Some(v))
        | ScalarValue::Utf8View(Some(v)) => serde_json::json!(v),
        ScalarValue::Boolean(Some(v)) => serde_json::json!(v),
        _ => return None,
    };
    Some(Filter { column, op, value })
}

fn context(source: Arc<dyn RowSource>) -> SessionContext {
    let config = SessionConfig::new()
        .with_information_schema(true)
        .with_default_catalog_and_schema(CATALOG, "python")
        .with_target_partitions(1);
    let ctx = SessionContext::new_with_config(config);
    let catalog = MemoryCatalogProvider::new();
    let mut schemas: Vec<&'static str> = ALL_TABLES.iter().map(|t| t.schema).collect();
    schemas.dedup();
    for schema in schemas {
        let provider = Arc::new(LazySchema {
            schema,
            source: source.clone(),
        });
        datafusion::catalog::CatalogProvider::register_schema(&catalog, schema, provider)
            .expect("memory catalog accepts schemas");
    }
    ctx.register_catalog(CATALOG, Arc::new(catalog));
    ctx
}

/// Runs one SQL statement; returns its batches and the result's schema (so
/// that an empty result still prints its header).
/// The rows of the newest `ts` at or after `since_us` (microseconds since
/// the epoch), with `columns` only (all for None): a process's last
/// profile, where each profile's rows share its start as their ts, and
/// those of an earlier process that had the same PID are older than this
/// one. The batches must hold `ts`.
pub fn last_since(
    batches: Vec<RecordBatch>,
    since_us: i64,
    columns: Option<&[&str]>,
) -> Result<Vec<RecordBatch>, datafusion::arrow::error::ArrowError> {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::TimestampMicrosecondType;
    let ts_of = |batch: &RecordBatch| -> Result<_, datafusion::arrow::error::ArrowError> {
        let column = batch.column_by_name("ts").ok_or_else(|| {
            datafusion::arrow::error::ArrowError::SchemaError("no ts column".into())
        })?;
        Ok(column
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| {
                datafusion::arrow::error::ArrowError::SchemaError("ts is no timestamp".into())
            })?
            .clone())
    };
    let mut newest = None;
    for batch in &batches {
        let ts = ts_of(batch)?;
        for at in ts.iter().flatten().filter(|&at| at >= since_us) {
            newest = newest.max(Some(at));
        }
    }
    let mut kept = Vec::new();
    for batch in batches {
        let ts = ts_of(&batch)?;
        let mask: datafusion::arrow::array::BooleanArray = ts
            .iter()
            .map(|at| Some(at.is_some() && at == newest))
            .collect();
        if mask.true_count() == 0 {
            continue;
        }
        let batch = datafusion::arrow::compute::filter_record_batch(&batch, &mask)?;
        let batch = match columns {
            Some(names) => {
                let schema = batch.schema();
                let mut indices: Vec<usize> = (0..schema.fields().len())
                    .filter(|&i| names.contains(&schema.field(i).name().as_str()))
                    .collect();
                // As the store reads a scan of no column: its first.
                if indices.is_empty() {
                    indices.push(0);
                }
                batch.project(&indices)?
            }
            None => batch,
        };
        kept.push(batch);
    }
    Ok(kept)
}

pub fn run_sql(
    source: Arc<dyn RowSource>,
    sql: &str,
) -> Result<(datafusion::arrow::datatypes::SchemaRef, Vec<RecordBatch>), QueryError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| QueryError::Sql(format!("cannot start the query runtime: {e}")))?;
    runtime.block_on(async move {
        let ctx = context(source);
        // Reads only: `COPY ... TO 'file'` wrote a file on this side, and
        // no statement here has anything to create, change or set.
        let reads_only = datafusion::execution::context::SQLOptions::new()
            .with_allow_ddl(false)
            .with_allow_dml(false)
            .with_allow_statements(false);
        let frame = ctx.sql_with_options(sql, reads_only).await?;
        let schema = Arc::new(frame.schema().as_arrow().clone());
        let batches = frame.collect().await?;
        Ok((schema, batches))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_core::protocol::{
        EnvReply, EnvVar, Frame, ProcessMeta, StacksReply, ThreadStack,
    };
    use rankscope_core::tables;

    struct Fixed;

    fn meta() -> ProcessMeta {
        ProcessMeta {
            pid: 42,
            ppid: 1,
            host: "h".into(),
            rank: 0,
            local_rank: 0,
            world_size: 1,
            cmdline: vec!["python".into()],
            exe: "/bin/python".into(),
            cwd: "/".into(),
            python_version: "3.11.7".into(),
            started_at: 1.0,
            process_started_at: None,
            rankscope_version: "0".into(),
            protocol: 1,
            tcp: None,
            job_id: None,
            step_address: None,
        }
    }

    impl RowSource for Fixed {
        fn rows(&self, table: &TableDef) -> Result<Rows, String> {
            let stacks = StacksReply {
                taken_at: 2.0,
                threads: vec![ThreadStack {
                    thread_id: 1,
                    native_id: Some(11),
                    name: "MainThread".into(),
                    daemon: false,
                    is_main: true,
                    holds_gil: None,
                    frames: (0..5)
                        .map(|i| Frame {
                            func: format!("f{i}"),
                            qualname: format!("f{i}"),
                            file: "x.py".into(),
                            lineno: 10 + i,
                            locals: None,
                            native_module: None,
                        })
                        .collect(),
                }],
                counts: None,
            };
            let env = EnvReply {
                vars: vec![EnvVar {
                    name: "HF_TOKEN".into(),
                    value: "<hidden>".into(),
                    hidden: true,
                }],
            };
            Ok(match (table.schema, table.name) {
                ("python", "backtrace") => tables::backtrace_rows(&meta(), &stacks),
                ("python", "threads") => tables::threads_rows(&meta(), &stacks),
                ("process", "info") => tables::info_rows(&meta(), 3.0),
                ("process", "env") => tables::env_rows(&meta(), &env, 3.0),
                _ => return Err("unknown".into()),
            })
        }
    }

    fn query(sql: &str) -> Result<String, QueryError> {
        let (schema, batches) = run_sql(Arc::new(Fixed), sql)?;
        render(&schema, &batches, OutputFormat::Csv, None)
    }

    #[test]
    fn filters_and_projects_the_backtrace() {
        let out = query("SELECT func, lineno FROM python.backtrace WHERE depth < 2 ORDER BY depth")
            .unwrap();
        assert_eq!(out, "func,lineno\nf0,10\nf1,11\n");
    }

    #[test]
    fn show_tables_reads_no_rows() {
        struct Refusing;
        impl RowSource for Refusing {
            fn rows(&self, _: &TableDef) -> Result<Rows, String> {
                Err("no rows here".into())
            }
        }
        let (_, batches) = run_sql(Arc::new(Refusing), "SHOW TABLES").unwrap();
        assert!(batches.iter().map(|b| b.num_rows()).sum::<usize>() >= 5);
        let err = run_sql(Arc::new(Refusing), "SELECT * FROM python.threads").unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot read python.threads: no rows here"),
            "{err}"
        );
    }

    #[test]
    fn show_tables_lists_every_schema() {
        let out = query("SHOW TABLES").unwrap();
        for name in ["backtrace", "threads", "info", "env", "crashes"] {
            assert!(out.contains(name), "{name} missing from {out}");
        }
    }

    #[test]
    fn unqualified_names_default_to_the_python_schema() {
        let out = query("SELECT count(*) AS n FROM backtrace").unwrap();
        assert_eq!(out, "n\n5\n");
    }

    #[test]
    fn bad_sql_is_an_error_with_the_engine_message() {
        let err = query("SELEC nope").unwrap_err();
        assert!(err.to_string().to_lowercase().contains("expected"), "{err}");
        let err = query("SELECT * FROM python.nope").unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn a_query_reads_and_writes_nothing() {
        let file = std::env::temp_dir().join(format!("rankscope-copy-{}.csv", std::process::id()));
        let copy = format!(
            "COPY (SELECT func FROM python.backtrace) TO '{}'",
            file.display()
        );
        assert!(query(&copy).is_err());
        assert!(!file.exists(), "COPY wrote {}", file.display());
        for sql in [
            "CREATE TABLE t AS SELECT 1",
            "SET datafusion.execution.batch_size = 1",
        ] {
            assert!(query(sql).is_err(), "{sql}");
        }
        assert!(query("DESCRIBE python.backtrace").unwrap().contains("func"));
        assert!(query("EXPLAIN SELECT 1").is_ok());
    }

    #[test]
    fn empty_results_keep_their_header() {
        let out = query("SELECT func FROM python.backtrace WHERE depth > 100").unwrap();
        assert_eq!(out, "func\n");
    }

    /// Counts for two processes, and the scan the engine asked for.
    struct Counting {
        seen: std::sync::Mutex<Vec<Scan>>,
    }

    impl RowSource for Counting {
        fn rows(&self, _: &TableDef) -> Result<Rows, String> {
            Err("only scans here".into())
        }

        fn scan(&self, table: &TableDef, scan: &Scan) -> Result<Fetched, String> {
            self.seen.lock().unwrap().push(scan.clone());
            if !scan.reads_identity_only() {
                return Fixed.rows(table).map(Fetched::Rows);
            }
            let identity = |rank: i64| {
                [
                    serde_json::json!(7 + rank),
                    serde_json::json!(rank),
                    serde_json::json!("h"),
                    serde_json::json!(1),
                ]
            };
            Ok(Fetched::Counts(vec![
                (identity(0), 600_000),
                (identity(1), 400_000),
            ]))
        }
    }

    #[test]
    fn a_count_reads_no_rows_and_filters_reach_the_source() {
        let source = Arc::new(Counting {
            seen: std::sync::Mutex::new(Vec::new()),
        });
        let (schema, batches) = run_sql(
            source.clone(),
            "SELECT rank, count(*) AS n FROM python.backtrace GROUP BY rank ORDER BY rank",
        )
        .unwrap();
        assert_eq!(
            render(&schema, &batches, OutputFormat::Csv, None).unwrap(),
            "rank,n\n0,600000\n1,400000\n"
        );
        let (schema, batches) =
            run_sql(source.clone(), "SELECT count(*) AS n FROM python.backtrace").unwrap();
        assert_eq!(
            render(&schema, &batches, OutputFormat::Csv, None).unwrap(),
            "n\n1000000\n"
        );
        let (schema, batches) = run_sql(
            source.clone(),
            "SELECT func FROM python.backtrace WHERE depth < 2 AND 'MainThread' = thread_name",
        )
        .unwrap();
        assert_eq!(
            render(&schema, &batches, OutputFormat::Csv, None).unwrap(),
            "func\nf0\nf1\n"
        );
        let seen = source.seen.lock().unwrap();
        assert_eq!(seen[0].columns, Some(vec!["rank"]));
        assert!(seen[1].columns.as_ref().is_some_and(Vec::is_empty));
        let last = seen.last().unwrap();
        assert_eq!(
            last.literal("depth", CmpOp::Lt),
            Some(&serde_json::json!(2))
        );
        assert_eq!(
            last.literal("thread_name", CmpOp::Eq),
            Some(&serde_json::json!("MainThread"))
        );
    }
}
