//! Reading a table back from run directories, after the process is gone.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{new_null_array, Array, ArrayRef, RecordBatch};
use arrow_buffer::Buffer;
use arrow_ipc::reader::StreamDecoder;
use arrow_schema::{DataType, SchemaRef};
use rankscope_core::tables::{in_flight_of, TableDef};

use crate::StoreError;

/// The table's files under one run directory, oldest name first.
pub fn table_files(run_dir: &Path, def: &TableDef) -> Vec<PathBuf> {
    let Ok(read) = std::fs::read_dir(run_dir.join("tables").join(def.name)) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = read
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "arrows"))
        .collect();
    files.sort();
    files
}

/// Every batch of `def` that the run directories hold, with the named
/// columns only (all of them for None; the first for none, so that rows
/// are still counted), in the table's current schema and column order.
/// A file cut short (the process was killed mid-write) gives the batches
/// before the cut; a file that cannot be read at all is skipped. Columns a
/// file lacks (written by another version) are null.
pub fn read_table(
    run_dirs: &[PathBuf],
    def: &TableDef,
    columns: Option<&[&str]>,
) -> Result<Vec<RecordBatch>, StoreError> {
    read_table_of(run_dirs, def, columns, None)
}

/// The same, from the files one process wrote only (`(host, pid)`: its
/// files are named `<host>-<pid>-<n>.arrows`).
pub fn read_table_of(
    run_dirs: &[PathBuf],
    def: &TableDef,
    columns: Option<&[&str]>,
    process: Option<(&str, u32)>,
) -> Result<Vec<RecordBatch>, StoreError> {
    let full = crate::schema::arrow_schema(def);
    let schema = project(&full, columns)?;
    let mut batches = read_files(run_dirs, def, &schema, process)?;
    if let Some((folder, key)) = in_flight_of(def) {
        batches.extend(still_in_flight(
            run_dirs, &full, def, folder, key, &schema, process,
        )?);
    }
    Ok(batches)
}

/// The same, from the files these processes wrote only: a job's ranks,
/// where several jobs (or a job and unrelated programs) wrote to one run
/// directory.
pub fn read_table_of_processes(
    run_dirs: &[PathBuf],
    def: &TableDef,
    columns: Option<&[&str]>,
    processes: &[(String, u32)],
) -> Result<Vec<RecordBatch>, StoreError> {
    let mut batches = Vec::new();
    for (host, pid) in processes {
        batches.extend(read_table_of(run_dirs, def, columns, Some((host, *pid)))?);
    }
    Ok(batches)
}

/// `full` with the named columns only (all for None; the first for none).
fn project(full: &SchemaRef, columns: Option<&[&str]>) -> Result<SchemaRef, StoreError> {
    let Some(names) = columns else {
        return Ok(Arc::clone(full));
    };
    let mut wanted: Vec<usize> = (0..full.fields().len())
        .filter(|&i| names.contains(&full.field(i).name().as_str()))
        .collect();
    if wanted.is_empty() {
        wanted.push(0);
    }
    Ok(Arc::new(full.project(&wanted)?))
}

/// The rows of `def`'s in-flight folder that never finished: those with
/// no finished row of the same process and key in `def`'s own files (a
/// collective that was slow, not hung, is written to both). One row each.
fn still_in_flight(
    run_dirs: &[PathBuf],
    full: &SchemaRef,
    def: &TableDef,
    folder: &TableDef,
    key: &[&str],
    schema: &SchemaRef,
    process: Option<(&str, u32)>,
) -> Result<Vec<RecordBatch>, StoreError> {
    let open = read_files(run_dirs, folder, full, process)?;
    if open.iter().all(|b| b.num_rows() == 0) {
        return Ok(Vec::new());
    }
    let names: Vec<&str> = ["host", "pid"]
        .into_iter()
        .chain(key.iter().copied())
        .collect();
    let mut done = HashSet::new();
    for batch in read_files(run_dirs, def, &project(full, Some(&names))?, process)? {
        done.extend((0..batch.num_rows()).filter_map(|i| row_key(&batch, &names, i)));
    }
    let wanted: Vec<usize> = schema
        .fields()
        .iter()
        .filter_map(|f| full.index_of(f.name()).ok())
        .collect();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for batch in open {
        for i in 0..batch.num_rows() {
            let Some(k) = row_key(&batch, &names, i) else {
                continue;
            };
            if !done.contains(&k) && seen.insert(k) {
                out.push(batch.slice(i, 1).project(&wanted)?);
            }
        }
    }
    Ok(out)
}

