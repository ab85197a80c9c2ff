//! Python values to JSON, in Rust: a helper that answers with plain dicts
//! and lists needs no `json` import in the program. Importing it (and the
//! `re` and `enum` it pulls in) from a probe thread while the main thread
//! runs bytecode took seconds on 3.11, each file read handing the GIL back
//! and waiting a switch interval to get it again.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value};

/// Nesting past this is a bug in a helper, not data.
const MAX_DEPTH: usize = 64;

pub fn to_json(value: &Bound<'_, PyAny>) -> PyResult<Value> {
    convert(value, 0)
}

fn convert(value: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(PyTypeError::new_err("a helper's reply nests too deep"));
    }
    if value.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = value.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if value.is_instance_of::<PyInt>() {
        if let Ok(i) = value.extract::<i64>() {
            return Ok(i.into());
        }
        if let Ok(u) = value.extract::<u64>() {
            return Ok(u.into());
        }
        return Ok(Value::String(value.str()?.to_str()?.to_string()));
    }
    if let Ok(f) = value.cast::<PyFloat>() {
        // JSON has no NaN or infinity; Python's json module would write
        // bare NaN, which no strict parser reads.
        return Ok(Number::from_f64(f.value()).map(Value::Number).unwrap_or(Value::Null));
    }
    if let Ok(s) = value.cast::<PyString>() {
        return Ok(Value::String(s.to_str().map(str::to_string).unwrap_or_else(|_| s.to_string_lossy().into_owned())));
    }
    if let Ok(d) = value.cast::<PyDict>() {
        let mut map = Map::with_capacity(d.len());
        for (k, v) in d.iter() {
            let key = match k.cast::<PyString>() {
                Ok(s) => s.to_string_lossy().into_owned(),
                Err(_) => k.str()?.to_string_lossy().into_owned(),
            };
            map.insert(key, convert(&v, depth + 1)?);
        }
        return Ok(Value::Object(map));
    }
    if let Ok(l) = value.cast::<PyList>() {
        return l.iter().map(|v| convert(&v, depth + 1)).collect::<PyResult<Vec<_>>>().map(Value::Array);
    }
    if let Ok(t) = value.cast::<PyTuple>() {
        return t.iter().map(|v| convert(&v, depth + 1)).collect::<PyResult<Vec<_>>>().map(Value::Array);
    }
    Err(PyTypeError::new_err(format!("a helper replied with a {}", value.get_type().name()?)))
}
