//! The Arrow schema of a table, from the core schemas: one definition for
//! the store's files and the CLI's SQL engine, so they always agree.

use std::sync::Arc;

use arrow_array::builder::{MapBuilder, StringBuilder};
use arrow_array::Array;
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use rankscope_core::tables::{ColumnType, TableDef};

pub fn data_type(ty: ColumnType) -> DataType {
    match ty {
        ColumnType::Int64 => DataType::Int64,
        ColumnType::Float64 => DataType::Float64,
        ColumnType::Bool => DataType::Boolean,
        ColumnType::Utf8 => DataType::Utf8,
        ColumnType::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        // Whatever the builder makes, so that schema and arrays agree.
        ColumnType::MapUtf8 => MapBuilder::new(None, StringBuilder::new(), StringBuilder::new())
            .finish()
            .data_type()
            .clone(),
    }
}

/// Every column nullable, identity columns first.
pub fn arrow_schema(def: &TableDef) -> SchemaRef {
    let fields: Vec<Field> = def
        .all_columns()
        .map(|c| Field::new(c.name, data_type(c.ty), true))
        .collect();
    Arc::new(Schema::new(fields))
}
