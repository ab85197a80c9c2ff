//! SQL over rankscope's tables, on the user's side.
//!
//! Tables are resolved lazily: a query fetches only the tables it names, from
//! whatever [`RowSource`] the caller gives (one live probe today; run
//! directories and every rank of a job later). The probe never plans or runs
//! a query: a sick target only hands over rows.

mod arrow_rows;
mod render;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{MemTable, MemoryCatalogProvider, SchemaProvider, Session, TableProvider};
use datafusion::logical_expr::{Expr, TableType};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::error::DataFusionError;
use datafusion::prelude::{SessionConfig, SessionContext};
use rankscope_core::tables::{ALL_TABLES, Rows, TableDef};
use thiserror::Error;

pub use arrow_rows::{arrow_schema, rows_to_batch};
pub use render::{render, OutputFormat};

/// Hands over the rows of a table; implemented by the CLI for live probes.
pub trait RowSource: Send + Sync {
    fn rows(&self, table: &TableDef) -> Result<Rows, String>;
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
        ALL_TABLES.iter().find(|t| t.schema == self.schema && t.name == name)
    }
}

#[async_trait]
impl SchemaProvider for LazySchema {
    fn table_names(&self) -> Vec<String> {
        ALL_TABLES.iter().filter(|t| t.schema == self.schema).map(|t| t.name.to_string()).collect()
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>, DataFusionError> {
        Ok(self.def(name).map(|def| Arc::new(LazyTable { def, source: self.source.clone() }) as Arc<dyn TableProvider>))
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

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        let def = self.def;
        let rows = self
            .source
            .rows(def)
            .map_err(|e| DataFusionError::Execution(format!("cannot read {}: {e}", def.qualified_name())))?;
        let batch = rows_to_batch(def, &rows)?;
        MemTable::try_new(batch.schema(), vec![vec![batch]])?.scan(state, projection, filters, limit).await
    }
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
        let provider = Arc::new(LazySchema { schema, source: source.clone() });
        datafusion::catalog::CatalogProvider::register_schema(&catalog, schema, provider)
            .expect("memory catalog accepts schemas");
    }
    ctx.register_catalog(CATALOG, Arc::new(catalog));
    ctx
}

/// Runs one SQL statement; returns its batches and the result's schema (so
/// that an empty result still prints its header).
pub fn run_sql(source: Arc<dyn RowSource>, sql: &str) -> Result<(datafusion::arrow::datatypes::SchemaRef, Vec<RecordBatch>), QueryError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| QueryError::Sql(format!("cannot start the query runtime: {e}")))?;
    runtime.block_on(async move {
        let ctx = context(source);
        let frame = ctx.sql(sql).await?;
        let schema = Arc::new(frame.schema().as_arrow().clone());
        let batches = frame.collect().await?;
        Ok((schema, batches))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_core::protocol::{EnvReply, EnvVar, Frame, ProcessMeta, StacksReply, ThreadStack};
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
            rankscope_version: "0".into(),
            protocol: 1,
            tcp: None,
            job_id: None,
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
            };
            let env = EnvReply { vars: vec![EnvVar { name: "HF_TOKEN".into(), value: "<hidden>".into(), hidden: true }] };
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
        render(&schema, &batches, OutputFormat::Csv)
    }

    #[test]
    fn filters_and_projects_the_backtrace() {
        let out = query("SELECT func, lineno FROM python.backtrace WHERE depth < 2 ORDER BY depth").unwrap();
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
        assert!(err.to_string().contains("cannot read python.threads: no rows here"), "{err}");
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
    fn empty_results_keep_their_header() {
        let out = query("SELECT func FROM python.backtrace WHERE depth > 100").unwrap();
        assert_eq!(out, "func\n");
    }
}
