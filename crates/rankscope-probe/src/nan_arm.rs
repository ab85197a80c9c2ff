//! The NaN watch's work at every step, native: what the model's root
//! stand-in keeps of the step (its input), and the check of the sentinel
//! gradients at the optimizer's pre-hook (nan.py says what both are for).
//!
//! In Python these were four calls a step into the watch's code (the root
//! stand-in's `before` and `after`, `optimizer_pre`, `boundary`), each a
//! frame or two, cold after the step's kernels: most of what the armed
//! watch cost a small MLP (docs/performance.md, "The NaN watch's step
//! made native"). Here the stand-in stores the step's input into a
//! `NanStep` it shares with the watch, the step clock's pre-hook reads the
//! sentinels in place (finite.rs) and lets the step go, and the watch's
//! Python hears of a step only where it has something to do: every
//! `full_every`-th step (all the gradients), a trip, a GPU's check
//! waiting (`slow`), a random forward (the RNG state is Python's to
//! copy), a loss to find in the output, new models, `rankscope.step()`.
//!
//! No borrow of either class is held across a call into Python, and what
//! a step lets go of (the last input) is released after the borrow: its
//! finalizers may run the program's code, which may come back here.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::PyTraverseError;

use crate::finite::FiniteCheck;

/// What the watch keeps of the step in progress (nan.py's `_Step`): the
/// model (a weakref), its input, the RNG states at its start, the loss,
/// the model's output (a weakref, while a loss module is watched) and the
/// loss module's call on it.
#[pyclass(module = "rankscope._native")]
#[derive(Default)]
pub struct NanStep {
    #[pyo3(get, set)]
    model: Option<Py<PyAny>>,
    #[pyo3(get, set)]
    args: Option<Py<PyAny>>,
    #[pyo3(get, set)]
    kwargs: Option<Py<PyAny>>,
    #[pyo3(get, set)]
    rng: Option<Py<PyAny>>,
    #[pyo3(get, set)]
    cuda_rng: Option<Py<PyAny>>,
    #[pyo3(get, set)]
    loss: Option<Py<PyAny>>,
    #[pyo3(get, set)]
    output: Option<Py<PyAny>>,
    #[pyo3(get, set)]
    loss_call: Option<Py<PyAny>>,
}

/// What a `NanStep` let go of, to be released once no borrow is held.
type Released = [Option<Py<PyAny>>; 7];

impl NanStep {
    /// Everything but the model, taken out.
    fn take_all(&mut self) -> Released {
        [
            self.args.take(),
            self.kwargs.take(),
            self.rng.take(),
            self.cuda_rng.take(),
            self.loss.take(),
            self.output.take(),
            self.loss_call.take(),
        ]
    }
}

#[pymethods]
impl NanStep {
    #[new]
    fn new() -> Self {
        NanStep::default()
    }

    /// Lets go of the step's input and loss (the model's weakref stays).
    fn clear(slf: &Bound<'_, Self>) {
        let released = slf.borrow_mut().take_all();
        drop(released);
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for field in [
            &self.model,
            &self.args,
            &self.kwargs,
            &self.rng,
            &self.cuda_rng,
            &self.loss,
            &self.output,
            &self.loss_call,
        ] {
            visit.call(field)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        let _ = self.take_all();
        self.model = None;
    }
}

/// `NanArm(finite_check, tensor_type, full_every)`: the armed watch's state
/// that the root stand-ins and the step clock read (nan.py's `NanWatch`
/// keeps it as its own attributes, through properties).
#[pyclass(module = "rankscope._native")]
pub struct NanArm {
    step: Py<NanStep>,
    #[pyo3(get, set)]
    armed: bool,
    /// The watch's replay runs: its stand-ins keep nothing.
    #[pyo3(get, set)]
    searching: bool,
    /// A GPU's check waits for its values: each step gets a new `NanStep`,
    /// which the watch's Python makes.
    #[pyo3(get, set)]
    slow: bool,
    /// A loss module has a stand-in: the root's output is kept for it.
    #[pyo3(get, set)]
    loss_modules: bool,
    #[pyo3(get, set)]
    checked_steps: i64,
    full_every: i64,
    /// (a weakref to the optimizer, the list of its sentinel parameters).
    #[pyo3(get, set)]
    sentinel_params: Option<Py<PyAny>>,
    /// The Tracer's `models` when the watch last hooked their roots.
    #[pyo3(get, set)]
    models_seen: Option<Py<PyAny>>,
    finite: Py<FiniteCheck>,
    tensor: Py<PyType>,
}

#[pymethods]
impl NanArm {
    #[new]
    fn new(
        py: Python<'_>,
        finite: Py<FiniteCheck>,
        tensor: Py<PyType>,
        full_every: i64,
    ) -> PyResult<Self> {
        Ok(NanArm {
            step: Py::new(py, NanStep::default())?,
            armed: false,
            searching: false,
            slow: false,
            loss_modules: false,
            checked_steps: 0,
            full_every: full_every.max(1),
            sentinel_params: None,
            models_seen: None,
            finite,
            tensor,
        })
    }

