//! The stand-in for a module's `forward` (timed.py says where it goes on
//! and what it must not change): it adds each call's time and count into a
//! list of counters, and may call `before` and `after` around the call.
//!
//! Native because it runs on every module call of a sampled step (the
//! trace), and on every step's root call while the NaN watch is armed. As
//! a Python class its `__call__` was a frame, an argument tuple and dict
//! made again, and two clock reads through `time`, cold in the middle of
//! the step's kernels. Here the call passes the argument tuple and dict it
//! was given straight to the inner forward: +173-201 ns a call warm,
//! against +420 ns (bench/bench_step_hooks.py).
//!
//! Nothing of the program's changes: an exception from the inner forward
//! goes through untouched (the call then counts nothing); any attribute
//! that is not the stand-in's own is the inner forward's; `deepcopy` gives
//! the inner forward's copy and pickling saves the inner forward.
//!
//! Nor does when a module is freed. The stand-in sits in its module's
//! `__dict__`; holding the module's bound `forward` would make a cycle
//! (module, its dict, the stand-in, the bound method, the module), and a
//! model the program drops would wait for the cyclic collector, or stay
//! alive for good while anything held the stand-in. So once `owner` is set
//! (timed.put_on does), a bound method of that module is kept as its
//! function and a weak reference to the module, and bound again at each
//! call: the model is freed the moment the program lets go of it, as
//! without rankscope.

use pyo3::exceptions::PyReferenceError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType, PyWeakrefReference};
use pyo3::{intern, PyTraverseError};

/// `types.MethodType`, imported when the first stand-in is made: never
/// later, under a borrow of one (an import may run the program's code).
static METHOD_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `torch._C._current_graph_task_id` (None on a torch without it), got
/// when the first timing stand-in is made, as `METHOD_TYPE` is: not -1
/// while autograd's engine runs a backward on this thread, where a module
/// called is an activation checkpoint's recompute (see `__call__`).
static GRAPH_TASK_ID: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();

use crate::nan_arm::{self, NanArm};
use crate::step_clock::perf_ns;

/// `StandIn(inner, acc, at, before=None, after=None, timing=True)`: calls
/// `inner`; with `timing`, adds the call's ns and 1 into `acc[at]` and
/// `acc[at + 1]`, and calls `before(args, kwargs, start_ns)`; without,
/// `before(args, kwargs)` (no clock read). `after(args, output)` follows
/// the call. `before` and `after` catch their own errors.
#[pyclass(module = "rankscope._native", weakref)]
pub struct StandIn {
    /// The inner forward; with `bound`, its function, called with the
    /// module (`owner`) first.
    wrapped: Py<PyAny>,
    owner: Option<Py<PyWeakrefReference>>,
    bound: bool,
    acc: Option<Py<PyList>>,
    at: usize,
    before: Option<Py<PyAny>>,
    after: Option<Py<PyAny>>,
    timing: bool,
    /// The module's own attribute before this one (timed.put_on sets it).
    previous: Option<Py<PyAny>>,
    /// On a model's root while the NaN watch is armed: the step's input is
    /// kept natively (nan_arm.rs), and `before` and `after` are called only
    /// where the watch's Python has to do it.
    arm: Option<Py<NanArm>>,
}

