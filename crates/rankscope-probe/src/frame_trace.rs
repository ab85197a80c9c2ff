//! A trace function for chosen frames of one other thread (CPython 3.11).
//!
//! On 3.11 a breakpoint reaches new calls through an instrumented code
//! object, but a frame that is already running (a `while True:` in `train()`)
//! keeps the code it started with. For such frames only, the probe installs
//! a C-level trace function on the thread that runs them: it answers every
//! event with a pointer comparison and calls back into Python only for a
//! line event of a chosen frame. It takes itself off when the last chosen
//! frame returns, or at the first event after the probe marks it inactive,
//! so the thread pays tracing costs only while it has to.
//!
//! The state is a Python list `[active, callback, frame, ...]`, owned by the
//! thread state as its trace object: the probe flips `active` to `False` to
//! remove it (the trace function cannot be taken off another thread safely
//! once that thread may have replaced it with a tracer of its own).
//!
//! `sys.settrace` can only set the calling thread's tracer; CPython's
//! `_PyEval_SetTrace(tstate, ...)` (what 3.12's `threading.settrace_all_threads`
//! uses) sets another's, with the GIL held. It is looked up at run time, so
//! that a Python without it only loses this feature.

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

const TRACE_LINE: c_int = 2;
const TRACE_RETURN: c_int = 3;

type TraceFunc = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *mut ffi::PyObject,
    c_int,
    *mut ffi::PyObject,
) -> c_int;
type SetTrace = unsafe extern "C" fn(*mut c_void, Option<TraceFunc>, *mut ffi::PyObject) -> c_int;

// Not in the limited API, present in every CPython this probe supports.
unsafe extern "C" {
    fn PyInterpreterState_ThreadHead(interp: *mut ffi::PyInterpreterState) -> *mut c_void;
    fn PyThreadState_Next(tstate: *mut c_void) -> *mut c_void;
    fn PyThreadState_GetFrame(tstate: *mut c_void) -> *mut ffi::PyObject;
    fn PyFrame_GetBack(frame: *mut ffi::PyObject) -> *mut ffi::PyObject;
}

fn set_trace_fn() -> Option<SetTrace> {
    static FOUND: OnceLock<Option<SetTrace>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let name: &CStr = c"_PyEval_SetTrace";
        // SAFETY: dlsym on the default namespace with a valid C string.
        let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        // SAFETY: the symbol has this signature in CPython 3.11-3.13.
        (!symbol.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, SetTrace>(symbol) })
    })
}

/// The thread state whose current stack holds `frame`, if any.
///
/// # Safety
/// The GIL must be held.
unsafe fn thread_running(frame: *mut ffi::PyObject) -> Option<*mut c_void> {
    // SAFETY: the caller holds the GIL; every pointer comes from CPython.
    unsafe {
        let mut tstate = PyInterpreterState_ThreadHead(ffi::PyInterpreterState_Get());
        while !tstate.is_null() {
            let mut current = PyThreadState_GetFrame(tstate);
            while !current.is_null() {
                let found = current == frame;
                let back = PyFrame_GetBack(current);
                ffi::Py_DECREF(current);
                if found {
                    if !back.is_null() {
                        ffi::Py_DECREF(back);
                    }
                    return Some(tstate);
                }
                current = back;
            }
            tstate = PyThreadState_Next(tstate);
        }
        None
    }
}

/// Removes the calling thread's trace function. After this, `state` may be
/// freed: the thread state held the last reference.
unsafe fn untrace_current_thread() {
    // SAFETY: the caller holds the GIL; every pointer comes from CPython.
    unsafe {
        if let Some(set_trace) = set_trace_fn() {
            if set_trace(ffi::PyThreadState_Get().cast(), None, std::ptr::null_mut()) != 0 {
                ffi::PyErr_Clear();
            }
        }
    }
}

unsafe extern "C" fn trampoline(
    state: *mut ffi::PyObject,
    frame: *mut ffi::PyObject,
    what: c_int,
    _arg: *mut ffi::PyObject,
) -> c_int {
    // SAFETY: the caller holds the GIL; every pointer comes from CPython.
    unsafe {
        if ffi::PyList_GetItem(state, 0) != ffi::Py_True() {
            untrace_current_thread();
            return 0;
        }
        if what != TRACE_LINE && what != TRACE_RETURN {
            return 0;
        }
        let len = ffi::PyList_Size(state);
        for i in 2..len {
            if ffi::PyList_GetItem(state, i) != frame {
                continue;
            }
            if what == TRACE_RETURN {
                ffi::PyList_SetSlice(state, i, i + 1, std::ptr::null_mut());
                if ffi::PyList_Size(state) <= 2 {
                    untrace_current_thread();
                }
                return 0;
            }
            let callback = ffi::PyList_GetItem(state, 1);
            // The callback swallows its own errors; anything left is cleared
            // here so that the traced program never sees it.
            let result = ffi::PyObject_CallFunctionObjArgs(
                callback,
                frame,
                std::ptr::null_mut::<ffi::PyObject>(),
            );
            if result.is_null() {
                ffi::PyErr_Clear();
            } else {
                ffi::Py_DECREF(result);
            }
            return 0;
        }
        0
    }
}

/// Traces the frames in `state[2:]` (all run by one thread) with the
/// callback `state[1]`, called as `callback(frame)` at their line events.
/// Returns False when no thread runs the first frame any more or the
/// interpreter lacks the hook.
#[pyfunction]
pub fn trace_frames(state: &Bound<'_, PyList>) -> PyResult<bool> {
    if state.len() < 3 {
        return Ok(false);
    }
    let Some(set_trace) = set_trace_fn() else {
        return Ok(false);
    };
    let first = state.get_item(2)?;
    // SAFETY: the GIL is held (we have a Bound); pointers stay valid while it is.
    unsafe {
        let Some(tstate) = thread_running(first.as_ptr()) else {
            return Ok(false);
        };
        if set_trace(tstate, Some(trampoline), state.as_ptr()) != 0 {
            return Err(PyErr::fetch(state.py()));
        }
    }
    Ok(true)
}