    #[getter]
    fn get_step(&self, py: Python<'_>) -> Py<NanStep> {
        self.step.clone_ref(py)
    }
    #[setter]
    fn set_step(slf: &Bound<'_, Self>, step: Py<NanStep>) {
        let old = std::mem::replace(&mut slf.borrow_mut().step, step);
        drop(old);
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.step)?;
        visit.call(&self.sentinel_params)?;
        visit.call(&self.models_seen)?;
        visit.call(&self.finite)?;
        visit.call(&self.tensor)?;
        Ok(())
    }

    fn __clear__(&mut self) {
        self.sentinel_params = None;
        self.models_seen = None;
    }
}

/// The root stand-in's part before the call: the step's input kept, as
/// nan.py's `_root_pre` keeps it for a model that draws no random numbers.
/// False where the watch's Python must do it (searching, or `slow`).
pub(crate) fn keep_input(
    arm: &Bound<'_, NanArm>,
    model: Option<&Py<PyAny>>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> bool {
    let py = arm.py();
    let step = {
        let arm = arm.borrow();
        if arm.searching || arm.slow {
            return false;
        }
        arm.step.clone_ref(py)
    };
    let released = {
        let mut step = step.bind(py).borrow_mut();
        let released = step.take_all();
        step.model = model.map(|m| m.clone_ref(py));
        step.args = Some(args.clone().into_any().unbind());
        // None for no keywords (nan.py reads `kwargs or {}`): no new dict
        // made at every step.
        step.kwargs = kwargs.map(|k| k.clone().into_any().unbind());
        released
    };
    drop(released);
    true
}

/// Whether the root's `output` needs the watch's Python after the call:
/// not for a plain tensor that is not a scalar (no loss in it) while no
/// loss module waits for it, the usual model's logits.
/// (Anything that raises here is the Python's to look at, and catch.)
pub(crate) fn output_needs_python(arm: &Bound<'_, NanArm>, output: &Bound<'_, PyAny>) -> bool {
    let py = arm.py();
    let (loss_modules, tensor) = {
        let arm = arm.borrow();
        (arm.loss_modules, arm.tensor.clone_ref(py))
    };
    if loss_modules || !output.get_type().is(tensor.bind(py)) {
        return true;
    }
    match output
        .call_method0(pyo3::intern!(py, "dim"))
        .and_then(|d| d.extract::<usize>())
    {
        Ok(dims) => dims == 0,
        Err(_) => true,
    }
}

/// The check at the optimizer's pre-hook, where nothing but the sentinel
/// gradients (and a CPU loss) is to be read: true when they are all
/// finite and read in place. The step's input is then let go of where
/// `primary` (this optimizer marks steps) says so. False leaves the step
/// to the watch's Python: a full check, a trip, a tensor this cannot read,
/// an optimizer it has no sentinels for yet.
pub(crate) fn check_sentinels(
    arm: &Bound<'_, NanArm>,
    optimizer: &Bound<'_, PyAny>,
    primary: bool,
) -> PyResult<bool> {
    let py = arm.py();
    let (cached, step, finite) = {
        let arm = arm.borrow();
        if !arm.armed || arm.slow || arm.searching || arm.checked_steps % arm.full_every == 0 {
            return Ok(false);
        }
        let Some(cached) = &arm.sentinel_params else {
            return Ok(false);
        };
        (
            cached.clone_ref(py),
            arm.step.clone_ref(py),
            arm.finite.clone_ref(py),
        )
    };
    let cached = cached.bind(py).cast::<PyTuple>()?.clone();
    if !cached.get_item(0)?.call0()?.is(optimizer) {
        return Ok(false);
    }
    let loss = step
        .bind(py)
        .borrow()
        .loss
        .as_ref()
        .map_or_else(|| py.None().into_bound(py), |l| l.bind(py).clone());
    let params = cached.get_item(1)?;
    if finite.get().check_grads(&params, &loss)? != Some(true) {
        return Ok(false);
    }
    let released = {
        let mut arm = arm.borrow_mut();
        arm.checked_steps += 1;
        primary.then(|| step.bind(py).borrow_mut().take_all())
    };
    drop(released);
    Ok(true)
}

/// The boundary's part, where the watch's Python has nothing to do (no
/// GPU check waiting, the same models, an optimizer marking steps): the
/// step's input let go of. False: the Python's `boundary` runs.
pub(crate) fn quiet_boundary(arm: &Bound<'_, NanArm>, models: &Bound<'_, PyAny>) -> bool {
    let py = arm.py();
    let step = {
        let arm = arm.borrow();
        if !arm.armed
            || arm.slow
            || !arm
                .models_seen
                .as_ref()
                .is_some_and(|m| m.bind(py).is(models))
        {
            return false;
        }
        arm.step.clone_ref(py)
    };
    let released = step.bind(py).borrow_mut().take_all();
    drop(released);
    true
}