#[pymethods]
impl StandIn {
    #[new]
    #[pyo3(signature = (inner, acc, at, before=None, after=None, timing=true))]
    fn new(
        py: Python<'_>,
        inner: Py<PyAny>,
        acc: Option<Py<PyList>>,
        at: usize,
        before: Option<Py<PyAny>>,
        after: Option<Py<PyAny>>,
        timing: bool,
    ) -> PyResult<Self> {
        METHOD_TYPE.import(py, "types", "MethodType")?;
        if timing {
            GRAPH_TASK_ID.get_or_init(py, || {
                py.import("torch._C")
                    .and_then(|c| c.getattr("_current_graph_task_id"))
                    .ok()
                    .map(Bound::unbind)
            });
        }
        Ok(StandIn {
            wrapped: inner,
            owner: None,
            bound: false,
            acc,
            at,
            before,
            after,
            timing,
            previous: None,
            arm: None,
        })
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        slf: &Bound<'py, Self>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        // Copied out, so that nothing is borrowed while Python runs: the
        // inner forward may be anything, and a probe thread may take this
        // stand-in off meanwhile.
        let (inner, owner, acc, at, before, after, timing, arm, model) = {
            let me = slf.borrow();
            (
                me.wrapped.clone_ref(py),
                me.bound
                    .then(|| me.owner.as_ref().map(|o| o.clone_ref(py)))
                    .flatten(),
                me.acc.as_ref().map(|a| a.clone_ref(py)),
                me.at,
                me.before.as_ref().map(|b| b.clone_ref(py)),
                me.after.as_ref().map(|a| a.clone_ref(py)),
                me.timing,
                me.arm.as_ref().map(|a| a.clone_ref(py)),
                me.owner.as_ref().map(|o| o.clone_ref(py).into_any()),
            )
        };
        if timing {
            if let Some(acc) = &acc {
                // A module called again in the step while a backward runs:
                // an activation checkpoint's recompute (torch.utils.checkpoint
                // runs the forward again inside the backward). Its time is
                // the backward's, and its output the first call's again, so
                // it is not counted, nor shown to `before` and `after`.
                // Asked only at a module's second call in a step, so that
                // the usual module pays nothing for it.
                if calls_so_far(acc.bind(py), at + 1)? > 0 && in_backward(py)? {
                    return call_inner(py, &inner, owner, args, kwargs);
                }
            }
        }
        let kept = arm
            .as_ref()
            .is_some_and(|arm| nan_arm::keep_input(arm.bind(py), model.as_ref(), args, kwargs));
        let before = if kept { None } else { before };
        if let Some(before) = before {
            // The Python stand-ins gave a dict, empty or not.
            let kwargs = kwargs.cloned().unwrap_or_else(|| PyDict::new(py));
            if timing {
                before.bind(py).call1((args, kwargs, perf_ns()))?;
            } else {
                before.bind(py).call1((args, kwargs))?;
            }
        }
        // After `before`: the module's time is its own, not the probe's.
        let start = if timing { perf_ns() } else { 0 };
        let out = call_inner(py, &inner, owner, args, kwargs)?;
        if timing {
            let spent = perf_ns() - start;
            if let Some(acc) = acc {
                let acc = acc.bind(py);
                add(acc, at, spent)?;
                add(acc, at + 1, 1)?;
            }
        }
        let after = match (&arm, after) {
            (Some(arm), Some(after)) => {
                nan_arm::output_needs_python(arm.bind(py), &out)?.then_some(after)
            }
            (_, after) => after,
        };
        if let Some(after) = after {
            after.bind(py).call1((args, &out))?;
        }
        Ok(out)
    }

    #[getter(__wrapped__)]
    fn get_wrapped<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.inner(py)
    }
    #[setter(__wrapped__)]
    fn set_wrapped(&mut self, value: Bound<'_, PyAny>) -> PyResult<()> {
        let py = value.py();
        self.wrapped = value.unbind();
        self.bound = false;
        self.bind_weakly(py)
    }
    /// The module this stands in on: from now on its bound methods are
    /// held through a weak reference to it (see the module's comment).
    #[setter]
    fn set_owner(&mut self, module: Bound<'_, PyAny>) -> PyResult<()> {
        let py = module.py();
        // A module that takes no weak reference keeps the strong one.
        self.owner = PyWeakrefReference::new(&module).ok().map(Bound::unbind);
        self.bind_weakly(py)
    }
    #[getter]
    fn get_previous(&self, py: Python<'_>) -> Py<PyAny> {
        self.previous
            .as_ref()
            .map_or_else(|| py.None(), |p| p.clone_ref(py))
    }
    #[setter]
    fn set_previous(&mut self, value: Py<PyAny>) {
        self.previous = Some(value);
    }
    /// See `replace_after_borrow`.
    #[setter]
    fn set_arm(slf: &Bound<'_, Self>, value: Option<Py<NanArm>>) -> PyResult<()> {
        nan_arm::replace_after_borrow(slf, |s| &mut s.arm, value)
    }

    /// Anything else is the inner forward's (`__self__`, `__func__`,
    /// `__name__`, ...).
    fn __getattr__<'py>(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
        self.inner(name.py())?.getattr(name)
    }

    /// A bound method copies as the same function bound to the copy.
    fn __deepcopy__<'py>(&self, memo: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = memo.py();
        py.import(intern!(py, "copy"))?
            .call_method1(intern!(py, "deepcopy"), (self.inner(py)?, memo))
    }

    fn __reduce_ex__<'py>(&self, protocol: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = protocol.py();
        self.inner(py)?
            .call_method1(intern!(py, "__reduce_ex__"), (protocol,))
    }

    fn __repr__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyString>> {
        self.inner(py)?.repr()
    }

    // What the stand-in holds strongly: an inner forward that is not its
    // module's own bound method (a compiled call, a program's wrapper) may
    // still lead back to the module, in a cycle the program had already.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.wrapped)?;
        visit.call(&self.owner)?;
        visit.call(&self.acc)?;
        visit.call(&self.before)?;
        visit.call(&self.after)?;
        visit.call(&self.previous)?;
        visit.call(&self.arm)?;
        Ok(())
    }

    fn __clear__(&mut self) {
        self.acc = None;
        self.before = None;
        self.after = None;
        self.previous = None;
        self.arm = None;
    }
}

