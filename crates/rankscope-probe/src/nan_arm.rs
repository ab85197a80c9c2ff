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
//! Python hears of a step only where it has something to do (every
//! `full_every`-th step's check of all the gradients is made here too): a
//! trip, a GPU's check, a
//! random forward (the RNG state is Python's to
//! copy), a loss to find in the output, new models, `rankscope.step()`,
//! a second forward with grad in a step (accumulation, or a step a
//! GradScaler skipped: nan.py's `_repeated`).
//!
//! No borrow of either class is held across a call into Python, and what
//! a step lets go of (the last input) is released after the borrow: its
//! finalizers may run the program's code, which may come back here.

use pyo3::exceptions::{PyAttributeError, PyException};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType, PyWeakrefReference};
use pyo3::PyTraverseError;
use std::collections::HashMap;

use crate::finite::FiniteCheck;

/// What the watch keeps of the step in progress (nan.py's `_Step`): the
/// model (a weakref), its input, the RNG states at its start, the loss,
/// the model's output (a weakref, while a loss module is watched) and the
/// loss module's call on it, and the GradScaler's per-optimizer states
/// when the step began (see `keep_input`), as attributes of those names.
///
/// Set from Python through `__setattr__`, which lets go of the old value
/// after the borrow (a generated setter drops it inside, and a finalizer it
/// runs could let another thread reach this step while it is borrowed).
#[pyclass(module = "rankscope._native")]
#[derive(Default)]
pub struct NanStep {
    fields: [Option<Py<PyAny>>; 11],
}

const FIELDS: [&str; 11] = [
    "model",
    "args",
    "kwargs",
    "rng",
    "cuda_rng",
    "loss",
    "output",
    "loss_call",
    "autocast",
    "scaler_states",
    // The step's earlier micro-batches under gradient accumulation (nan.py).
    "earlier",
];
const MODEL: usize = 0;
const ARGS: usize = 1;
const KWARGS: usize = 2;
const LOSS: usize = 5;
const AUTOCAST: usize = 8;
const SCALER_STATES: usize = 9;

/// What a `NanStep` let go of, to be released once no borrow is held.
type Released = [Option<Py<PyAny>>; 11];

impl NanStep {
    /// Everything but the model, taken out.
    fn take_all(&mut self) -> Released {
        let mut out: Released = Default::default();
        for (slot, field) in out.iter_mut().zip(&mut self.fields).skip(1) {
            *slot = field.take();
        }
        out
    }
}

/// Sets `slf`'s field (as `field` picks it) to `value`, and lets go of the
/// old value only once the borrow is over: dropping it may run a finalizer,
/// which may let another thread reach `slf`. Used by every setter here, on
/// the stand-in and on the step clock for what may hold the program's
/// objects.
pub(crate) fn replace_after_borrow<T, V>(
    slf: &Bound<'_, T>,
    field: impl FnOnce(&mut T) -> &mut V,
    value: V,
) -> PyResult<()>
where
    T: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::False>,
{
    let old = std::mem::replace(field(&mut *slf.try_borrow_mut()?), value);
    drop(old);
    Ok(())
}

fn field_index(name: &str) -> PyResult<usize> {
    FIELDS
        .iter()
        .position(|f| *f == name)
        .ok_or_else(|| PyAttributeError::new_err(format!("NanStep has no attribute {name:?}")))
}

#[pymethods]
impl NanStep {
    #[new]
    fn new() -> Self {
        NanStep::default()
    }

