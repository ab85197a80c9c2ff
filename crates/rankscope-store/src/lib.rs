//! The run store: the tables a probe keeps itself (`python.torch_trace`,
//! `python.torch_steps`, ...), bounded in memory and spilled to the run
//! directory so they outlive the process.
//!
//! * In memory, each table is a ring of rows (`ring_rows` of them): a live
//!   `query` reads it, with no GIL, since rows are plain Rust values.
//! * On disk, each process appends each table's rows to an Arrow IPC
//!   *stream* (`<run dir>/tables/<table>/<host>-<pid>-<n>.arrows`), one record
//!   batch per flush, from a thread of its own. A stream needs no footer, so
//!   a process killed with SIGKILL leaves every batch it flushed readable
//!   (the reader stops at a cut-off last message); the rows since the last
//!   flush (about a second's worth) are what it loses.
//!
//! Nothing here may cost the program: an append is a short lock; the
//! writes happen on the store's thread; a write error (full disk, read-only
//! directory) or the size cap stops that table's spill and says why, and
//! the ring goes on.

mod cell;
pub mod read;
pub mod schema;
mod spill;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rankscope_core::tables::{TableDef, CLI_STORE_TABLES, PROBE_TABLES};
use serde_json::{json, Value};
use thiserror::Error;

pub use cell::Cell;
pub use read::{read_table, read_table_of, read_table_of_processes};
pub use schema::arrow_schema;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("no table {0} in the run store")]
    UnknownTable(String),
    #[error("a row of {table} has {got} values; the table has {expected} (ts first)")]
    Arity {
        table: String,
        expected: usize,
        got: usize,
    },
    #[error("{table} has no column {at} (counted after ts, from 0)")]
    NoColumn { table: String, at: usize },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Arrow(#[from] arrow_schema::ArrowError),
}

/// One row: its own time and the process's rank when it was added, then
/// the table's columns after the identity ones.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub ts_us: i64,
    pub rank: Option<i64>,
    pub cells: Vec<Cell>,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Rows kept in memory per table.
    pub ring_rows: usize,
    /// Fewer for some tables: (table, rows). A recorded collective's row
    /// takes about 800 bytes, so 100,000 of them were 80 MB of the
    /// program's memory; every row still reaches the disk.
    pub table_rows: Vec<(&'static str, usize)>,
    /// The run directory; None: nothing is spilled.
    pub run_dir: Option<PathBuf>,
    pub pid: u32,
    pub host: String,
    /// Past this many bytes written (all tables together), the spill stops.
    pub max_bytes: u64,
    /// How often the store's thread writes what has come in.
    pub flush_every: Duration,
    /// Rows waiting for the disk that wake the thread before its time.
    pub flush_rows: usize,
    /// An open row (a collective in flight) this old is written as it is,
    /// once, to its table's in-flight folder (`in_flight_of`): a job
    /// killed while hung leaves where each rank waited.
    pub in_flight_after: Duration,
}

impl StoreConfig {
    /// Rows of a table that may wait for the disk: the general ring's
    /// number, and at least twice `flush_rows`. A small
    /// `RANKSCOPE_TABLE_ROWS` bounds what is kept to read, not what gets
    /// to the disk: the Python side hands its rows over in bursts (a
    /// quarter second of a busy trace is thousands), and a queue of 1,000
    /// dropped most of each before the writer could run.
    pub fn waiting_rows(&self) -> usize {
        self.ring_rows.max(self.flush_rows.saturating_mul(2)).max(1)
    }

    /// Rows waiting for the disk that wake the spill thread: `flush_rows`,
    /// or half of what may wait where that is less.
    pub fn wake_rows(&self) -> usize {
        self.flush_rows.min((self.waiting_rows() / 2).max(1))
    }

    /// The rows kept in memory for `table`.
    pub fn rows_of(&self, table: &str) -> usize {
        self.table_rows
            .iter()
            .find(|(name, _)| *name == table)
            .map_or(self.ring_rows, |&(_, rows)| rows.min(self.ring_rows))
            .max(1)
    }

    pub fn new(pid: u32, host: String, run_dir: Option<PathBuf>) -> StoreConfig {
        StoreConfig {
            ring_rows: 100_000,
            table_rows: vec![("collectives", 10_000)],
            run_dir,
            pid,
            host,
            max_bytes: 1 << 30,
            flush_every: Duration::from_secs(1),
            flush_rows: 8192,
            in_flight_after: Duration::from_secs(2),
        }
    }
}

struct Table {
    def: &'static TableDef,
    ring: VecDeque<Arc<Row>>,
    /// Rows not yet handed to the disk (bounded like the ring: a disk that
    /// cannot keep up loses the oldest, counted in `unspilled_dropped`).
    unspilled: VecDeque<Arc<Row>>,
    unspilled_dropped: u64,
    appended: u64,
    /// Rows still changing (a collective in flight), by the caller's key:
    /// read with the ring; `finish_row` turns one into a row. One open
    /// for `in_flight_after` is written to the in-flight folder, once.
    open: BTreeMap<u64, OpenRow>,
}

struct OpenRow {
    row: Arc<Row>,
    since: Instant,
    written: bool,
}

/// The most open rows a table keeps (a caller that never closes its rows
/// loses the oldest, not memory).
const MAX_OPEN_ROWS: usize = 4096;

