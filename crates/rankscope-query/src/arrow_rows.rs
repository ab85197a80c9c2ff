//! JSON rows from probes into Arrow batches, typed by the core schemas.

use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, BooleanBuilder, Float64Builder, Int64Builder, MapBuilder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::DataFusionError;
use rankscope_core::tables::{ColumnType, Rows, TableDef};
use serde_json::Value;

pub use rankscope_store::schema::arrow_schema;

fn column(ty: ColumnType, rows: &Rows, index: usize) -> ArrayRef {
    let cells = rows
        .iter()
        .map(|row| row.get(index).unwrap_or(&Value::Null));
    match ty {
        ColumnType::Int64 => {
            let mut b = Int64Builder::with_capacity(rows.len());
            cells.for_each(|v| b.append_option(v.as_i64()));
            Arc::new(b.finish())
        }
        ColumnType::Timestamp => {
            let mut b = TimestampMicrosecondBuilder::with_capacity(rows.len()).with_timezone("UTC");
            cells.for_each(|v| b.append_option(v.as_i64()));
            Arc::new(b.finish())
        }
        ColumnType::Float64 => {
            let mut b = Float64Builder::with_capacity(rows.len());
            // The probe sends NaN and infinities as text (JSON has neither).
            cells.for_each(|v| {
                b.append_option(
                    v.as_f64()
                        .or_else(|| v.as_str().and_then(|s| s.parse::<f64>().ok())),
                )
            });
            Arc::new(b.finish())
        }
        ColumnType::Bool => {
            let mut b = BooleanBuilder::with_capacity(rows.len());
            cells.for_each(|v| b.append_option(v.as_bool()));
            Arc::new(b.finish())
        }
        ColumnType::MapUtf8 => {
            let mut b = MapBuilder::new(None, StringBuilder::new(), StringBuilder::new());
            for cell in cells {
                match cell {
                    Value::Object(entries) => {
                        for (key, value) in entries {
                            b.keys().append_value(key);
                            match value {
                                Value::Null => b.values().append_null(),
                                Value::String(s) => b.values().append_value(s),
                                other => b.values().append_value(other.to_string()),
                            }
                        }
                        let _ = b.append(true);
                    }
                    _ => {
                        let _ = b.append(false);
                    }
                }
            }
            Arc::new(b.finish())
        }
        ColumnType::Utf8 => {
            let mut b = StringBuilder::new();
            cells.for_each(|v| match v {
                Value::Null => b.append_null(),
                Value::String(s) => b.append_value(s),
                other => b.append_value(other.to_string()),
            });
            Arc::new(b.finish())
        }
    }
}

pub fn rows_to_batch(def: &TableDef, rows: &Rows) -> Result<RecordBatch, DataFusionError> {
    let schema = arrow_schema(def);
    let columns = def
        .all_columns()
        .enumerate()
        .map(|(i, c)| column(c.ty, rows, i))
        .collect();
    Ok(RecordBatch::try_new(schema, columns)?)
}

/// Batches for a scan that reads identity columns only: each process's
/// identity values repeated as many times as it has rows, in the projected
/// columns only (no per-row JSON is ever built).
pub fn uniform_batches(
    def: &TableDef,
    projection: &[usize],
    groups: &[([Value; 4], usize)],
) -> Result<(SchemaRef, Vec<RecordBatch>), DataFusionError> {
    use datafusion::arrow::record_batch::RecordBatchOptions;
    use datafusion::scalar::ScalarValue;
    let full = arrow_schema(def);
    let schema = Arc::new(full.project(projection)?);
    let width = def.all_columns().count();
    let mut batches = Vec::new();
    for (identity, count) in groups {
        let mut row: Vec<Value> = identity.to_vec();
        row.resize(width, Value::Null);
        let one = rows_to_batch(def, &vec![row])?;
        let columns = projection
            .iter()
            .map(|&i| ScalarValue::try_from_array(one.column(i), 0)?.to_array_of_size(*count))
            .collect::<Result<Vec<_>, _>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(*count));
        batches.push(RecordBatch::try_new_with_options(
            schema.clone(),
            columns,
            &options,
        )?);
    }
    Ok((schema, batches))
}
