//! Query results as the user asked for them.

use arrow::json::writer::{Encoder, EncoderFactory, EncoderOptions, NullableEncoder};
use datafusion::arrow::array::{Array, ArrowPrimitiveType, AsArray, PrimitiveArray};
use datafusion::arrow::datatypes::{DataType, FieldRef, Float32Type, Float64Type, SchemaRef};
use datafusion::arrow::error::ArrowError;
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
                    .with_encoder_factory(std::sync::Arc::new(NonFiniteAsText))
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

/// Floats whose non-finite values go as text ("NaN", "inf", "-inf"), as
/// a live table's rows already send them (`rankscope_store::Cell::to_json`):
/// arrow's own writer makes them null, and a NaN loss read from a run
/// store looked like no loss at all.
#[derive(Debug)]
struct NonFiniteAsText;

impl EncoderFactory for NonFiniteAsText {
    fn make_default_encoder<'a>(
        &self,
        _field: &'a FieldRef,
        array: &'a dyn Array,
        _options: &'a EncoderOptions,
    ) -> Result<Option<NullableEncoder<'a>>, ArrowError> {
        let encoder: Box<dyn Encoder + 'a> = match array.data_type() {
            DataType::Float64 => Box::new(Floats(array.as_primitive::<Float64Type>())),
            DataType::Float32 => Box::new(Floats(array.as_primitive::<Float32Type>())),
            _ => return Ok(None),
        };
        Ok(Some(NullableEncoder::new(encoder, array.nulls().cloned())))
    }
}

struct Floats<'a, T: ArrowPrimitiveType>(&'a PrimitiveArray<T>);

macro_rules! float_encoder {
    ($arrow:ty) => {
        impl Encoder for Floats<'_, $arrow> {
            fn encode(&mut self, idx: usize, out: &mut Vec<u8>) {
                let value = self.0.value(idx);
                if value.is_finite() {
                    // (Writing to a Vec cannot fail.)
                    let _ = serde_json::to_writer(&mut *out, &value);
                } else {
                    out.extend_from_slice(format!("\"{value}\"").as_bytes());
                }
            }
        }
    };
}
float_encoder!(Float64Type);
float_encoder!(Float32Type);

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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Float32Array, Float64Array};
    use datafusion::arrow::datatypes::{Field, Schema};

    use super::*;

    #[test]
    fn json_keeps_non_finite_floats_as_text_and_the_rest_as_numbers() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("loss", DataType::Float64, true),
            Field::new("half", DataType::Float32, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Float64Array::from(vec![
                    Some(f64::NAN),
                    Some(f64::NEG_INFINITY),
                    Some(0.1),
                    None,
                ])),
                Arc::new(Float32Array::from(vec![
                    Some(f32::INFINITY),
                    Some(0.1),
                    Some(3.0),
                    None,
                ])),
            ],
        )
        .unwrap();
        let text = render(&schema, &[batch], OutputFormat::Json, None).unwrap();
        let rows: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            rows,
            serde_json::json!([
                {"loss": "NaN", "half": "inf"},
                {"loss": "-inf", "half": 0.1},
                {"loss": 0.1, "half": 3.0},
                {"loss": null, "half": null},
            ])
        );
    }
}
