//! Writing rows to the run directory: per table, an Arrow IPC stream per
//! process, a record batch per flush, a new file past `SEGMENT_BYTES`.

use std::collections::HashMap;
use std::fs::File;

use rankscope_core::fd::Guarded;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, Float64Builder, Int64Builder, MapBuilder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_ipc::writer::StreamWriter;
use rankscope_core::tables::{ColumnType, TableDef};
use serde_json::{json, Value};

use crate::{Cell, Row, StoreError};

/// A file is closed (with its end-of-stream marker) and the next one begun
/// past this size, so that no single file grows without bound.
const SEGMENT_BYTES: u64 = 64 << 20;

struct Segment {
    writer: StreamWriter<BufWriter<CountingFile>>,
    path: PathBuf,
}

/// The file and how many bytes went into it (the writer does not say).
/// Written only while its descriptor is still the file's: a program that
/// closed it (a daemon's `os.closerange`) and opened a file of its own got
/// the store's Arrow batches in it (see `rankscope_core::fd`).
struct CountingFile {
    file: Guarded<File>,
    written: Arc<std::sync::atomic::AtomicU64>,
}

impl std::io::Write for CountingFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.file.ours() {
            return Err(std::io::Error::other(
                "the program closed the run store's file descriptor (os.closerange?); nothing more is written",
            ));
        }
        let n = self.file.get_mut().write(buf)?;
        self.written
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub struct Spill {
    dir: Option<PathBuf>,
    pid: u32,
    host: String,
    /// The host as a file name may hold it.
    host_file: String,
    max_bytes: u64,
    written: u64,
    segments: HashMap<&'static str, (Segment, Arc<std::sync::atomic::AtomicU64>, u32)>,
    rows_written: HashMap<&'static str, u64>,
    rows_lost: u64,
    /// Once set, nothing more is written (a full or read-only disk, the cap).
    error: Option<String>,
}

