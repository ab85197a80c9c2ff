//! Python values to JSON, in Rust: a helper that answers with plain dicts
//! and lists needs no `json` import in the program. Importing it (and the
//! `re` and `enum` it pulls in) from a probe thread while the main thread
//! runs bytecode took seconds on 3.11, each file read handing the GIL back
//! and waiting a switch interval to get it again.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyIterator, PyList, PyString, PyTuple};
use serde_json::Number;

/// Nesting past this is a bug in a helper, not data.
const MAX_DEPTH: usize = 64;

/// The JSON text of a helper's reply, written as the values are walked:
/// no tree of `serde_json::Value`s in between, which for a reply of 100 k
/// rows (`python.tensors`) cost several times the text's own size.
pub fn to_json_string(value: &Bound<'_, PyAny>) -> PyResult<String> {
    let mut out = Vec::with_capacity(4096);
    write(value, 0, &mut out)?;
    // Only UTF-8 goes in: serde_json's own writer for every string and number.
    Ok(String::from_utf8(out).unwrap_or_default())
}

fn scalar(out: &mut Vec<u8>, value: &impl serde::Serialize) -> PyResult<()> {
    serde_json::to_writer(out, value).map_err(|e| PyTypeError::new_err(e.to_string()))
}

fn write(value: &Bound<'_, PyAny>, depth: usize, out: &mut Vec<u8>) -> PyResult<()> {
    if depth > MAX_DEPTH {
        return Err(PyTypeError::new_err("a helper's reply nests too deep"));
    }
    if value.is_none() {
        out.extend_from_slice(b"null");
        return Ok(());
    }
    if let Ok(b) = value.cast::<PyBool>() {
        out.extend_from_slice(if b.is_true() { b"true" } else { b"false" });
        return Ok(());
    }
    if value.is_instance_of::<PyInt>() {
        if let Ok(i) = value.extract::<i64>() {
            return scalar(out, &i);
        }
        if let Ok(u) = value.extract::<u64>() {
            return scalar(out, &u);
        }
        return scalar(out, &value.str()?.to_str()?);
    }
    if let Ok(f) = value.cast::<PyFloat>() {
        // JSON has no NaN or infinity; Python's json module would write
        // bare NaN, which no strict parser reads.
        return match Number::from_f64(f.value()) {
            Some(n) => scalar(out, &n),
            None => {
                out.extend_from_slice(b"null");
                Ok(())
            }
        };
    }
    if let Ok(s) = value.cast::<PyString>() {
        return match s.to_str() {
            Ok(text) => scalar(out, &text),
            Err(_) => scalar(out, &s.to_string_lossy()),
        };
    }
    if let Ok(d) = value.cast::<PyDict>() {
        out.push(b'{');
        for (i, (k, v)) in d.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            match k.cast::<PyString>() {
                Ok(s) => scalar(out, &s.to_string_lossy())?,
                Err(_) => scalar(out, &k.str()?.to_string_lossy())?,
            }
            out.push(b':');
            write(&v, depth + 1, out)?;
        }
        out.push(b'}');
        return Ok(());
    }
    // A generator of rows (`python.tensors`): each row is written and
    // dropped before the next is made, so the rows never all live at once.
    // An error inside it ends the reply as an error.
    let mut failed = None;
    let items: Box<dyn Iterator<Item = Bound<'_, PyAny>>> = if let Ok(l) = value.cast::<PyList>() {
        Box::new(l.iter())
    } else if let Ok(t) = value.cast::<PyTuple>() {
        Box::new(t.iter())
    } else if let Ok(it) = value.cast::<PyIterator>() {
        Box::new(
            it.clone()
                .map_while(|item| item.map_err(|e| failed = Some(e)).ok()),
        )
    } else {
        return Err(PyTypeError::new_err(format!(
            "a helper replied with a {}",
            value.get_type().name()?
        )));
    };
    out.push(b'[');
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write(&item, depth + 1, out)?;
    }
    out.push(b']');
    failed.map_or(Ok(()), Err)
}
