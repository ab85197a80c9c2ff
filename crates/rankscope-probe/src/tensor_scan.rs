//! The bookkeeping of a `python.tensors` scan, kept out of Python objects.
//!
//! A process with 100 k live tensors must not pay more than a few MB for
//! being scanned (issue 12). In Python the scan's tables cost about 60 MB:
//! the list of every tracked object, a dict from storage to tensor, a dict
//! from tensor to name. Here a tensor costs 16 bytes (its address, with
//! three flags in the low bits, and its storage's key), and the rest is
//! found by sorting rather than by maps:
//!
//! - the tensors are found by walking the collector's lists in place
//!   (`gc_walk`), and held;
//! - each gets its storage's key (the device and the data pointer), so views
//!   of one storage sort next to each other and are one row;
//! - a name is found by looking a container's items up in the tensors
//!   sorted by address, when the row is written, so no name is kept.
//!
//! `rankscope._probe.torch.tensors` drives it, and spells the rows.

use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};

use crate::gc_walk;

/// Named by the scan's own dict (parameters, optimizer state, locals).
const NAMED: usize = 1;
/// An item of a container the scan names items of (`kept[3]`).
const IN_CONTAINER: usize = 2;
/// Its row was handed out, and the scan's hold on it went with it.
const DONE: usize = 4;
const FLAGS: usize = NAMED | IN_CONTAINER | DONE;
/// A key of its own (no storage, or an empty one: data pointer 0).
const OWN_DEVICE: u64 = 0xFFFF;
const PTR_BITS: u32 = 48;
const CHECK_EVERY: usize = 1024;
/// Items of one container looked at for names (a list of ten million
/// samples is not a list of tensors).
const MAX_ITEMS: isize = 1_000_000;

#[derive(Clone, Copy)]
struct Entry {
    /// The tensor's address, flags in its low bits (objects are 8-aligned).
    obj: usize,
    /// The storage's device and data pointer before grouping; its number of
    /// views after.
    key: u64,
}

impl Entry {
    fn addr(&self) -> usize {
        self.obj & !FLAGS
    }
    fn ptr(&self) -> *mut ffi::PyObject {
        self.addr() as *mut ffi::PyObject
    }
}

/// A row as `__next__` hands it out: the tensor, its views, and where a
/// container holds it (the container's index, the item's index or key).
type Row = (Py<PyAny>, u64, Option<(usize, Py<PyAny>)>);

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Named,
    Containers,
    Rest,
    Done,
}

#[pyclass(module = "rankscope._native")]
pub struct TensorScan {
    entries: Vec<Entry>,
    devices: Vec<String>,
    keyed: bool,
    grouped: bool,
    containers: Vec<Py<PyAny>>,
    phase: Phase,
    /// Where the rows are: an entry (phases Named and Rest), or a container
    /// and a place in it (Containers; a dict's place is `PyDict_Next`'s).
    cursor: usize,
    place: isize,
}

fn release(entry: &mut Entry) {
    if entry.obj & DONE == 0 {
        unsafe { ffi::Py_DecRef(entry.ptr()) };
        entry.obj |= DONE;
    }
}

impl Drop for TensorScan {
    fn drop(&mut self) {
        if self.entries.iter().all(|e| e.obj & DONE != 0) {
            return;
        }
        Python::attach(|_| self.entries.iter_mut().for_each(release));
    }
}

impl TensorScan {
    fn find(&self, addr: usize) -> Option<usize> {
        self.entries.binary_search_by_key(&addr, Entry::addr).ok()
    }

    fn sort_by_address(&mut self) {
        self.entries.sort_unstable_by_key(Entry::addr);
    }