/// Row `i`'s values in the named (text or integer) columns, as one string.
fn row_key(batch: &RecordBatch, names: &[&str], i: usize) -> Option<String> {
    let mut key = String::new();
    for name in names {
        let column = batch.column_by_name(name)?;
        if column.is_null(i) {
            key.push('\u{0}');
        } else {
            match column.data_type() {
                DataType::Utf8 => key.push_str(column.as_string::<i32>().value(i)),
                DataType::Int64 => {
                    key.push_str(&column.as_primitive::<Int64Type>().value(i).to_string())
                }
                _ => return None,
            }
        }
        key.push('\u{1f}');
    }
    Some(key)
}

/// The batches of `def`'s files (of one process, or all), in `schema`.
pub(crate) fn read_files(
    run_dirs: &[PathBuf],
    def: &TableDef,
    schema: &SchemaRef,
    process: Option<(&str, u32)>,
) -> Result<Vec<RecordBatch>, StoreError> {
    let prefix = process.map(|(host, pid)| format!("{}-{pid}-", crate::spill::host_file(host)));
    let mut batches = Vec::new();
    for dir in run_dirs {
        for path in table_files(dir, def) {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            // The rest is the file's number only: host `a-1`, pid 2 is not
            // host `a`, pid 1's file `a-1-2-0`.
            let theirs = |p: &str| {
                name.strip_prefix(p)
                    .and_then(|rest| rest.strip_suffix(".arrows"))
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            };
            if prefix.as_deref().is_some_and(|p| !theirs(p)) {
                continue;
            }
            let Some(mut buffer) = map(&path) else {
                continue;
            };
            let mut decoder = StreamDecoder::new();
            let mut in_file: Option<Vec<usize>> = None;
            while !buffer.is_empty() {
                // A message cut short by a kill ends the file's batches.
                let Ok(Some(batch)) = decoder.decode(&mut buffer) else {
                    break;
                };
                let wanted = in_file.get_or_insert_with(|| {
                    schema
                        .fields()
                        .iter()
                        .filter_map(|f| batch.schema().index_of(f.name()).ok())
                        .collect()
                });
                batches.push(conform(schema, &batch.project(wanted)?)?);
            }
        }
    }
    Ok(batches)
}

/// The file mapped into memory, as one buffer the decoded arrays point
/// into: no copy and no allocation per message (reading each message into
/// its own buffer spent most of a query's time copying and zeroing pages).
/// The writers only ever append, so the mapped length stays valid.
fn map(path: &Path) -> Option<Buffer> {
    // A regular file only: opening a FIFO put there waits for a writer, and
    // the query hung.
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: the map is read only, and no one truncates a run store's file
    // (its writer appends; a new segment is a new file).
    let mapped = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.ok()?;
    if mapped.is_empty() {
        return None;
    }
    let len = mapped.len();
    let ptr = std::ptr::NonNull::new(mapped.as_ptr() as *mut u8)?;
    // SAFETY: the pointer and length are the map's, and the Arc keeps the
    // map alive for as long as any array points into it.
    Some(unsafe { Buffer::from_custom_allocation(ptr, len, std::sync::Arc::new(mapped)) })
}

fn conform(schema: &SchemaRef, batch: &RecordBatch) -> Result<RecordBatch, StoreError> {
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
