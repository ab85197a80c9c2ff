//! Python values to JSON, in Rust: a helper that answers with plain dicts
//! and lists needs no `json` import in the program. Importing it (and the
//! `re` and `enum` it pulls in) from a probe thread while the main thread
//! runs bytecode took seconds on 3.11, each file read handing the GIL back
//! and waiting a switch interval to get it again.

use std::io::Write;
use std::ops::{Deref, DerefMut};

use pyo3::exceptions::{PyOSError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyIterator, PyList, PyString, PyTuple};
use serde_json::Number;

/// Nesting past this is a bug in a helper, not data.
const MAX_DEPTH: usize = 64;
/// A reply that grows past this goes to the client as it is written.
const SPILL_BYTES: usize = 128 * 1024;

/// Where a reply's JSON text goes: memory, and, for a sink with a
/// connection, the connection once the text outgrows `SPILL_BYTES`, each
/// piece written with the GIL let go (a slow client costs the program
/// nothing) and then dropped. So the 100 k rows of a `python.tensors` reply
/// never sit in the target whole.
pub struct Sink<'a> {
    buf: Vec<u8>,
    out: Option<&'a mut (dyn Write + Send)>,
    /// The response's head went out: the rest can only follow it.
    started: bool,
}

impl<'a> Sink<'a> {
    pub fn new(out: Option<&'a mut (dyn Write + Send)>) -> Self {
        // A sink that spills gets its whole buffer at once: grown by
        // doubling instead, the buffer's earlier copies stayed in the
        // probe's heap (mimalloc), 6 MB of the target's memory for a
        // 256 KB buffer.
        let capacity = if out.is_some() {
            SPILL_BYTES + SPILL_BYTES / 2
        } else {
            4096
        };
        Sink {
            buf: Vec::with_capacity(capacity),
            out,
            started: false,
        }
    }

    pub fn started(&self) -> bool {
        self.started
    }

    /// What was written and not yet sent.
    pub fn into_text(self) -> Vec<u8> {
        self.buf
    }

    pub fn set_text(&mut self, text: String) {
        self.buf = text.into_bytes();
    }

    fn spill(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.buf.len() < SPILL_BYTES {
            return Ok(());
        }
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        let (started, buf) = (self.started, &self.buf);
        let sent = py.detach(|| {
            if !started {
                rankscope_core::http::write_streamed_head(&mut **out, "application/json")?;
            }
            out.write_all(buf)
        });
        self.started = true;
        self.buf.clear();
        sent.map_err(|e| PyOSError::new_err(format!("the client stopped reading the reply: {e}")))
    }
}

impl Deref for Sink<'_> {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

impl DerefMut for Sink<'_> {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

/// The JSON text of a helper's reply, written as the values are walked:
/// no tree of `serde_json::Value`s in between, which for a reply of 100 k
/// rows (`python.tensors`) cost several times the text's own size. Only
/// UTF-8 goes in: serde_json's own writer for every string and number.
pub fn write_json(value: &Bound<'_, PyAny>, out: &mut Sink<'_>) -> PyResult<()> {
    write(value, 0, out)
}

fn scalar(out: &mut Vec<u8>, value: &impl serde::Serialize) -> PyResult<()> {
    serde_json::to_writer(out, value).map_err(|e| PyTypeError::new_err(e.to_string()))
}

fn write(value: &Bound<'_, PyAny>, depth: usize, out: &mut Sink<'_>) -> PyResult<()> {
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
        // bare NaN, which no strict parser reads. They go as text, as the
        // run store's rows send them ("NaN", "inf"): as null, a NaN loss
        // vanished from `torch nan`, where it is the point.
        return match Number::from_f64(f.value()) {
            Some(n) => scalar(out, &n),
            None => scalar(out, &f.value().to_string()),
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
        out.spill(value.py())?;
    }
    out.push(b']');
    failed.map_or(Ok(()), Err)
}
