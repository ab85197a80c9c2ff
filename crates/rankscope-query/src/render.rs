//! Query results as the user asked for them.

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;

use crate::table::{Align, Style, Table};
use crate::QueryError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// Aligned columns with borders, for people.
    Table,
    Csv,
    /// A JSON array of row objects.
    Json,
}

/// The result as text; `width` (the terminal's) fits a table to it, cutting
/// long cells with `…` (CSV and JSON are never cut).
pub fn render(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    format: OutputFormat,
    width: Option<usize>,
) -> Result<String, QueryError> {
    let err = |e: datafusion::arrow::error::ArrowError| QueryError::Render(e.to_string());
    match format {
        OutputFormat::Table => Ok(table(schema, batches).map_err(err)?.render(width)),
        OutputFormat::Csv => {
            let mut out = Vec::new();
            {
                // CSV has no nested values: a map column goes as its display text.
                let flat_schema = flat(schema);
                let mut writer = arrow::csv::WriterBuilder::new()
                    .with_header(true)
                    .build(&mut out);
                if batches.is_empty() || batches.iter().all(|b| b.num_rows() == 0) {
                    writer
                        .write(&RecordBatch::new_empty(flat_schema))
                        .map_err(err)?;
                } else {
                    for batch in batches {
                        writer
                            .write(&flatten(&flat_schema, batch).map_err(err)?)
                            .map_err(err)?;
                    }
                }
            }
            String::from_utf8(out).map_err(|e| QueryError::Render(e.to_string()))
        }
        OutputFormat::Json => {
            let mut out = Vec::new();
            {
                // Every row has every column, null included: scripts index by key.
                let mut writer = arrow::json::WriterBuilder::new()
                    .with_explicit_nulls(true)
                    .build::<_, arrow::json::writer::JsonArray>(&mut out);
                for batch in batches {
                    writer.write(batch).map_err(err)?;
                }
                writer.finish().map_err(err)?;
            }
            let mut text = String::from_utf8(out).map_err(|e| QueryError::Render(e.to_string()))?;
            if text.is_empty() {
                text.push_str("[]");
            }
            text.push('\n');
            Ok(text)
        }
    }
}

fn table(
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<Table, datafusion::arrow::error::ArrowError> {
    use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
    let mut table = schema
        .fields()
        .iter()
        .fold(Table::new(Style::Boxed), |t, f| {
            t.column(f.name().as_str(), Align::Left)
        });
    let options = FormatOptions::default().with_display_error(true);
    for batch in batches {
        let formatters = batch
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &options))
            .collect::<Result<Vec<_>, _>>()?;
        for row in 0..batch.num_rows() {
            table.row(
                formatters
                    .iter()
                    .map(|f| f.value(row).to_string())
                    .collect(),
            );
        }
    }
    Ok(table)
}

fn flat(schema: &SchemaRef) -> SchemaRef {
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| {
            if matches!(f.data_type(), DataType::Map(..)) {
                Field::new(f.name(), DataType::Utf8, true)
            } else {
                f.as_ref().clone()
            }
        })
        .collect();
    std::sync::Arc::new(Schema::new(fields))
}

fn flatten(
    flat_schema: &SchemaRef,
    batch: &RecordBatch,
) -> Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    use datafusion::arrow::array::{Array, ArrayRef, StringArray};
    use datafusion::arrow::datatypes::DataType;
    use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
    let columns = batch
        .columns()
        .iter()
        .map(
            |column| -> Result<ArrayRef, datafusion::arrow::error::ArrowError> {
                if !matches!(column.data_type(), DataType::Map(..)) {
                    return Ok(column.clone());
                }
                let formatter =
                    ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default())?;
                let text: StringArray = (0..column.len())
                    .map(|i| column.is_valid(i).then(|| formatter.value(i).to_string()))
                    .collect();
                Ok(std::sync::Arc::new(text))
            },
        )
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(flat_schema.clone(), columns)
}