    /// The storage's key; one of its own for a tensor without one. With
    /// `address` (torch's `_storage_address`) the storage's own address,
    /// which no call makes a Python object for. Without it, the storage's
    /// data pointer and device: `untyped_storage()` gives each storage a
    /// Python object that then lives as long as the storage does (about 64
    /// bytes, 6 MB for 100 k tensors).
    fn storage_key(
        &mut self,
        tensor: &Bound<'_, PyAny>,
        address: Option<&Bound<'_, PyAny>>,
    ) -> u64 {
        let own = (OWN_DEVICE << PTR_BITS) | (tensor.as_ptr() as u64 & ((1 << PTR_BITS) - 1));
        let ptr = match address {
            Some(address) => address.call1((tensor,)).and_then(|p| p.extract::<u64>()),
            None => tensor
                .call_method0("untyped_storage")
                .and_then(|s| s.call_method0("data_ptr"))
                .and_then(|p| p.extract::<u64>()),
        };
        let ptr = match ptr {
            Ok(ptr) if ptr != 0 && ptr < (1 << PTR_BITS) => ptr,
            _ => return own,
        };
        if address.is_some() {
            return ptr;
        }
        let cpu = tensor
            .getattr("is_cpu")
            .and_then(|c| c.extract::<bool>())
            .unwrap_or(false);
        let device = if cpu {
            0
        } else {
            let name = tensor
                .getattr("device")
                .and_then(|d| d.str().map(|s| s.to_string()))
                .unwrap_or_default();
            match self.devices.iter().position(|d| *d == name) {
                Some(i) => i + 1,
                None => {
                    self.devices.push(name);
                    self.devices.len()
                }
            }
        };
        if device as u64 >= OWN_DEVICE {
            return own;
        }
        ((device as u64) << PTR_BITS) | ptr
    }

    /// Marks the tensors among a container's items.
    fn mark_items(&mut self, container: &Bound<'_, PyAny>) {
        for_each_item(container, |_, item| {
            if let Some(i) = self.find(item.as_ptr() as usize) {
                self.entries[i].obj |= IN_CONTAINER;
            }
            true
        });
    }

    fn next_entry(
        &mut self,
        py: Python<'_>,
        wanted: impl Fn(&Entry) -> bool,
    ) -> Option<(Py<PyAny>, u64)> {
        while self.cursor < self.entries.len() {
            let i = self.cursor;
            self.cursor += 1;
            let entry = self.entries[i];
            if entry.obj & DONE == 0 && wanted(&entry) {
                return Some(self.hand_out(py, i));
            }
        }
        None
    }

    /// The tensor of entry `i` as a new reference, and its view count; the
    /// scan's own reference goes.
    fn hand_out(&mut self, py: Python<'_>, i: usize) -> (Py<PyAny>, u64) {
        let entry = &mut self.entries[i];
        let tensor = unsafe { Bound::from_borrowed_ptr(py, entry.ptr()).unbind() };
        release(entry);
        (tensor, entry.key)
    }

    /// The next tensor a container names, with the item's index or key.
    fn next_in_containers(&mut self, py: Python<'_>) -> Option<Row> {
        while self.cursor < self.containers.len() {
            let container = self.containers[self.cursor].bind(py).clone();
            let mut found = None;
            let mut place = self.place;
            let entries = &self.entries;
            for_each_item_from(&container, &mut place, |key, item| {
                let Ok(i) = entries.binary_search_by_key(&(item.as_ptr() as usize), Entry::addr)
                else {
                    return true;
                };
                if entries[i].obj & DONE != 0 {
                    return true;
                }
                found = Some((i, key.unbind()));
                false
            });
            self.place = place;
            if let Some((i, key)) = found {
                let (tensor, views) = self.hand_out(py, i);
                return Some((tensor, views, Some((self.cursor, key))));
            }
            self.cursor += 1;
            self.place = 0;
        }
        None
    }
}

/// Calls `f` with each item of a list, tuple or dict (its values) and its
/// index or key, until `f` says false.
fn for_each_item(
    container: &Bound<'_, PyAny>,
    f: impl FnMut(Bound<'_, PyAny>, Bound<'_, PyAny>) -> bool,
) {
    let mut place = 0;
    for_each_item_from(container, &mut place, f);
}

/// As `for_each_item`, from `place` on, leaving `place` at the item after
/// the last one `f` saw. Between two calls the program may have changed the
/// container: an index past the end ends it, and a dict that was resized
/// may hand an item twice or not at all, never a freed one.
fn for_each_item_from(
    container: &Bound<'_, PyAny>,
    place: &mut isize,
    mut f: impl FnMut(Bound<'_, PyAny>, Bound<'_, PyAny>) -> bool,
) {
    let py = container.py();
    if let Ok(dict) = container.cast::<PyDict>() {
        let mut key = std::ptr::null_mut();
        let mut value = std::ptr::null_mut();
        while *place < MAX_ITEMS
            && unsafe { ffi::PyDict_Next(dict.as_ptr(), place, &mut key, &mut value) } != 0
        {
            // Borrowed from the dict; owned from here for the call.
            let (key, value) = unsafe {
                (
                    Bound::from_borrowed_ptr(py, key),
                    Bound::from_borrowed_ptr(py, value),
                )
            };
            if !f(key, value) {
                return;
            }
        }
        return;
    }
    let item_at = |i: isize| -> Option<Bound<'_, PyAny>> {
        if i >= MAX_ITEMS {
            None
        } else if let Ok(list) = container.cast::<PyList>() {
            list.get_item(i as usize).ok()
        } else {
            container.cast::<PyTuple>().ok()?.get_item(i as usize).ok()
        }
    };
    while let Some(item) = item_at(*place) {
        let Ok(index) = (*place).into_pyobject(py);
        *place += 1;
        if !f(index.into_any(), item) {
            return;
        }
    }
}