impl StandIn {
    /// Whether this stand-in, made for a module's own `forward` (bound
    /// weakly), still stands for `forward`, the function its module's
    /// class has now: the short way puts such a stand-in on again at the
    /// next sampled step (step_clock.rs, `Lean`).
    pub(crate) fn stands_for(&self, forward: &Bound<'_, PyAny>) -> bool {
        self.holds_weakly() && self.wrapped.bind(forward.py()).is(forward)
    }

    /// It holds its module only through a weak reference (see the
    /// module's comment): its inner forward was a plain method of it.
    pub(crate) fn holds_weakly(&self) -> bool {
        self.bound && self.owner.is_some()
    }

    /// The inner forward as the program would see it: bound to its module
    /// again where only its function is held.
    fn inner<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let wrapped = self.wrapped.bind(py);
        match (&self.owner, self.bound) {
            (Some(owner), true) => {
                // What was there: a method of this function on the module
                // (whatever the function is, as types.MethodType took it).
                let module = alive(owner.bind(py))?;
                method_type(py)?.call1((wrapped, module))
            }
            _ => Ok(wrapped.clone()),
        }
    }

    /// Keeps `wrapped` as its function alone where it is a method bound to
    /// the owner (`module.forward`); anything else stays as it is.
    fn bind_weakly(&mut self, py: Python<'_>) -> PyResult<()> {
        let Some(owner) = &self.owner else {
            return Ok(());
        };
        let Some(module) = owner.bind(py).upgrade() else {
            return Ok(());
        };
        let wrapped = self.wrapped.bind(py);
        let method_type = py
            .import(intern!(py, "types"))?
            .getattr(intern!(py, "MethodType"))?;
        if !self.bound
            && wrapped.get_type().is(&method_type)
            && wrapped.getattr(intern!(py, "__self__"))?.is(&module)
        {
            self.wrapped = wrapped.getattr(intern!(py, "__func__"))?.unbind();
            self.bound = true;
        }
        Ok(())
    }
}

fn method_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    METHOD_TYPE.import(py, "types", "MethodType")
}

/// The module a stand-in belongs to, or the error a call gets once it is
/// gone (a forward the program took from the module while the stand-in was
/// on, called after the program dropped the module).
fn alive<'py>(owner: &Bound<'py, PyWeakrefReference>) -> PyResult<Bound<'py, PyAny>> {
    owner.upgrade().ok_or_else(|| {
        PyReferenceError::new_err("the module this forward belongs to no longer exists")
    })
}

/// The inner forward, called with the module first where it is held as
/// its function (see the module's comment).
fn call_inner<'py>(
    py: Python<'py>,
    inner: &Py<PyAny>,
    owner: Option<Py<PyWeakrefReference>>,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    match owner {
        None => inner.bind(py).call(args, kwargs),
        Some(owner) => {
            let module = alive(owner.bind(py))?;
            let mut all = Vec::with_capacity(args.len() + 1);
            all.push(module);
            all.extend(args.iter());
            let with_self = PyTuple::new(py, all)?;
            inner.bind(py).call(with_self, kwargs)
        }
    }
}

fn calls_so_far(acc: &Bound<'_, PyList>, at: usize) -> PyResult<i64> {
    acc.get_item(at)?.extract()
}

/// Whether autograd's engine is running a backward on this thread.
fn in_backward(py: Python<'_>) -> PyResult<bool> {
    match GRAPH_TASK_ID.get(py) {
        Some(Some(task_id)) => Ok(task_id.bind(py).call0()?.extract::<i64>()? != -1),
        _ => Ok(false),
    }
}

fn add(acc: &Bound<'_, PyList>, at: usize, value: i64) -> PyResult<()> {
    let now: i64 = acc.get_item(at)?.extract()?;
    acc.set_item(at, now + value)
}