    fn __getattr__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let at = field_index(name)?;
        Ok(self.fields[at]
            .as_ref()
            .map_or_else(|| py.None(), |v| v.clone_ref(py)))
    }

    fn __setattr__(slf: &Bound<'_, Self>, name: &str, value: Bound<'_, PyAny>) -> PyResult<()> {
        let at = field_index(name)?;
        let value = (!value.is_none()).then(|| value.unbind());
        replace_after_borrow(slf, |s| &mut s.fields[at], value)
    }

    /// Lets go of the step's input and loss (the model's weakref stays).
    fn clear(slf: &Bound<'_, Self>) -> PyResult<()> {
        let released = slf.try_borrow_mut()?.take_all();
        drop(released);
        Ok(())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for field in &self.fields {
            visit.call(field)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.fields = Default::default();
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
    /// A loss module has a stand-in: the root's output is kept for it.
    #[pyo3(get, set)]
    loss_modules: bool,
    /// Checks made: the full check's cadence counts each optimizer's.
    #[pyo3(get, set)]
    checked_steps: i64,
    /// Steps checked, as `torch nan` says: a step whose two optimizers
    /// (a GAN's) were each checked counts once.
    #[pyo3(get)]
    steps_seen: i64,
    last_seen: Option<i64>,
    full_every: i64,
    /// (a weakref to the optimizer, the list of its sentinel parameters).
    sentinel_params: Option<Py<PyAny>>,
    /// The Tracer's `models` when the watch last hooked their roots.
    models_seen: Option<Py<PyAny>>,
    /// nan.py's `sentinels_of` (the watch clears it, never replaces it):
    /// id(optimizer or root model) -> (a weak reference to it, its
    /// sentinel parameters), for `nothing_new`.
    sentinels_of: Option<Py<PyDict>>,
    finite: Py<FiniteCheck>,
    tensor: Py<PyType>,
    /// `torch.is_grad_enabled`: a root call without grad (a metric on the
    /// side, an eval pass) keeps nothing, since no gradient comes of it.
    grad_enabled: Py<PyAny>,
    /// `torch._C._is_any_autocast_enabled` (None on a torch without it),
    /// and nan.py's `_autocast_now`: the autocast contexts the root call
    /// ran under, for the replay to run under them too (float32 would not
    /// overflow where float16 did).
    any_autocast: Option<Py<PyAny>>,
    autocast_now: Py<PyAny>,
    /// A weak reference to the program's GradScaler, once nan.py has found
    /// one: each step keeps the dict of per-optimizer states its `update()`
    /// replaces, so that a second forward with no optimizer step between
    /// tells a step the scaler skipped from gradient accumulation.
    scaler: Option<Py<PyAny>>,
    /// The sentinels' gradients as the last optimizer check saw them:
    /// parameter's address -> (a weak reference to its gradient, the
    /// gradient's version). A `zero_grad` that finds another (nan.py,
    /// `_before_zero_grad`) clears gradients that no optimizer step used:
    /// a step the program skipped itself.
    applied: HashMap<usize, Seen>,
}

/// A sentinel's gradient as a check saw it (None: it had none).
type Seen = Option<(Py<PyWeakrefReference>, i64)>;

/// At most this many sentinels remembered (one a model): a program that
/// makes models without end does not grow the map.
const MAX_APPLIED: usize = 256;

/// Each parameter's gradient as it is now, with its version.
#[allow(clippy::type_complexity)]
fn grads_now<'py>(
    params: &Bound<'py, PyAny>,
) -> PyResult<Vec<(usize, Option<(Bound<'py, PyAny>, i64)>)>> {
    let py = params.py();
    let mut out = Vec::new();
    for param in params.try_iter()? {
        let param = param?;
        let grad = param.getattr(pyo3::intern!(py, "grad"))?;
        let seen = if grad.is_none() {
            None
        } else {
            let version: i64 = grad.getattr(pyo3::intern!(py, "_version"))?.extract()?;
            Some((grad, version))
        };
        out.push((param.as_ptr() as usize, seen));
    }
    Ok(out)
}

/// Remembers what a check saw of these parameters' gradients (what the
/// step about to run applies).
pub(crate) fn note_applied(arm: &Bound<'_, NanArm>, params: &Bound<'_, PyAny>) -> PyResult<()> {
    let mut seen = Vec::new();
    for (at, now) in grads_now(params)? {
        let now = match now {
            Some((grad, version)) => Some((PyWeakrefReference::new(&grad)?.unbind(), version)),
            None => None,
        };
        seen.push((at, now));
    }
    let mut replaced = Vec::new();
    {
        let mut held = arm.try_borrow_mut()?;
        if held.applied.len() + seen.len() > MAX_APPLIED {
            replaced.extend(held.applied.drain().map(|(_, v)| v));
        }
        for (at, now) in seen {
            replaced.push(held.applied.insert(at, now).flatten());
        }
    }
    // Weak references let go of after the borrow, as everything here.
    drop(replaced);
    Ok(())
}

/// After an optimizer's step: its sentinels' gradients noted again, as the
/// step left them. Only for the optimizer whose sentinels are cached (the
/// one that marks steps, usually); nothing here may fail the step.
pub(crate) fn note_stepped(arm: &Bound<'_, NanArm>, optimizer: &Bound<'_, PyAny>) {
    let py = arm.py();
    let cached = match arm.try_borrow() {
        Ok(held) if held.armed && !held.searching => {
            held.sentinel_params.as_ref().map(|c| c.clone_ref(py))
        }
        _ => None,
    };
    let Some(cached) = cached else {
        return;
    };
    let Ok(cached) = cached.bind(py).cast::<PyTuple>().cloned() else {
        return;
    };
    let mine = cached
        .get_item(0)
        .and_then(|weak| weak.call0())
        .is_ok_and(|o| o.is(optimizer));
    if mine {
        if let Ok(params) = cached.get_item(1) {
            let _ = note_applied(arm, &params);
        }
    }
}

/// `NanArm.unapplied`.
fn unapplied(slf: &Bound<'_, NanArm>, params: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = slf.py();
    let now = grads_now(params)?;
    let held = slf.try_borrow()?;
    for (at, seen) in &now {
        let Some((grad, version)) = seen else {
            continue;
        };
        let fresh = match held.applied.get(at) {
            None => held.checked_steps == 0,
            Some(None) => true,
            Some(Some((before, before_version))) => {
                !(before_version == version
                    && before.bind(py).upgrade().is_some_and(|g| g.is(grad)))
            }
        };
        if fresh {
            return Ok(true);
        }
    }
    Ok(false)
}

#[pymethods]
impl NanArm {
    #[new]
    fn new(
        py: Python<'_>,
        finite: Py<FiniteCheck>,
        tensor: Py<PyType>,
        full_every: i64,
        grad_enabled: Py<PyAny>,
        any_autocast: Option<Py<PyAny>>,
        autocast_now: Py<PyAny>,
    ) -> PyResult<Self> {
        Ok(NanArm {
            step: Py::new(py, NanStep::default())?,
            armed: false,
            searching: false,
            loss_modules: false,
            checked_steps: 0,
            steps_seen: 0,
            last_seen: None,
            full_every: full_every.max(1),
            sentinel_params: None,
            models_seen: None,
            sentinels_of: None,
            finite,
            tensor,
            grad_enabled,
            any_autocast,
            autocast_now,
            scaler: None,
            applied: HashMap::new(),
        })
    }

    /// What a check saw of these parameters' gradients (see `applied`).
    fn noted(slf: &Bound<'_, Self>, params: &Bound<'_, PyAny>) -> PyResult<()> {
        note_applied(slf, params)
    }

    /// Whether one of these parameters has a gradient that no optimizer
    /// check saw: made by a backward since the last optimizer step. A
    /// parameter never checked counts only before any check was made (a
    /// program that skipped every step so far); after that it is none of
    /// the watch's sentinels.
    fn unapplied(slf: &Bound<'_, Self>, params: &Bound<'_, PyAny>) -> PyResult<bool> {
        unapplied(slf, params)
    }

    /// nan.py's `nothing_new`: whether a zero_grad of `owner` clears only
    /// gradients the last check saw (or the watch is off), so that the
    /// step clock's zero_grad stand-in takes its inline way. Here, not in
    /// Python, because it is asked at every step.
    fn nothing_new(slf: &Bound<'_, Self>, owner: &Bound<'_, PyAny>) -> PyResult<bool> {
        let py = slf.py();
        let of = {
            let held = slf.try_borrow()?;
            if !held.armed {
                return Ok(true);
            }
            match &held.sentinels_of {
                Some(of) => of.clone_ref(py),
                None => return Ok(false),
            }
        };
        let Some(known) = of.bind(py).get_item(owner.as_ptr() as usize)? else {
            return Ok(false);
        };
        if !known.get_item(0)?.call0()?.is(owner) {
            return Ok(false);
        }
        let mine = known.get_item(1)?;
        Ok(!mine.is_truthy()? || !unapplied(slf, &mine)?)
    }

    /// One check made, of step `step`.
    fn counted(&mut self, step: i64) {
        self.count(step);
    }

    // The setters of what may hold the program's objects: see
    // `replace_after_borrow`.
    #[getter]
    fn get_step(&self, py: Python<'_>) -> Py<NanStep> {
        self.step.clone_ref(py)
    }
    #[setter]
    fn set_step(slf: &Bound<'_, Self>, step: Py<NanStep>) -> PyResult<()> {
        replace_after_borrow(slf, |a| &mut a.step, step)
    }
    #[getter]
    fn get_sentinel_params(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.sentinel_params.as_ref().map(|v| v.clone_ref(py))
    }
    #[setter]
    fn set_sentinel_params(slf: &Bound<'_, Self>, value: Option<Py<PyAny>>) -> PyResult<()> {
        replace_after_borrow(slf, |a| &mut a.sentinel_params, value)
    }
    #[getter]
    fn get_scaler(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.scaler.as_ref().map(|v| v.clone_ref(py))
    }
    #[setter]
    fn set_scaler(slf: &Bound<'_, Self>, value: Option<Py<PyAny>>) -> PyResult<()> {
        replace_after_borrow(slf, |a| &mut a.scaler, value)
    }
    #[getter]
    fn get_sentinels_of(&self, py: Python<'_>) -> Option<Py<PyDict>> {
        self.sentinels_of.as_ref().map(|v| v.clone_ref(py))
    }
    #[setter]
    fn set_sentinels_of(slf: &Bound<'_, Self>, value: Option<Py<PyDict>>) -> PyResult<()> {
        replace_after_borrow(slf, |a| &mut a.sentinels_of, value)
    }
    #[getter]
    fn get_models_seen(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.models_seen.as_ref().map(|v| v.clone_ref(py))
    }
    #[setter]
    fn set_models_seen(slf: &Bound<'_, Self>, value: Option<Py<PyAny>>) -> PyResult<()> {
        replace_after_borrow(slf, |a| &mut a.models_seen, value)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.step)?;
        visit.call(&self.sentinel_params)?;
        visit.call(&self.models_seen)?;
        visit.call(&self.sentinels_of)?;
        visit.call(&self.finite)?;
        visit.call(&self.tensor)?;
        visit.call(&self.grad_enabled)?;
        visit.call(&self.any_autocast)?;
        visit.call(&self.autocast_now)?;
        visit.call(&self.scaler)?;
        for (weak, _) in self.applied.values().flatten() {
            visit.call(weak)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.sentinel_params = None;
        self.models_seen = None;
        self.sentinels_of = None;
        self.scaler = None;
        self.applied.clear();
    }
}

/// The root stand-in's part before the call: the step's input kept, as
/// nan.py's `_root_pre` keeps it for a model that draws no random numbers
/// (nothing kept once the watch is off). False where the watch's Python
/// must do it (searching).
pub(crate) fn keep_input(
    arm: &Bound<'_, NanArm>,
    model: Option<&Py<PyAny>>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> bool {
    let py = arm.py();
    // A borrow held elsewhere (nothing of this module's holds one across
    // Python code, but a finalizer may run anywhere): the Python's turn.
    let (step, grad_enabled, any_autocast, autocast_now, scaler) = {
        let Ok(arm) = arm.try_borrow() else {
            return false;
        };
        if !arm.armed {
            // A stand-in left on after `nan off` (the program had wrapped
            // it): it keeps nothing, and calls nothing.
            return true;
        }
        if arm.searching {
            return false;
        }
        (
            arm.step.clone_ref(py),
            arm.grad_enabled.clone_ref(py),
            arm.any_autocast.as_ref().map(|f| f.clone_ref(py)),
            arm.autocast_now.clone_ref(py),
            arm.scaler.as_ref().map(|s| s.clone_ref(py)),
        )
    };
    match grad_enabled.bind(py).call0().and_then(|on| on.is_truthy()) {
        // The step's input stays the one its loss came from: a model
        // called again without grad in the same step (a metric on clean
        // data) would have the search replay the wrong input.
        Ok(false) => return true,
        Ok(true) => {}
        Err(_) => return false,
    }
    // An input kept already, with no optimizer step since: a second
    // forward in the step (gradient accumulation, a GAN's discriminator on
    // real and fake), or a step a GradScaler skipped. The watch's Python
    // tells them apart (nan.py, `_repeated`).
    match step.bind(py).try_borrow() {
        Ok(held) if held.fields[ARGS].is_none() => {}
        _ => return false,
    }
    let scaler_states = match &scaler {
        None => None,
        Some(weak) => match weak.bind(py).call0() {
            Ok(scaler) if scaler.is_none() => None,
            Ok(scaler) => match scaler.getattr(pyo3::intern!(py, "_per_optimizer_states")) {
                Ok(states) => Some(states.unbind()),
                Err(_) => return false,
            },
            Err(_) => return false,
        },
    };
    let on = match &any_autocast {
        Some(any) => any.bind(py).call0().and_then(|on| on.is_truthy()),
        None => Ok(true),
    };
    let autocast = match on {
        Ok(false) => None,
        Ok(true) => match autocast_now.bind(py).call0() {
            Ok(state) => (!state.is_none()).then(|| state.unbind()),
            Err(_) => return false,
        },
        Err(_) => return false,
    };
    let released = {
        let Ok(mut step) = step.bind(py).try_borrow_mut() else {
            return false;
        };
        let released = step.take_all();
        let fields = &mut step.fields;
        fields[MODEL] = model.map(|m| m.clone_ref(py));
        fields[ARGS] = Some(args.clone().into_any().unbind());
        // None for no keywords (nan.py reads `kwargs or {}`): no new dict
        // made at every step.
        fields[KWARGS] = kwargs.map(|k| k.clone().into_any().unbind());
        fields[AUTOCAST] = autocast;
        fields[SCALER_STATES] = scaler_states;
        released
    };
    drop(released);
    true
}

/// Whether the root's `output` needs the watch's Python after the call:
/// not for a plain tensor that is not a scalar (no loss in it) while no
/// loss module waits for it, the usual model's logits.
/// An `Exception` from torch here is the Python's to look at (and catch);
/// anything else (a KeyboardInterrupt) goes on, as through the Python.
pub(crate) fn output_needs_python(
    arm: &Bound<'_, NanArm>,
    output: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let py = arm.py();
    let Ok((armed, loss_modules, tensor, grad_enabled)) = arm.try_borrow().map(|arm| {
        (
            arm.armed,
            arm.loss_modules,
            arm.tensor.clone_ref(py),
            arm.grad_enabled.clone_ref(py),
        )
    }) else {
        return Ok(true);
    };
    if !armed {
        return Ok(false);
    }
    // Without grad, `keep_input` kept nothing, and the output is no loss.
    if !grad_enabled.bind(py).call0()?.is_truthy()? {
        return Ok(false);
    }
    if loss_modules || !output.get_type().is(tensor.bind(py)) {
        return Ok(true);
    }
    match output
        .call_method0(pyo3::intern!(py, "dim"))
        .and_then(|d| d.extract::<usize>())
    {
        Ok(dims) => Ok(dims == 0),
        Err(err) if err.is_instance_of::<PyException>(py) => Ok(true),
        Err(err) => Err(err),
    }
}

impl NanArm {
    fn count(&mut self, step: i64) {
        self.checked_steps += 1;
        if self.last_seen != Some(step) {
            self.last_seen = Some(step);
            self.steps_seen += 1;
        }
    }
}

/// The check at the optimizer's pre-hook: the sentinel gradients (and a
/// CPU loss), or every gradient of the optimizer's at a full check's step
/// (nan.py's `FULL_EVERY`): true when they are all finite and read in
/// place. The step's input is then let go of where
/// `primary` (asked only then) says this optimizer marks steps. False leaves the step
/// to the watch's Python: a trip, a tensor this cannot read,
/// an optimizer it has no sentinels for yet.
pub(crate) fn check_sentinels(
    arm: &Bound<'_, NanArm>,
    optimizer: &Bound<'_, PyAny>,
    step_number: i64,
    primary: impl FnOnce() -> PyResult<bool>,
) -> PyResult<bool> {
    let py = arm.py();
    let (cached, step, finite, full) = {
        let Ok(arm) = arm.try_borrow() else {
            return Ok(false);
        };
        if !arm.armed || arm.searching {
            return Ok(false);
        }
        let Some(cached) = &arm.sentinel_params else {
            return Ok(false);
        };
        (
            cached.clone_ref(py),
            arm.step.clone_ref(py),
            arm.finite.clone_ref(py),
            arm.checked_steps % arm.full_every == 0,
        )
    };
    let cached = cached.bind(py).cast::<PyTuple>()?.clone();
    if !cached.get_item(0)?.call0()?.is(optimizer) {
        return Ok(false);
    }
    let Ok(loss) = step.bind(py).try_borrow().map(|s| {
        s.fields[LOSS]
            .as_ref()
            .map_or_else(|| py.None().into_bound(py), |l| l.bind(py).clone())
    }) else {
        return Ok(false);
    };
    let params = cached.get_item(1)?;
    let checked = if full {
        finite.get().check_optimizer(optimizer, &loss)?
    } else {
        finite.get().check_grads(&params, &loss)?
    };
    if checked != Some(true) {
        return Ok(false);
    }
    let Ok(mut held) = arm.try_borrow_mut() else {
        return Ok(false);
    };
    held.count(step_number);
    drop(held);
    // What the check saw is noted once, after the step (`note_stepped`): a
    // step that raises before its post-hook applied nothing, and the next
    // zero_grad takes the watch's longer way for it (nan.py,
    // `_before_zero_grad`), which finds this step's input already let go.
    // Where the step's own clear cannot take its borrow, the boundary's
    // does it.
    let released = if primary()? {
        step.bind(py)
            .try_borrow_mut()
            .ok()
            .map(|mut s| s.take_all())
    } else {
        None
    };
    drop(released);
    Ok(true)
}

/// The boundary's part, where the watch's Python has nothing to do (the
/// same models, an optimizer marking steps): the
/// step's input let go of. False: the Python's `boundary` runs.
pub(crate) fn quiet_boundary(arm: &Bound<'_, NanArm>, models: &Bound<'_, PyAny>) -> bool {
    let py = arm.py();
    let step = {
        let Ok(arm) = arm.try_borrow() else {
            return false;
        };
        if !arm.armed
            || !arm
                .models_seen
                .as_ref()
                .is_some_and(|m| m.bind(py).is(models))
        {
            return false;
        }
        arm.step.clone_ref(py)
    };
    let Ok(released) = step.bind(py).try_borrow_mut().map(|mut s| s.take_all()) else {
        return false;
    };
    drop(released);
    true
}
