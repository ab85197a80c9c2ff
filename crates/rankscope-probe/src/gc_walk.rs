//! Every object the garbage collector tracks, visited in place: what
//! `gc.get_objects()` gives without its list, which is 8 bytes an object
//! (11 MB in a process of 1.4 M objects). A scan of the live tensors may
//! cost the program a few MB at most (issue 12), and so may finding its
//! models.
//!
//! From 3.12, CPython has API for it (`PyUnstable_GC_VisitObjects`), found
//! with dlsym because the probe is built for the stable ABI. On 3.11 the
//! generations' lists are walked. Their heads are found from a list made
//! just now, which the interpreter links in just before the youngest
//! generation's head. The layout is checked before any object is read: the
//! state's `generation0` pointer, which follows the three heads, must point
//! back at the first. Anywhere else, or while a collection runs, the caller
//! is told no, and uses `gc.get_objects()`.
//!
//! The visitor must not make or free a Python object: either would change
//! the lists being walked.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple, PyType};

type Visit = unsafe extern "C" fn(*mut ffi::PyObject, *mut c_void) -> c_int;
type VisitObjects = unsafe extern "C" fn(Visit, *mut c_void);

/// 3.11's `struct gc_generation`: a `PyGC_Head` (two words) and two ints.
const GENERATION_BYTES: usize = 24;
/// From the first generation's head: the `generation0` pointer after the
/// three generations, the permanent generation after it (what
/// `gc.freeze()` moved there), then three generations' statistics (three
/// words each) and `collecting`.
const GENERATION0_AT: usize = 3 * GENERATION_BYTES;
const PERMANENT_AT: usize = GENERATION0_AT + 8;
const COLLECTING_AT: usize = PERMANENT_AT + GENERATION_BYTES + 3 * 24;

fn visit_objects_api() -> Option<VisitObjects> {
    let name = c"PyUnstable_GC_VisitObjects";
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!symbol.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, VisitObjects>(symbol) })
}

unsafe extern "C" fn trampoline(op: *mut ffi::PyObject, arg: *mut c_void) -> c_int {
    let visitor = unsafe { &mut *(arg as *mut &mut dyn FnMut(*mut ffi::PyObject)) };
    // No unwinding into the interpreter: a panic ends the walk.
    catch_unwind(AssertUnwindSafe(|| visitor(op))).is_ok() as c_int
}

/// The heads of 3.11's generation lists, or None where the layout is not
/// the one expected or a collection is under way.
fn heads_311(py: Python<'_>) -> Option<[usize; 4]> {
    let fresh = PyList::empty(py);
    // The list's PyGC_Head is the two words before it; `_gc_next` first.
    let first = unsafe { *(fresh.as_ptr() as *const usize).sub(2) };
    drop(fresh);
    if first == 0 || first % std::mem::align_of::<usize>() != 0 {
        return None;
    }
    let generation0 = unsafe { *((first + GENERATION0_AT) as *const usize) };
    if generation0 != first {
        return None;
    }
    let collecting = unsafe { *((first + COLLECTING_AT) as *const c_int) };
    if collecting != 0 {
        return None;
    }
    Some([
        first,
        first + GENERATION_BYTES,
        first + 2 * GENERATION_BYTES,
        first + PERMANENT_AT,
    ])
}

/// Calls `visitor` with every object the collector tracks (borrowed: the
/// visitor increfs what it keeps). False when this interpreter's objects
/// cannot be visited in place; `visitor` was then not called.
pub fn visit(py: Python<'_>, visitor: &mut dyn FnMut(*mut ffi::PyObject)) -> bool {
    let version = py.version_info();
    if (version.major, version.minor) >= (3, 12) {
        let Some(api) = visit_objects_api() else {
            return false;
        };
        let mut visitor = visitor;
        let arg = &mut visitor as *mut &mut dyn FnMut(*mut ffi::PyObject) as *mut c_void;
        unsafe { api(trampoline, arg) };
        return true;
    }
    if (version.major, version.minor) != (3, 11) {
        return false;
    }
    let Some(heads) = heads_311(py) else {
        return false;
    };
    for head in heads {
        let mut gc = unsafe { *(head as *const usize) };
        while gc != head && gc != 0 {
            // FROM_GC: the object follows its two-word header.
            visitor((gc + 2 * std::mem::size_of::<usize>()) as *mut ffi::PyObject);
            gc = unsafe { *(gc as *const usize) };
        }
    }
    true
}

/// Whether `op`'s type is `kind` or a subclass of it; asked once per type
/// in a row of equal types (most objects of a heap share a few types).
pub struct TypeFilter {
    kinds: Vec<*mut ffi::PyTypeObject>,
    last: *mut ffi::PyTypeObject,
    last_matched: bool,
}

impl TypeFilter {
    pub fn new(kinds: &[Bound<'_, PyType>]) -> Self {
        TypeFilter {
            kinds: kinds.iter().map(|k| k.as_type_ptr()).collect(),
            last: std::ptr::null_mut(),
            last_matched: false,
        }
    }

    pub fn matches(&mut self, op: *mut ffi::PyObject) -> bool {
        let kind = unsafe { ffi::Py_TYPE(op) };
        if kind != self.last {
            self.last = kind;
            self.last_matched = self
                .kinds
                .iter()
                .any(|&k| unsafe { ffi::PyType_IsSubtype(kind, k) } != 0);
        }
        self.last_matched
    }
}

/// The types a caller asked for: one type, or a tuple of them.
pub fn kinds<'py>(kinds: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyType>>> {
    if let Ok(one) = kinds.cast::<PyType>() {
        return Ok(vec![one.clone()]);
    }
    kinds
        .cast::<PyTuple>()?
        .iter()
        .map(|k| Ok(k.cast::<PyType>()?.clone()))
        .collect()
}

/// `visit`, or where objects cannot be visited in place, the same over
/// `gc.get_objects()` (whose list holds each object during the call).
pub fn visit_any(py: Python<'_>, visitor: &mut dyn FnMut(*mut ffi::PyObject)) -> PyResult<()> {
    if visit(py, visitor) {
        return Ok(());
    }
    let objects = py.import("gc")?.call_method0("get_objects")?;
    for obj in objects.cast::<PyList>()?.iter() {
        visitor(obj.as_ptr());
    }
    Ok(())
}

/// `gc_tracked()`: how many objects the collector tracks, as
/// `len(gc.get_objects())` without the list.
#[pyfunction]
pub fn gc_tracked(py: Python<'_>) -> PyResult<usize> {
    let mut count = 0usize;
    visit_any(py, &mut |_| count += 1)?;
    Ok(count)
}

/// `gc_instances(types)`: the tracked objects of these types (or their
/// subclasses), as `gc.get_objects()` filtered by type, without the list
/// of every object in between.
#[pyfunction]
pub fn gc_instances<'py>(
    py: Python<'py>,
    types: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let kinds = kinds(types)?;
    let mut filter = TypeFilter::new(&kinds);
    let mut found: Vec<Py<PyAny>> = Vec::new();
    visit_any(py, &mut |op| {
        if filter.matches(op) {
            found.push(unsafe { Bound::from_borrowed_ptr(py, op).unbind() });
        }
    })?;
    PyList::new(py, found)
}