#[pymethods]
impl TensorScan {
    /// Finds and holds every live object of type `kind` (torch.Tensor).
    #[new]
    fn new(py: Python<'_>, kind: &Bound<'_, PyType>) -> PyResult<Self> {
        let kinds = [kind.clone()];
        let mut filter = gc_walk::TypeFilter::new(&kinds);
        // Counted first, then taken: the list is made at its size, not
        // grown by doubling (which would hold two copies at its peak).
        let mut count = 0usize;
        gc_walk::visit_any(py, &mut |op| count += filter.matches(op) as usize)?;
        let mut entries = Vec::with_capacity(count);
        gc_walk::visit_any(py, &mut |op| {
            if entries.len() < count && filter.matches(op) {
                unsafe { ffi::Py_IncRef(op) };
                entries.push(Entry {
                    obj: op as usize,
                    key: 0,
                });
            }
        })?;
        if entries.iter().any(|e| e.obj & FLAGS != 0) {
            Python::attach(|_| {
                entries
                    .iter_mut()
                    .for_each(|e| unsafe { ffi::Py_DecRef(e.obj as *mut ffi::PyObject) })
            });
            return Err(PyValueError::new_err("an object at an unaligned address"));
        }
        Ok(TensorScan {
            entries,
            devices: Vec::new(),
            keyed: false,
            grouped: false,
            containers: Vec::new(),
            phase: Phase::Named,
            cursor: 0,
            place: 0,
        })
    }

    /// The held tensors that have a `grad_fn`: where autograd's graphs,
    /// and the tensors they saved for backward, are reached from.
    fn with_grad_fn(&self, py: Python<'_>) -> Vec<Py<PyAny>> {
        let none = py.None();
        self.entries
            .iter()
            .filter(|e| e.obj & DONE == 0)
            .filter_map(|e| {
                let tensor = unsafe { Bound::from_borrowed_ptr(py, e.ptr()) };
                let grad_fn = tensor.getattr(pyo3::intern!(py, "grad_fn")).ok()?;
                (!grad_fn.is(&none)).then(|| tensor.unbind())
            })
            .collect()
    }

