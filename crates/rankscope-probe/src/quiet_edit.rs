//! Edits a dictionary that another thread may be iterating, only while no
//! thread runs the code that iterates it.
//!
//! torch calls its global optimizer hooks with `for hook in
//! chain(d.values(), ...)` over the live dictionaries: adding or removing
//! one from a probe thread while the training thread is inside that loop
//! would raise "OrderedDict mutated during iteration" into the program.
//! The check (no thread has a frame of the optimizer's step wrapper) and
//! the edit are made here without running any bytecode in between, so no
//! other thread can take the GIL and enter the loop meanwhile.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Whether any thread's stack holds a frame running `code`.
fn running(current_frames: &Bound<'_, PyAny>, code: &Bound<'_, PyAny>) -> PyResult<bool> {
    let frames = current_frames.call0()?;
    let frames = frames.cast::<PyDict>()?;
    for (_, frame) in frames.iter() {
        let mut frame = frame;
        while !frame.is_none() {
            if frame.getattr("f_code")?.is(code) {
                return Ok(true);
            }
            frame = frame.getattr("f_back")?;
        }
    }
    Ok(false)
}

/// `sets` holds `(dict, key, value)`, `dels` `(dict, key)`. With `code`,
/// nothing is edited (and False returned) while a thread runs it.
#[pyfunction]
#[pyo3(signature = (current_frames, code, sets, dels))]
pub fn edit_unless_running(
    current_frames: &Bound<'_, PyAny>,
    code: Option<&Bound<'_, PyAny>>,
    sets: &Bound<'_, PyList>,
    dels: &Bound<'_, PyList>,
) -> PyResult<bool> {
    if let Some(code) = code {
        if running(current_frames, code)? {
            return Ok(false);
        }
    }
    // PyObject_SetItem, not PyDict_SetItem: an OrderedDict keeps its order
    // in a list of its own that only its own methods update.
    for item in sets.iter() {
        let (dict, key, value): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) =
            item.extract()?;
        dict.set_item(key, value)?;
    }
    for item in dels.iter() {
        let (dict, key): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        if dict.contains(&key)? {
            dict.del_item(key)?;
        }
    }
    Ok(true)
}