/// The host as a file name holds it.
pub(crate) fn host_file(host: &str) -> String {
    host.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl Spill {
    pub fn new(dir: Option<PathBuf>, pid: u32, host: &str, max_bytes: u64) -> Spill {
        let host_file = host_file(host);
        Spill {
            dir,
            pid,
            host: host.to_string(),
            host_file,
            max_bytes,
            written: 0,
            segments: HashMap::new(),
            rows_written: HashMap::new(),
            rows_lost: 0,
            error: None,
        }
    }

    pub fn describe(&self) -> Value {
        json!({
            "dir": self.dir.as_ref().map(|d| d.display().to_string()),
            "bytes": self.written + self.segments.values().map(|(_, n, _)| n.load(std::sync::atomic::Ordering::Relaxed)).sum::<u64>(),
            "rows": self.rows_written,
            "rows_lost": self.rows_lost,
            "error": self.error,
        })
    }

    /// Writes one batch of a table's rows; `dropped` rows never reached
    /// here (the disk fell behind). Errors stop the spill, never the caller.
    pub fn write(&mut self, def: &'static TableDef, rows: &[Arc<Row>], dropped: u64) {
        self.rows_lost += dropped;
        if rows.is_empty() || self.dir.is_none() {
            return;
        }
        if self.error.is_some() {
            self.rows_lost += rows.len() as u64;
            return;
        }
        if let Err(e) = self.try_write(def, rows, true) {
            self.rows_lost += rows.len() as u64;
            self.error = Some(e);
            self.close_segments();
        }
    }

    /// Writes the rows of calls still in flight long after they began (a
    /// hang), even past the cap, or after an error stopped the spill: a
    /// row per hung call, and all that a job killed while hung leaves of
    /// where each rank waited. A disk that refuses them loses them only.
    pub fn write_in_flight(&mut self, def: &'static TableDef, rows: &[Arc<Row>]) {
        let Some(dir) = &self.dir else { return };
        if rows.is_empty() {
            return;
        }
        if self.error.is_some() && !dir.exists() {
            // (Its directory was removed: not made again for a part of the run.)
            self.rows_lost += rows.len() as u64;
            return;
        }
        if let Err(e) = self.try_write(def, rows, false) {
            self.rows_lost += rows.len() as u64;
            if self.error.is_none() {
                self.error = Some(e);
                self.close_segments();
            }
        }
    }

    /// Closes what is open (each file then ends cleanly), its bytes counted.
    fn close_segments(&mut self) {
        for (_, (mut segment, n, _)) in self.segments.drain() {
            let _ = segment.writer.finish();
            self.written += n.load(std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn try_write(
        &mut self,
        def: &'static TableDef,
        rows: &[Arc<Row>],
        capped: bool,
    ) -> Result<(), String> {
        let total = self.written
            + self
                .segments
                .values()
                .map(|(_, n, _)| n.load(std::sync::atomic::Ordering::Relaxed))
                .sum::<u64>();
        if capped && total >= self.max_bytes {
            return Err(format!(
                "the spill stopped at {} MB (RANKSCOPE_STORE_MAX_MB); older rows are on disk, newer ones in memory only",
                self.max_bytes >> 20
            ));
        }
        let batch = to_batch(def, self.pid, &self.host, rows)
            .map_err(|e| format!("cannot build a batch of {}: {e}", def.name))?;
        let rotate = self
            .segments
            .get(def.name)
            .is_some_and(|(_, n, _)| n.load(std::sync::atomic::Ordering::Relaxed) >= SEGMENT_BYTES);
        if rotate {
            if let Some((mut segment, n, index)) = self.segments.remove(def.name) {
                let _ = segment.writer.finish();
                self.written += n.load(std::sync::atomic::Ordering::Relaxed);
                let next = self.open(def, index + 1)?;
                self.segments.insert(def.name, next);
            }
        }
        if !self.segments.contains_key(def.name) {
            let opened = self.open(def, 0)?;
            self.segments.insert(def.name, opened);
        }
        let (segment, _, _) = self.segments.get_mut(def.name).expect("opened above");
        let path = segment.path.display().to_string();
        if !segment.path.exists() {
            // Removed under it (the run directory deleted while the program
            // runs): written on, the rows would go to a file no one can
            // open, and a directory made again later would hold a part of
            // the run that looks whole.
            return Err(format!(
                "{path} was removed while it was written: the run directory is gone"
            ));
        }
        segment
            .writer
            .write(&batch)
            .map_err(|e| format!("cannot write {path}: {e}"))?;
        segment
            .writer
            .flush()
            .map_err(|e| format!("cannot write {path}: {e}"))?;
        *self.rows_written.entry(def.name).or_default() += rows.len() as u64;
        Ok(())
    }

    /// A new file that no earlier process of this pid (pids are reused)
    /// nor earlier segment wrote.
    fn open(
        &self,
        def: &'static TableDef,
        mut index: u32,
    ) -> Result<(Segment, Arc<std::sync::atomic::AtomicU64>, u32), String> {
        let dir = self.dir.as_ref().expect("checked by write").join(def.name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        loop {
            let path = dir.join(format!("{}-{}-{index}.arrows", self.host_file, self.pid));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(file) => {
                    let counter = Arc::new(std::sync::atomic::AtomicU64::new(0));
                    let out = BufWriter::new(CountingFile {
                        file: Guarded::new(file),
                        written: counter.clone(),
                    });
                    let schema = crate::schema::arrow_schema(def);
                    let writer = StreamWriter::try_new(out, &schema)
                        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                    return Ok((Segment { writer, path }, counter, index));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => index += 1,
                Err(e) => return Err(format!("cannot create {}: {e}", path.display())),
            }
        }
    }
}

impl Drop for Spill {
    fn drop(&mut self) {
        self.close_segments();
    }
}

/// Rows as one record batch of the table's Arrow schema.
pub fn to_batch(
    def: &TableDef,
    pid: u32,
    host: &str,
    rows: &[Arc<Row>],
) -> Result<RecordBatch, StoreError> {
    let n = rows.len();
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(4 + def.columns.len());
    columns.push(Arc::new(arrow_array::Int64Array::from(vec![pid as i64; n])));
    columns.push(Arc::new(
        rows.iter()
            .map(|r| r.rank)
            .collect::<arrow_array::Int64Array>(),
    ));
    let mut hosts = StringBuilder::with_capacity(n, n * host.len());
    (0..n).for_each(|_| hosts.append_value(host));
    columns.push(Arc::new(hosts.finish()));
    let mut ts = TimestampMicrosecondBuilder::with_capacity(n).with_timezone("UTC");
    rows.iter().for_each(|r| ts.append_value(r.ts_us));
    columns.push(Arc::new(ts.finish()));
    for (i, column) in def.columns.iter().enumerate() {
        let cells = rows.iter().map(|r| &r.cells[i]);
        let array: ArrayRef = match column.ty {
            ColumnType::Int64 | ColumnType::Timestamp => {
                let mut b = if column.ty == ColumnType::Timestamp {
                    let mut t = TimestampMicrosecondBuilder::with_capacity(n).with_timezone("UTC");
                    cells.for_each(|c| {
                        t.append_option(if let Cell::Int(v) = c { Some(*v) } else { None })
                    });
                    columns.push(Arc::new(t.finish()));
                    continue;
                } else {
                    Int64Builder::with_capacity(n)
                };
                cells.for_each(|c| {
                    b.append_option(if let Cell::Int(v) = c { Some(*v) } else { None })
                });
                Arc::new(b.finish())
            }
            ColumnType::Float64 => {
                let mut b = Float64Builder::with_capacity(n);
                cells.for_each(|c| {
                    b.append_option(if let Cell::Float(v) = c {
                        Some(*v)
                    } else {
                        None
                    })
                });
                Arc::new(b.finish())
            }
            ColumnType::Bool => {
                let mut b = BooleanBuilder::with_capacity(n);
                cells.for_each(|c| {
                    b.append_option(if let Cell::Bool(v) = c {
                        Some(*v)
                    } else {
                        None
                    })
                });
                Arc::new(b.finish())
            }
            ColumnType::Utf8 => {
                let mut b = StringBuilder::new();
                cells.for_each(|c| {
                    b.append_option(if let Cell::Str(v) = c {
                        Some(v.as_str())
                    } else {
                        None
                    })
                });
                Arc::new(b.finish())
            }
            ColumnType::MapUtf8 => {
                let mut b = MapBuilder::new(None, StringBuilder::new(), StringBuilder::new());
                for c in cells {
                    if let Cell::Map(entries) = c {
                        for (k, v) in entries {
                            b.keys().append_value(k);
                            b.values().append_value(v);
                        }
                        b.append(true)?;
                    } else {
                        b.append(false)?;
                    }
                }
                Arc::new(b.finish())
            }
        };
        columns.push(array);
    }
    Ok(RecordBatch::try_new(
        crate::schema::arrow_schema(def),
        columns,
    )?)
}
