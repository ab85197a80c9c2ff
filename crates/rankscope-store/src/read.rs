//! Reading a table back from run directories, after the process is gone.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{new_null_array, ArrayRef, RecordBatch};
use arrow_ipc::reader::StreamReader;
use rankscope_core::tables::TableDef;

use crate::StoreError;

/// The table's files under one run directory, oldest name first.
pub fn table_files(run_dir: &Path, def: &TableDef) -> Vec<PathBuf> {
    let Ok(read) = std::fs::read_dir(run_dir.join("tables").join(def.name)) else { return Vec::new() };
    let mut files: Vec<PathBuf> = read.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "arrows")).collect();
    files.sort();
    files
}

/// Every batch of `def` that the run directories hold, in the table's
/// current schema. A file cut short (the process was killed mid-write)
/// gives the batches before the cut; a file that cannot be read at all is
/// skipped. Columns a file lacks (written by another version) are null.
pub fn read_table(run_dirs: &[PathBuf], def: &TableDef) -> Result<Vec<RecordBatch>, StoreError> {
    let schema = crate::schema::arrow_schema(def);
    let mut batches = Vec::new();
    for dir in run_dirs {
        for path in table_files(dir, def) {
            let Ok(file) = File::open(&path) else { continue };
            let Ok(reader) = StreamReader::try_new(BufReader::new(file), None) else { continue };
            for batch in reader {
                let Ok(batch) = batch else { break };
                batches.push(conform(&schema, &batch)?);
            }
        }
    }
    Ok(batches)
}

fn conform(schema: &arrow_schema::SchemaRef, batch: &RecordBatch) -> Result<RecordBatch, StoreError> {
    if batch.schema() == *schema {
        return Ok(batch.clone());
    }
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .map(|field| match batch.column_by_name(field.name()) {
            Some(column) if column.data_type() == field.data_type() => column.clone(),
            _ => new_null_array(field.data_type(), batch.num_rows()),
        })
        .collect();
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}
