//! Uncaught exceptions reach the crash recorder through an audit hook, not
//! by replacing `sys.excepthook`.
//!
//! Replacing the hook is visible to the program (`sys.excepthook is
//! sys.__excepthook__` turns false, and a program that installs its own hook
//! afterwards silently turns recording off). CPython raises the audit event
//! `sys.excepthook` with `(hook, type, value, traceback)` just before it
//! calls whatever hook is set, so a C-level audit hook sees every uncaught
//! exception of the main thread, and the program's hook still runs after it,
//! unchanged. Audit hooks cannot be removed; like the crash records of
//! earlier versions, recording outlives `stop()`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;

type AuditHook = unsafe extern "C" fn(*const c_char, *mut ffi::PyObject, *mut c_void) -> c_int;
type AddAuditHook = unsafe extern "C" fn(AuditHook, *mut c_void) -> c_int;

static ENABLED: AtomicBool = AtomicBool::new(false);
static INSTALLED: OnceLock<bool> = OnceLock::new();

/// `PySys_AddAuditHook` is not in the limited API; every CPython this probe
/// supports exports it.
fn add_audit_hook_fn() -> Option<AddAuditHook> {
    let name: &CStr = c"PySys_AddAuditHook";
    // SAFETY: dlsym on the default namespace with a valid C string.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    // SAFETY: the symbol has this signature in CPython 3.8 and later.
    (!symbol.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, AddAuditHook>(symbol) })
}

unsafe extern "C" fn on_audit(
    event: *const c_char,
    args: *mut ffi::PyObject,
    _: *mut c_void,
) -> c_int {
    // Every audited operation of the program passes here: answer fast.
    if !ENABLED.load(Ordering::Relaxed) || event.is_null() || args.is_null() {
        return 0;
    }
    // SAFETY: CPython passes a NUL-terminated event name.
    if unsafe { CStr::from_ptr(event) } != c"sys.excepthook" {
        return 0;
    }
    // Audit hooks run with the GIL held; attach only makes that known to PyO3.
    Python::attach(|py| {
        // SAFETY: `args` is a tuple CPython owns for the duration of this call.
        let args = unsafe { Bound::from_borrowed_ptr(py, args) };
        let outcome = py
            .import("rankscope._probe.crashes")
            .and_then(|m| m.call_method1("on_uncaught", (args,)));
        // The error is taken out of the thread state by PyO3 and dropped here:
        // a failing recorder must not change what the program's hook prints.
        drop(outcome);
    });
    // Non-zero would abort the program's own excepthook.
    0
}

/// Turns crash recording through the audit hook on (installing the hook the
/// first time). Returns false where the hook could not be added.
#[pyfunction]
pub fn enable_crash_hook(py: Python<'_>) -> bool {
    let installed = *INSTALLED.get_or_init(|| {
        let Some(add) = add_audit_hook_fn() else {
            return false;
        };
        // SAFETY: called with the GIL held; on_audit has the hook signature.
        let status = unsafe { add(on_audit, std::ptr::null_mut()) };
        if status != 0 {
            // An existing audit hook refused ours; do not leave its error set.
            drop(PyErr::take(py));
        }
        status == 0
    });
    ENABLED.store(installed, Ordering::Relaxed);
    installed
}