    /// Holds more tensors (those no collector list has: saved for
    /// backward, made from autograd's graph); before `key`. One already
    /// held is not taken twice.
    fn add(&mut self, tensors: &Bound<'_, PyList>) -> PyResult<()> {
        if self.keyed || self.grouped {
            return Err(PyValueError::new_err("add() before key() and group()"));
        }
        if tensors.is_empty() {
            return Ok(());
        }
        // A set of the new ones only (not of the 100 k held: megabytes of
        // the probe's heap), less those held already.
        let mut new: std::collections::HashSet<usize> = tensors
            .iter()
            .map(|t| t.as_ptr() as usize)
            .filter(|addr| addr & FLAGS == 0)
            .collect();
        for entry in &self.entries {
            new.remove(&entry.addr());
        }
        for tensor in tensors.iter() {
            if new.remove(&(tensor.as_ptr() as usize)) {
                unsafe { ffi::Py_IncRef(tensor.as_ptr()) };
                self.entries.push(Entry {
                    obj: tensor.as_ptr() as usize,
                    key: 0,
                });
            }
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.entries.iter().filter(|e| e.obj & DONE == 0).count()
    }

    /// Reads each tensor's storage key within `budget_s` seconds; false when
    /// the budget ran out first (the tensors not reached are let go).
    #[pyo3(signature = (budget_s, address=None))]
    fn key(&mut self, py: Python<'_>, budget_s: f64, address: Option<Bound<'_, PyAny>>) -> bool {
        self.keyed = true;
        let deadline = Instant::now() + Duration::from_secs_f64(budget_s.clamp(0.0, 3600.0));
        for i in 0..self.entries.len() {
            if i % CHECK_EVERY == 0 && Instant::now() > deadline {
                for entry in &mut self.entries[i..] {
                    release(entry);
                }
                self.entries.truncate(i);
                return false;
            }
            let tensor = unsafe { Bound::from_borrowed_ptr(py, self.entries[i].ptr()) };
            self.entries[i].key = self.storage_key(&tensor, address.as_ref());
        }
        true
    }

    /// One tensor per storage: the others are let go, and the one kept
    /// counts them (`views`). Kept is one named in `names` (a dict keyed by
    /// `id()`) or an item of one of `containers`, else the one with most
    /// elements.
    fn group(
        &mut self,
        py: Python<'_>,
        names: &Bound<'_, PyDict>,
        containers: &Bound<'_, PyList>,
    ) -> PyResult<()> {
        if self.grouped {
            return Err(PyValueError::new_err("this scan was grouped already"));
        }
        self.grouped = true;
        self.sort_by_address();
        for entry in &mut self.entries {
            if names.contains(entry.addr())? {
                entry.obj |= NAMED;
            }
        }
        for container in containers.iter() {
            self.mark_items(&container);
            self.containers.push(container.unbind());
        }
        self.entries.sort_unstable_by_key(|e| e.key);
        let numel = |e: &Entry| -> i64 {
            let tensor = unsafe { Bound::from_borrowed_ptr(py, e.ptr()) };
            tensor
                .call_method0("numel")
                .and_then(|n| n.extract::<i64>())
                .unwrap_or(0)
        };
        let mut start = 0;
        while start < self.entries.len() {
            let key = self.entries[start].key;
            let mut end = start + 1;
            while end < self.entries.len() && self.entries[end].key == key {
                end += 1;
            }
            let mut best = start;
            if end - start > 1 {
                let rank = |e: &Entry| (e.obj & (NAMED | IN_CONTAINER) != 0, numel(e));
                let mut best_rank = rank(&self.entries[start]);
                for i in start + 1..end {
                    let r = rank(&self.entries[i]);
                    if r > best_rank {
                        best_rank = r;
                        best = i;
                    }
                }
            }
            for i in start..end {
                if i == best {
                    self.entries[i].key = (end - start) as u64;
                } else {
                    release(&mut self.entries[i]);
                }
            }
            start = end;
        }
        // Not shrunk: a smaller copy would be more of the probe's heap touched.
        self.entries.retain(|e| e.obj & DONE == 0);
        self.sort_by_address();
        Ok(())
    }

    /// Up to `n` of the tensors no name reaches, largest first by `size`
    /// (a function of a tensor).
    fn largest_unnamed(&self, py: Python<'_>, n: usize, size: &Bound<'_, PyAny>) -> Vec<Py<PyAny>> {
        let mut top: Vec<(u64, usize)> = Vec::with_capacity(n + 1);
        for entry in &self.entries {
            if entry.obj & (NAMED | IN_CONTAINER | DONE) != 0 || n == 0 {
                continue;
            }
            let tensor = unsafe { Bound::from_borrowed_ptr(py, entry.ptr()) };
            let size = size
                .call1((tensor,))
                .and_then(|b| b.extract::<u64>())
                .unwrap_or(0);
            if top.len() == n && size <= top[n - 1].0 {
                continue;
            }
            let at = top.partition_point(|&(s, _)| s >= size);
            top.insert(at, (size, entry.addr()));
            top.truncate(n);
        }
        top.into_iter()
            .map(|(_, addr)| unsafe {
                Bound::from_borrowed_ptr(py, addr as *mut ffi::PyObject).unbind()
            })
            .collect()
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// `(tensor, views, None)` for a tensor named in `names` or by nothing,
    /// `(tensor, views, (container's index, item's index or key))` for one
    /// a container holds: named tensors first, then containers' items in
    /// their order, then the rest. Each tensor once; the scan lets it go as
    /// it hands it out.
    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Row>> {
        if !self.grouped {
            return Err(PyValueError::new_err(
                "group() the scan before reading its rows",
            ));
        }
        loop {
            let found = match self.phase {
                Phase::Named => self
                    .next_entry(py, |e| e.obj & NAMED != 0)
                    .map(|(t, v)| (t, v, None)),
                Phase::Containers => self.next_in_containers(py),
                Phase::Rest => self.next_entry(py, |_| true).map(|(t, v)| (t, v, None)),
                Phase::Done => return Ok(None),
            };
            if found.is_some() {
                return Ok(found);
            }
            self.phase = match self.phase {
                Phase::Named => Phase::Containers,
                Phase::Containers => Phase::Rest,
                _ => Phase::Done,
            };
            self.cursor = 0;
            self.place = 0;
            if self.phase == Phase::Done {
                self.containers.clear();
            }
        }
    }
}