impl Table {
    fn new(def: &'static TableDef) -> Table {
        Table {
            def,
            ring: VecDeque::new(),
            unspilled: VecDeque::new(),
            unspilled_dropped: 0,
            appended: 0,
            open: BTreeMap::new(),
        }
    }
}

struct State {
    tables: BTreeMap<&'static str, Table>,
    waiting: usize,
    stopping: bool,
    /// A producer asked for its rows on disk by then (`spill_soon`).
    soon: Option<Instant>,
}

/// A producer that keeps its rows its own way until they are read or
/// spilled, asked for them (`feed`) before each read of its table (with
/// `reading` true: the rows still changing too) and before each write to
/// disk. The probe's collectives are one: recording a call must touch as
/// little memory as it can on the program's thread (collective.rs).
/// Called without any lock of the store's held.
pub type Feed = Arc<dyn Fn(&Arc<Store>, Option<&'static str>, bool) + Send + Sync>;

pub struct Store {
    config: StoreConfig,
    feed: Mutex<Option<Feed>>,
    state: Mutex<State>,
    wake: Condvar,
    rank: AtomicI64,
    spill: Mutex<spill::Spill>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

const NO_RANK: i64 = i64::MIN;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The table definition of a store table, by `torch_trace` or
/// `python.torch_trace`.
pub fn store_table(name: &str) -> Option<&'static TableDef> {
    let short = name.strip_prefix("python.").unwrap_or(name);
    PROBE_TABLES
        .iter()
        .chain(CLI_STORE_TABLES)
        .find(|t| t.name == short)
}

impl Store {
    /// A store; its spill thread starts with the first row.
    pub fn new(config: StoreConfig) -> Arc<Store> {
        let spill = spill::Spill::new(
            config.run_dir.as_ref().map(|d| d.join("tables")),
            config.pid,
            &config.host,
            config.max_bytes,
        );
        Arc::new(Store {
            config,
            feed: Mutex::new(None),
            state: Mutex::new(State {
                tables: BTreeMap::new(),
                waiting: 0,
                stopping: false,
                soon: None,
            }),
            wake: Condvar::new(),
            rank: AtomicI64::new(NO_RANK),
            spill: Mutex::new(spill),
            thread: Mutex::new(None),
        })
    }

    pub fn pid(&self) -> u32 {
        self.config.pid
    }

    /// Whether rows go to a run directory (a spill thread takes them).
    pub fn spills(&self) -> bool {
        self.config.run_dir.is_some()
    }

    /// Sets the producer asked for its rows before reads and writes (see `Feed`).
    pub fn set_feed(&self, feed: Feed) {
        *lock(&self.feed) = Some(feed);
    }

    /// Asks the producer for its rows: those of `table` (None: all) and,
    /// where `reading`, those still changing.
    fn fed(self: &Arc<Self>, table: Option<&'static str>, reading: bool) {
        let feed = lock(&self.feed).clone();
        if let Some(feed) = feed {
            feed(self, table, reading);
        }
    }

    pub fn set_rank(&self, rank: Option<i64>) {
        self.rank.store(rank.unwrap_or(NO_RANK), Ordering::Relaxed);
    }

    fn rank(&self) -> Option<i64> {
        Some(self.rank.load(Ordering::Relaxed)).filter(|&r| r != NO_RANK)
    }

    fn row(
        &self,
        table: &str,
        ts_seconds: f64,
        cells: Vec<Cell>,
    ) -> Result<(&'static TableDef, Arc<Row>), StoreError> {
        let def = store_table(table).ok_or_else(|| StoreError::UnknownTable(table.to_string()))?;
        Ok((def, self.row_of(def, ts_seconds, cells)?))
    }

    fn row_of(
        &self,
        def: &'static TableDef,
        ts_seconds: f64,
        mut cells: Vec<Cell>,
    ) -> Result<Arc<Row>, StoreError> {
        if cells.len() != def.columns.len() {
            return Err(StoreError::Arity {
                table: def.name.to_string(),
                expected: def.columns.len() + 1,
                got: cells.len() + 1,
            });
        }
        for (cell, column) in cells.iter_mut().zip(def.columns) {
            *cell = std::mem::replace(cell, Cell::Null).coerce(column.ty);
        }
        Ok(Arc::new(Row {
            ts_us: (ts_seconds * 1e6).round() as i64,
            rank: self.rank(),
            cells,
        }))
    }

    /// Adds one row: `ts` in seconds, then the table's columns in order.
    pub fn append(
        self: &Arc<Self>,
        table: &str,
        ts_seconds: f64,
        cells: Vec<Cell>,
    ) -> Result<(), StoreError> {
        let (def, row) = self.row(table, ts_seconds, cells)?;
        self.push_all(def, vec![row]);
        Ok(())
    }

    /// Adds several rows of one table: the table is looked up and the
    /// lock taken once (a probe hands its rows over in batches).
    pub fn append_rows(
        self: &Arc<Self>,
        table: &str,
        rows: Vec<(f64, Vec<Cell>)>,
    ) -> Result<(), StoreError> {
        let def = store_table(table).ok_or_else(|| StoreError::UnknownTable(table.to_string()))?;
        let made = rows
            .into_iter()
            .map(|(ts, cells)| self.row_of(def, ts, cells))
            .collect::<Result<Vec<_>, _>>()?;
        self.push_all(def, made);
        Ok(())
    }

    /// Shows a row that is still changing under `key` (read with the
    /// table, not spilled) until `finish_row` turns it into a row like any other.
    pub fn open_row(
        self: &Arc<Self>,
        table: &str,
        key: u64,
        ts_seconds: f64,
        cells: Vec<Cell>,
    ) -> Result<(), StoreError> {
        let (def, row) = self.row(table, ts_seconds, cells)?;
        let mut state = lock(&self.state);
        let entry = state
            .tables
            .entry(def.name)
            .or_insert_with(|| Table::new(def));
        if entry.open.len() >= MAX_OPEN_ROWS {
            entry.open.pop_first();
        }
        entry.open.insert(
            key,
            OpenRow {
                row,
                since: Instant::now(),
                written: false,
            },
        );
        Ok(())
    }

    /// The open row `key` is done, and only the cells at `at` changed
    /// (a collective's state, end and duration): the row is taken out of
    /// the open ones and into the ring under one lock, without its other
    /// cells crossing from the producer again. False: no such open row
    /// (it was dropped past `MAX_OPEN_ROWS`).
    pub fn finish_row(
        self: &Arc<Self>,
        table: &str,
        key: u64,
        changes: Vec<(usize, Cell)>,
    ) -> Result<bool, StoreError> {
        let def = store_table(table).ok_or_else(|| StoreError::UnknownTable(table.to_string()))?;
        if let Some(&(at, _)) = changes.iter().find(|(at, _)| *at >= def.columns.len()) {
            return Err(StoreError::NoColumn {
                table: def.name.to_string(),
                at,
            });
        }
        let wake = {
            let mut state = lock(&self.state);
            let Some(open) = state
                .tables
                .get_mut(def.name)
                .and_then(|t| t.open.remove(&key))
            else {
                return Ok(false);
            };
            // A reader may still hold the open form: it keeps its copy.
            let mut row = Arc::try_unwrap(open.row).unwrap_or_else(|shared| (*shared).clone());
            for (at, cell) in changes {
                row.cells[at] = cell.coerce(def.columns[at].ty);
            }
            self.push_locked(&mut state, def, vec![Arc::new(row)])
        };
        self.after_push(wake);
        Ok(true)
    }

    /// The rows added so far should be on disk within `within` (a
    /// breakpoint's hits, which a SIGKILL right after must not lose), not
    /// at the next regular flush. The writes stay on the store's thread, so
    /// a burst of rows costs one write.
    pub fn spill_soon(self: &Arc<Self>, within: Duration) {
        if self.config.run_dir.is_none() {
            return;
        }
        let by = Instant::now() + within;
        let sooner = {
            let mut state = lock(&self.state);
            let sooner = state.soon.is_none_or(|soon| by < soon);
            if sooner {
                state.soon = Some(by);
            }
            sooner
        };
        self.ensure_thread();
        if sooner {
            self.wake.notify_one();
        }
    }

    fn push_all(self: &Arc<Self>, def: &'static TableDef, rows: Vec<Arc<Row>>) {
        let wake = self.push_locked(&mut lock(&self.state), def, rows);
        self.after_push(wake);
    }

    /// Puts rows into their ring (and the spill's queue) under the state's
    /// lock; true: enough rows wait that the spill thread should wake.
    fn push_locked(&self, state: &mut State, def: &'static TableDef, rows: Vec<Arc<Row>>) -> bool {
        let spilling = self.config.run_dir.is_some();
        let ring_rows = self.config.rows_of(def.name);
        // What waits for the disk is bounded apart from the ring: a burst
        // of a table kept short in memory still reaches it whole.
        let waiting_rows = self.config.waiting_rows();
        let entry = state
            .tables
            .entry(def.name)
            .or_insert_with(|| Table::new(def));
        let mut added = 0;
        for row in rows {
            if entry.ring.len() == ring_rows {
                entry.ring.pop_front();
            }
            entry.ring.push_back(row.clone());
            entry.appended += 1;
            if spilling {
                if entry.unspilled.len() >= waiting_rows {
                    entry.unspilled.pop_front();
                    entry.unspilled_dropped += 1;
                } else {
                    added += 1;
                }
                entry.unspilled.push_back(row);
            }
        }
        state.waiting += added;
        spilling && state.waiting >= self.config.wake_rows()
    }

    fn after_push(self: &Arc<Self>, wake: bool) {
        if self.config.run_dir.is_some() {
            self.ensure_thread();
        }
        if wake {
            self.wake.notify_one();
        }
    }

    fn ensure_thread(self: &Arc<Self>) {
        if NO_WRITER.with(|n| n.get()) {
            // The writer itself (its feed adds rows while `close` waits for
            // it, holding the lock below), or `close`'s own last flush.
            return;
        }
        let mut thread = lock(&self.thread);
        if thread.is_some() {
            return;
        }
        // After `close`, a new row starts a new writer.
        lock(&self.state).stopping = false;
        let store = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("rankscope-store".into())
            .spawn(move || spill_loop(store));
        // Without the thread the rows stay in memory; `flush` still writes.
        *thread = spawned.ok();
    }

    /// Takes every table's rows waiting for the disk.
    fn take_unspilled(&self) -> Vec<(&'static TableDef, Vec<Arc<Row>>, u64)> {
        let mut state = lock(&self.state);
        state.waiting = 0;
        state
            .tables
            .values_mut()
            .filter(|t| !t.unspilled.is_empty() || t.unspilled_dropped > 0)
            .map(|t| {
                (
                    t.def,
                    Vec::from(std::mem::take(&mut t.unspilled)),
                    std::mem::take(&mut t.unspilled_dropped),
                )
            })
            .collect()
    }

    /// The open rows that have been open `in_flight_after` and were not
    /// written yet, by their in-flight folder; marked written.
    fn take_long_open(&self) -> Vec<(&'static TableDef, Vec<Arc<Row>>)> {
        if self.config.run_dir.is_none() {
            return Vec::new();
        }
        let mut state = lock(&self.state);
        let mut out = Vec::new();
        for table in state.tables.values_mut() {
            let Some((folder, _)) = rankscope_core::tables::in_flight_of(table.def) else {
                continue;
            };
            let rows: Vec<Arc<Row>> = table
                .open
                .values_mut()
                .filter(|open| !open.written && open.since.elapsed() >= self.config.in_flight_after)
                .map(|open| {
                    open.written = true;
                    Arc::clone(&open.row)
                })
                .collect();
            if !rows.is_empty() {
                out.push((folder, rows));
            }
        }
        out
    }

    /// Writes what is waiting now, on the caller's thread (at exit).
    pub fn flush(self: &Arc<Self>) {
        self.fed(None, false);
        let mut spill = lock(&self.spill);
        for (def, rows, dropped) in self.take_unspilled() {
            spill.write(def, &rows, dropped);
        }
        for (def, rows) in self.take_long_open() {
            spill.write_in_flight(def, &rows);
        }
    }

    /// Flushes and stops the thread (at exit, or when the probe stops).
    pub fn close(self: &Arc<Self>) {
        // The rows a feed hands over here (the last flush) start no writer.
        let _quiet = NoWriter::enter();
        lock(&self.state).stopping = true;
        self.wake.notify_one();
        // The lock is held while the thread ends, so that a row added
        // meanwhile starts no other writer; the thread itself never takes
        // it (its feed's rows: see `ensure_thread`).
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
        self.flush();
    }

    /// Rows in memory per table, and the spill's state.
    pub fn describe(self: &Arc<Self>) -> Value {
        self.fed(None, false);
        let state = lock(&self.state);
        let rows: serde_json::Map<String, Value> = PROBE_TABLES
            .iter()
            .map(|def| {
                (
                    def.name.to_string(),
                    json!(state
                        .tables
                        .get(def.name)
                        .map(|t| t.ring.len())
                        .unwrap_or(0)),
                )
            })
            .collect();
        let appended: serde_json::Map<String, Value> = state
            .tables
            .iter()
            .map(|(name, t)| (name.to_string(), json!(t.appended)))
            .collect();
        drop(state);
        let spill = lock(&self.spill).describe();
        json!({"rows": rows, "appended": appended, "ring_rows": self.config.ring_rows, "spill": spill})
    }

    /// A table's rows in memory, as `GET /v1/table` replies: the table's
    /// column names (`ts` first, in seconds) and rows of JSON values, only
    /// those meeting every `[column, op, value]` filter, with the named
    /// columns only (the others null); or just how many with `count`.
    pub fn read_json(
        self: &Arc<Self>,
        table: &str,
        columns: Option<&[String]>,
        filters: &[(String, String, Value)],
        count: bool,
    ) -> Result<Value, StoreError> {
        let mut text = Vec::new();
        self.write_json(table, columns, filters, count, &mut text)?;
        Ok(serde_json::from_slice(&text).map_err(std::io::Error::from)?)
    }

    /// The same reply written to `out` a row at a time. The rows' JSON is
    /// never held whole: a tree of JSON values for a 100 k-row table took
    /// about 100 MB of the target's memory while the reply was made.
    pub fn write_json(
        self: &Arc<Self>,
        table: &str,
        columns: Option<&[String]>,
        filters: &[(String, String, Value)],
        count: bool,
        out: &mut dyn std::io::Write,
    ) -> Result<(), StoreError> {
        let def = store_table(table).ok_or_else(|| StoreError::UnknownTable(table.to_string()))?;
        self.fed(Some(def.name), true);
        let names: Vec<&str> = std::iter::once("ts")
            .chain(def.columns.iter().map(|c| c.name))
            .collect();
        let checks: Vec<(usize, &str, &Value)> = filters
            .iter()
            .filter_map(|(column, op, value)| {
                let index = def.columns.iter().position(|c| c.name == column)?;
                matches!(op.as_str(), "=" | "<" | "<=" | ">" | ">=").then_some((
                    index,
                    op.as_str(),
                    value,
                ))
            })
            .collect();
        let meets = |row: &Row| checks.iter().all(|&(i, op, v)| row.cells[i].meets(op, v));
        // The rows are shared, not copied: the lock is let go before any
        // text is made, so the program's rows go on being added meanwhile.
        let rows: Vec<Arc<Row>> = {
            let state = lock(&self.state);
            state.tables.get(def.name).map_or_else(Vec::new, |t| {
                t.ring
                    .iter()
                    .chain(t.open.values().map(|open| &open.row))
                    .filter(|row| meets(row))
                    .cloned()
                    .collect()
            })
        };
        if count {
            serde_json::to_writer(&mut *out, &json!({"columns": names, "count": rows.len()}))
                .map_err(std::io::Error::from)?;
            return Ok(());
        }
        let wanted: Vec<bool> = def
            .columns
            .iter()
            .map(|c| columns.is_none_or(|cols| cols.iter().any(|n| n == c.name)))
            .collect();
        out.write_all(b"{\"columns\":")?;
        serde_json::to_writer(&mut *out, &names).map_err(std::io::Error::from)?;
        out.write_all(b",\"rows\":[")?;
        for (i, row) in rows.iter().enumerate() {
            out.write_all(if i == 0 { b"[" } else { b",[" })?;
            serde_json::to_writer(&mut *out, &(row.ts_us as f64 / 1e6))
                .map_err(std::io::Error::from)?;
            for (cell, &keep) in row.cells.iter().zip(&wanted) {
                out.write_all(b",")?;
                if keep {
                    serde_json::to_writer(&mut *out, &cell.to_json())
                        .map_err(std::io::Error::from)?;
                } else {
                    out.write_all(b"null")?;
                }
            }
            out.write_all(b"]")?;
        }
        out.write_all(b"]}")?;
        Ok(())
    }
}

thread_local! {
    /// Set on the writer's thread, and while `close` runs: rows added there
    /// start no writer.
    static NO_WRITER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `NO_WRITER` set until dropped (as it was before).
struct NoWriter(bool);

impl NoWriter {
    fn enter() -> NoWriter {
        NoWriter(NO_WRITER.with(|n| n.replace(true)))
    }
}

impl Drop for NoWriter {
    fn drop(&mut self) {
        NO_WRITER.with(|n| n.set(self.0));
    }
}

fn spill_loop(store: std::sync::Weak<Store>) {
    let _writer = NoWriter::enter();
    loop {
        let Some(store) = store.upgrade() else { return };
        {
            let mut state = lock(&store.state);
            let until = Instant::now() + store.config.flush_every;
            // Woken by a row batch, by `spill_soon` (which may bring the
            // deadline forward), or at `flush_every`.
            loop {
                let deadline = state.soon.map_or(until, |soon| soon.min(until));
                let now = Instant::now();
                if state.stopping || state.waiting >= store.config.wake_rows() || now >= deadline {
                    break;
                }
                state = store
                    .wake
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            if state.stopping {
                return;
            }
            state.soon = None;
        }
        store.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::cast::AsArray;
    use rankscope_core::tables::TORCH_STEPS;
    use read::read_files;

    fn config(dir: Option<PathBuf>) -> StoreConfig {
        let mut c = StoreConfig::new(4242, "node-a".into(), dir);
        c.flush_every = Duration::from_secs(3600);
        c
    }

    fn step_row(step: i64) -> Vec<Cell> {
        let mut cells = vec![Cell::Null; TORCH_STEPS.columns.len()];
        cells[0] = Cell::Int(step);
        cells[1] = Cell::Bool(step % 2 == 0);
        cells[2] = Cell::Float(10.0 + step as f64);
        cells
    }

    #[test]
    fn a_table_kept_short_in_memory_keeps_its_newest_rows() {
        let mut c = config(None);
        c.ring_rows = 5;
        c.table_rows = vec![("torch_steps", 2)];
        assert_eq!((c.rows_of("torch_steps"), c.rows_of("torch_trace")), (2, 5));
        let store = Store::new(c);
        let batch: Vec<(f64, Vec<Cell>)> = (0..4).map(|s| (1.0, step_row(s))).collect();
        store.append_rows("torch_steps", batch).unwrap();
        assert_eq!(steps_in(&store), vec![2, 3]);
        // Never more than the general number.
        let mut c = config(None);
        c.ring_rows = 1;
        c.table_rows = vec![("torch_steps", 2)];
        assert_eq!(c.rows_of("torch_steps"), 1);
    }

    #[test]
    fn a_batch_lands_in_order_or_not_at_all() {
        let mut c = config(None);
        c.ring_rows = 4;
        let store = Store::new(c);
        let batch: Vec<(f64, Vec<Cell>)> = (0..6).map(|s| (1.0, step_row(s))).collect();
        store.append_rows("torch_steps", batch).unwrap();
        assert_eq!(
            steps_in(&store),
            vec![2, 3, 4, 5],
            "the ring keeps the batch's newest"
        );
        // One short row: none of the batch is added.
        let bad = vec![(2.0, step_row(6)), (2.0, vec![Cell::Int(7)])];
        assert!(matches!(
            store.append_rows("torch_steps", bad),
            Err(StoreError::Arity { .. })
        ));
        assert_eq!(steps_in(&store), vec![2, 3, 4, 5]);
    }

    fn steps_in(store: &Arc<Store>) -> Vec<i64> {
        let all = store.read_json("torch_steps", None, &[], false).unwrap();
        all["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r[1].as_i64().unwrap())
            .collect()
    }

    #[test]
    fn the_ring_keeps_the_newest_rows_and_filters_them() {
        let mut c = config(None);
        c.ring_rows = 3;
        let store = Store::new(c);
        for step in 0..5 {
            store
                .append("torch_steps", 100.0 + step as f64, step_row(step))
                .unwrap();
        }
        let all = store
            .read_json("python.torch_steps", None, &[], false)
            .unwrap();
        assert_eq!(steps_in(&store), vec![2, 3, 4]);
        assert_eq!(all["rows"][0][0], json!(102.0), "ts in seconds");
        let late = store
            .read_json(
                "torch_steps",
                None,
                &[("step".into(), ">=".into(), json!(3))],
                false,
            )
            .unwrap();
        assert_eq!(late["rows"].as_array().unwrap().len(), 2);
        let counted = store
            .read_json(
                "torch_steps",
                None,
                &[("sampled".into(), "=".into(), json!(true))],
                true,
            )
            .unwrap();
        assert_eq!(counted["count"], json!(2));
        let only_step = store
            .read_json("torch_steps", Some(&["step".to_string()]), &[], false)
            .unwrap();
        assert_eq!(
            only_step["rows"][0][3],
            Value::Null,
            "step_ms was not asked for"
        );
    }

    #[test]
    fn an_open_row_is_read_until_it_closes_and_is_never_spilled_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(config(Some(dir.path().to_path_buf())));
        store.append("torch_steps", 1.0, step_row(1)).unwrap();
        store.open_row("torch_steps", 7, 2.0, step_row(2)).unwrap();
        let steps = |store: &Arc<Store>| steps_in(store);
        assert_eq!(steps(&store), vec![1, 2]);
        store.flush();
        let on_disk = |dir: &std::path::Path| -> usize {
            read_table(&[dir.to_path_buf()], &TORCH_STEPS, None)
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum()
        };
        assert_eq!(on_disk(dir.path()), 1, "the open row stays in memory");
        assert!(store
            .finish_row("torch_steps", 7, vec![(0, Cell::Int(3))])
            .unwrap());
        assert_eq!(steps(&store), vec![1, 3], "finished: a row like any other");
        store.flush();
        assert_eq!(on_disk(dir.path()), 2);
    }

    /// A producer with its own buffer (`set_feed`) is asked for its rows
    /// before a read (with the rows still changing) and before a write.
    #[test]
    fn a_feed_gives_its_rows_before_each_read_and_write() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(config(Some(dir.path().to_path_buf())));
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = asked.clone();
        store.set_feed(Arc::new(move |store: &Arc<Store>, table, reading| {
            let mut asked = lock(&seen);
            asked.push((table, reading));
            let step = asked.len() as i64;
            drop(asked);
            store.append("torch_steps", 1.0, step_row(step)).unwrap();
            if reading {
                store
                    .open_row("torch_steps", 9, 2.0, step_row(100))
                    .unwrap();
            }
        }));
        assert_eq!(steps_in(&store), vec![1, 100]);
        assert_eq!(lock(&asked).clone(), vec![(Some("torch_steps"), true)]);
        store.flush();
        assert_eq!(lock(&asked).last().copied(), Some((None, false)));
        let on_disk: usize = read_table(&[dir.path().to_path_buf()], &TORCH_STEPS, None)
            .unwrap()
            .iter()
            .map(|b| b.num_rows())
            .sum();
        assert_eq!(on_disk, 2, "both rows fed so far, not the open one");
    }

    /// A feed that adds rows on the writer's thread while `close` waits
    /// for that thread: `close` returns (it held the thread's lock while
    /// the writer's rows asked for it).
    #[test]
    fn close_returns_while_the_writer_feeds() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(Some(dir.path().to_path_buf()));
        c.flush_every = Duration::from_millis(5);
        let store = Store::new(c);
        store.set_feed(Arc::new(|store: &Arc<Store>, _table, _reading| {
            std::thread::sleep(Duration::from_millis(30));
            store.append("torch_steps", 1.0, step_row(1)).unwrap();
        }));
        store.append("torch_steps", 1.0, step_row(0)).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        let (done, closed) = std::sync::mpsc::channel();
        let closing = store.clone();
        std::thread::spawn(move || {
            closing.close();
            let _ = done.send(());
        });
        assert!(
            closed.recv_timeout(Duration::from_secs(5)).is_ok(),
            "close never returned"
        );
        assert!(lock(&store.thread).is_none(), "no writer started again");
    }

    /// A collective open past `in_flight_after` (a hang) is written once
    /// to the in-flight folder; read back, it is a row of the table until
    /// the same process writes its finished row.
    #[test]
    fn a_collective_open_long_is_left_on_disk_until_it_finishes() {
        use rankscope_core::tables::{COLLECTIVES, COLLECTIVES_IN_FLIGHT};
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(Some(dir.path().to_path_buf()));
        c.in_flight_after = Duration::ZERO;
        let store = Store::new(c);
        let row = |seq: i64| {
            let mut cells = vec![Cell::Null; COLLECTIVES.columns.len()];
            cells[0] = Cell::Int(seq);
            cells[1] = Cell::Str("all_reduce".into());
            cells[2] = Cell::Str("0".into());
            cells[6] = Cell::Str("in flight".into());
            cells
        };
        store.open_row("collectives", 1, 1.0, row(5)).unwrap();
        store.open_row("collectives", 2, 2.0, row(6)).unwrap();
        store.flush();
        store.flush();
        let dirs = [dir.path().to_path_buf()];
        let count = |def| -> usize {
            read_files(&dirs, def, &schema::arrow_schema(def), None)
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum()
        };
        assert_eq!(count(&COLLECTIVES_IN_FLIGHT), 2, "each written once");
        assert_eq!(count(&COLLECTIVES), 0);
        let states = || -> Vec<(i64, String)> {
            let mut out: Vec<(i64, String)> =
                read_table(&dirs, &COLLECTIVES, Some(&["seq", "state"]))
                    .unwrap()
                    .iter()
                    .flat_map(|b| {
                        let seq = b
                            .column_by_name("seq")
                            .unwrap()
                            .as_primitive::<arrow_array::types::Int64Type>()
                            .clone();
                        let state = b
                            .column_by_name("state")
                            .unwrap()
                            .as_string::<i32>()
                            .clone();
                        (0..b.num_rows()).map(move |i| (seq.value(i), state.value(i).to_string()))
                    })
                    .collect();
            out.sort();
            out
        };
        assert_eq!(states(), [(5, "in flight".into()), (6, "in flight".into())]);
        assert!(store
            .finish_row("collectives", 1, vec![(6, Cell::Str("done".into()))])
            .unwrap());
        store.flush();
        assert_eq!(
            states(),
            [(5, "done".into()), (6, "in flight".into())],
            "the finished row stands for the one left in flight"
        );
        // Another process's finished #6 does not finish this one's.
        let mut other = config(Some(dir.path().to_path_buf()));
        other.pid = 4343;
        let other = Store::new(other);
        other
            .append("collectives", 3.0, {
                let mut cells = row(6);
                cells[6] = Cell::Str("done".into());
                cells
            })
            .unwrap();
        other.flush();
        assert_eq!(states().len(), 3);
    }

    #[test]
    fn a_finished_open_row_keeps_its_other_cells_and_is_spilled_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(config(Some(dir.path().to_path_buf())));
        let opened = step_row(2);
        store
            .open_row("torch_steps", 7, 2.0, opened.clone())
            .unwrap();
        assert!(store
            .finish_row("torch_steps", 7, vec![(0, Cell::Int(5))])
            .unwrap());
        assert_eq!(steps_in(&store), vec![5]);
        let ring = lock(&store.state).tables["torch_steps"].ring.clone();
        assert_eq!(ring[0].cells[1..], opened[1..], "only the step changed");
        assert!(
            !store.finish_row("torch_steps", 7, vec![]).unwrap(),
            "finished once"
        );
        assert!(matches!(
            store.finish_row("torch_steps", 8, vec![(999, Cell::Null)]),
            Err(StoreError::NoColumn { at: 999, .. })
        ));
        store.flush();
        let batches = read_table(&[dir.path().to_path_buf()], &TORCH_STEPS, None).unwrap();
        assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
    }

    #[test]
    fn a_map_column_spills_soon_when_asked_and_reads_back() {
        use arrow_array::{Array, MapArray, StringArray};
        use rankscope_core::tables::SNAPSHOTS;
        let dir = tempfile::tempdir().unwrap();
        // config(): the regular flush is an hour away.
        let store = Store::new(config(Some(dir.path().to_path_buf())));
        let mut cells = vec![Cell::Null; SNAPSHOTS.columns.len()];
        cells[0] = Cell::Int(1);
        cells[8] = Cell::Map(vec![
            ("step".into(), "3".into()),
            ("loss".into(), "0.25".into()),
        ]);
        store.append("snapshots", 1.0, cells).unwrap();
        let mut no_locals = vec![Cell::Null; SNAPSHOTS.columns.len()];
        no_locals[0] = Cell::Int(2);
        store.append("snapshots", 2.0, no_locals).unwrap();
        store.spill_soon(Duration::from_millis(10));
        let deadline = Instant::now() + Duration::from_secs(10);
        let batches = loop {
            let batches = read_table(&[dir.path().to_path_buf()], &SNAPSHOTS, None).unwrap();
            if batches.iter().map(|b| b.num_rows()).sum::<usize>() == 2 {
                break batches;
            }
            assert!(Instant::now() < deadline, "not spilled soon");
            std::thread::sleep(Duration::from_millis(5));
        };
        let locals = batches[0]
            .column_by_name("locals")
            .unwrap()
            .as_any()
            .downcast_ref::<MapArray>()
            .unwrap()
            .clone();
        let first = locals.value(0);
        let text = |i: usize| {
            first
                .column(i)
                .as_any()
                .downcast_ref::<StringArray>()
                .unwrap()
                .iter()
                .map(|v| v.unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(text(0), ["step", "loss"]);
        assert_eq!(text(1), ["3", "0.25"]);
        assert!(locals.is_null(1), "no map: null, not empty");
    }

    #[test]
    fn a_row_of_the_wrong_width_or_table_is_refused() {
        let store = Store::new(config(None));
        assert!(matches!(
            store.append("torch_steps", 1.0, vec![Cell::Int(1)]),
            Err(StoreError::Arity { .. })
        ));
        assert!(matches!(
            store.append("nope", 1.0, vec![]),
            Err(StoreError::UnknownTable(_))
        ));
    }

    #[test]
    fn spilled_rows_read_back_with_the_identity_columns() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(config(Some(dir.path().to_path_buf())));
        store.set_rank(Some(3));
        for step in 0..10 {
            store.append("torch_steps", 50.0, step_row(step)).unwrap();
        }
        store.flush();
        for step in 10..15 {
            store.append("torch_steps", 60.0, step_row(step)).unwrap();
        }
        store.close();
        let batches = read_table(&[dir.path().to_path_buf()], &TORCH_STEPS, None).unwrap();
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        assert_eq!(rows, 15, "both flushes, the second at close");
        let batch = &batches[0];
        assert_eq!(batch.schema(), arrow_schema(&TORCH_STEPS));
        let pid = batch
            .column(0)
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap();
        let rank = batch
            .column(1)
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap();
        let step = batch
            .column(4)
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap();
        assert_eq!((pid.value(0), rank.value(0), step.value(9)), (4242, 3, 9));
        let projected = read_table(
            &[dir.path().to_path_buf()],
            &TORCH_STEPS,
            Some(&["loss", "step"]),
        )
        .unwrap();
        let names: Vec<String> = projected[0]
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(
            names,
            ["step", "loss"],
            "the table's order, not the asked order"
        );
        let none = read_table(&[dir.path().to_path_buf()], &TORCH_STEPS, Some(&[])).unwrap();
        assert_eq!(
            none.iter().map(|b| b.num_rows()).sum::<usize>(),
            15,
            "rows still counted"
        );
    }

    #[test]
    fn a_stream_cut_short_keeps_its_whole_batches() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(config(Some(dir.path().to_path_buf())));
        for step in 0..4 {
            store.append("torch_steps", 1.0, step_row(step)).unwrap();
            store.flush();
        }
        // As SIGKILL leaves it: no end-of-stream marker, the last batch cut.
        let file = std::fs::read_dir(dir.path().join("tables/torch_steps"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 20]).unwrap();
        let batches = read_table(&[dir.path().to_path_buf()], &TORCH_STEPS, None).unwrap();
        assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 3);
    }

    /// The spill's error after `steps` rows of torch_steps, each flushed.
    fn spill_error_after(store: &Arc<Store>, steps: std::ops::Range<i64>) -> String {
        for step in steps {
            store.append("torch_steps", 1.0, step_row(step)).unwrap();
            store.flush();
        }
        store.describe()["spill"]["error"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn an_unwritable_run_directory_stops_the_spill_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("run");
        std::fs::write(&blocker, "a file where the run directory should be").unwrap();
        let store = Store::new(config(Some(blocker)));
        let error = spill_error_after(&store, 0..1);
        assert!(error.contains("cannot"), "{error}");
        assert_eq!(
            store.describe()["rows"]["torch_steps"],
            json!(1),
            "the ring goes on"
        );
    }

    #[test]
    fn the_size_cap_stops_the_spill() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(Some(dir.path().to_path_buf()));
        c.max_bytes = 1;
        let store = Store::new(c);
        for step in 0..3 {
            store.append("torch_steps", 1.0, step_row(step)).unwrap();
            store.flush();
        }
        let described = store.describe();
        assert!(
            described["spill"]["error"]
                .as_str()
                .unwrap()
                .contains("RANKSCOPE_STORE_MAX_MB"),
            "{described}"
        );
        // What it wrote before it stopped is still counted.
        assert!(
            described["spill"]["bytes"].as_u64().unwrap() > 0,
            "{described}"
        );
    }

    /// The run directory removed while the program runs stops the spill,
    /// and says why, rather than writing into files no one can open.
    #[test]
    fn a_run_directory_removed_under_the_spill_stops_it() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let store = Store::new(config(Some(run.clone())));
        store.append("torch_steps", 1.0, step_row(0)).unwrap();
        store.flush();
        std::fs::remove_dir_all(&run).unwrap();
        let error = spill_error_after(&store, 1..2);
        assert!(error.contains("the run directory is gone"), "{error}");
        assert!(!run.exists(), "not made again");
    }

    /// Past the cap, a collective that hangs is still written: it is all a
    /// job killed while hung leaves of where each rank waited.
    #[test]
    fn a_hang_is_written_past_the_size_cap() {
        use rankscope_core::tables::{COLLECTIVES, COLLECTIVES_IN_FLIGHT};
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(Some(dir.path().to_path_buf()));
        c.max_bytes = 1;
        c.in_flight_after = Duration::ZERO;
        let store = Store::new(c);
        for step in 0..2 {
            store.append("torch_steps", 1.0, step_row(step)).unwrap();
            store.flush();
        }
        let mut cells = vec![Cell::Null; COLLECTIVES.columns.len()];
        cells[0] = Cell::Int(7);
        cells[6] = Cell::Str("in flight".into());
        store.open_row("collectives", 1, 1.0, cells).unwrap();
        store.flush();
        let rows: usize = read_files(
            &[dir.path().to_path_buf()],
            &COLLECTIVES_IN_FLIGHT,
            &schema::arrow_schema(&COLLECTIVES_IN_FLIGHT),
            None,
        )
        .unwrap()
        .iter()
        .map(|b| b.num_rows())
        .sum();
        assert_eq!(rows, 1);
    }

    /// A small ring (RANKSCOPE_TABLE_ROWS) still gets every row to the
    /// disk: its queue holds a burst of rows (it held as many as the ring,
    /// and a ring of 1,000 lost most of a busy trace's rows), and the
    /// writer is woken at half of it.
    #[test]
    fn a_small_ring_still_gets_a_burst_to_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(Some(dir.path().to_path_buf()));
        c.ring_rows = 100;
        assert_eq!((c.waiting_rows(), c.wake_rows()), (16384, 8192));
        let store = Store::new(c);
        let rows: Vec<Arc<Row>> = (0..10_000)
            .map(|step| store.row_of(&TORCH_STEPS, 1.0, step_row(step)).unwrap())
            .collect();
        let mut state = lock(&store.state);
        let woke = store.push_locked(&mut state, &TORCH_STEPS, rows);
        let table = &state.tables["torch_steps"];
        assert_eq!(
            (
                table.ring.len(),
                table.unspilled.len(),
                table.unspilled_dropped
            ),
            (100, 10_000, 0)
        );
        assert!(woke);
    }
}
