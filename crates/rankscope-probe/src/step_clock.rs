//! The torch step clock's state and its hooks on the training thread:
//! torch's global optimizer pre and post hooks, the short way through a
//! step boundary, and the calls to the features that listen for steps.
//!
//! They run at every optimizer step for as long as any torch feature is on,
//! so their cost is paid by every step, sampled or not. `StepClock` is the
//! base class of trace.py's `Tracer`: the clock's state is in its fields
//! here, read by the hooks without a dictionary lookup, and by the Tracer's
//! Python (its long way through a boundary: a sampled step, a setting
//! changed, models found again) as attributes. A first version kept the
//! state in the Tracer's `__dict__` and read it from here by name: that
//! cost more than the Python hooks (CPython 3.11 specialises an attribute
//! read in bytecode to an indexed load; a read through the C API hashes
//! and looks up the name every time). Warm, these hooks cost 0.2-0.4 us a
//! step against 0.7 us in Python; in the training loop the two measure
//! the same within its noise (docs/performance.md, "The step clock and the
//! stand-ins made native").
//!
//! Nothing may reach the program: an `Exception` turns the clock off with
//! its reason (`Tracer._fail`), or takes one listener off
//! (`Tracer._listener_failed`). A `BaseException` that is not an
//! `Exception` (KeyboardInterrupt from the program's own signal handler)
//! goes on to the program, as it would through a Python hook.

use std::sync::{Arc, OnceLock};

use pyo3::exceptions::{PyException, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyWeakrefReference};

use rankscope_store::Cell;

use crate::nan_arm::{self, NanArm};
use crate::stand_in::StandIn;

/// The events listeners hear of, in trace.py's EVENTS order.
const EVENTS: [&str; 3] = ["optimizer_pre", "optimizer_post", "boundary"];
const PRE: usize = 0;
const POST: usize = 1;
const BOUNDARY: usize = 2;

/// The marker a program's `rankscope.step()` sets: from then on only it
/// marks steps (the other marker is "optimizer").
const MARKER_CALL: &str = "rankscope.step()";

/// `time.perf_counter_ns()`: the same clock, so that the Python side's
/// readings and these subtract.
pub(crate) fn perf_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// `time.time()`.
fn wall_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What the short way calls into Python, given once (`StepClock.wire`).
struct Wired {
    /// trace.py's `tables` module: `due` and `flush()`, for the rows its
    /// outbox holds (gradient and activation statistics).
    tables: Py<PyAny>,
    /// `memory.step_row(now_ns)`: the timeline's CUDA row as the step is told.
    step_row: Py<PyAny>,
    step_told_ns: i64,
}

/// The stand-ins of a plan whose every stand-in sits on its module's own
/// `forward` with nothing under it, and whose sampled steps need no more
/// than the stand-ins' times, a CPU loss and the step's row: the trace's
/// usual case. `Tracer._attach` hands them over once it has put them on;
/// from then on the short way puts the same stand-ins on at the boundary
/// before each sampled step, makes the sampled step's rows and takes them
/// off again, where the long way's Python, cold after nineteen steps of
/// kernels, took about 65 us at each of those two boundaries on a small
/// MLP (docs/performance.md, "Sampled steps by the short way"). Anything
/// not as it was left (a module gone, an attribute of the program's on
/// `forward`, a class whose `forward` changed, a loss on a GPU) sends the
/// boundary the long way, which makes its stand-ins anew.
struct Lean {
    /// The Tracer's `plan` these were made for: a new plan is a new list.
    plan: Py<PyAny>,
    /// The Tracer's `handles` (timed.take_off's entries, in `entries`'
    /// order) while these are on.
    handles: Py<PyList>,
    /// What the Tracer's `handles` is while they are off: one empty list,
    /// made beforehand (see `boundary_at` on what its window may not do).
    none_on: Py<PyList>,
    entries: Vec<(Py<PyWeakrefReference>, Py<StandIn>)>,
    /// The stand-ins' counters, and as many zeros.
    acc: Py<PyList>,
    zeros: Py<PyList>,
    /// The counters of the models' roots: the step's forward time.
    roots: Vec<usize>,
    /// The store's plan for the step's trace rows (`_native.trace_plan`).
    plan_id: i64,
}

/// What `StepClock.lean_set` is given, in that order.
type LeanGiven = (
    Py<PyAny>,
    Py<PyList>,
    Vec<(Py<PyWeakrefReference>, Py<StandIn>)>,
    Py<PyList>,
    Py<PyList>,
    Vec<usize>,
    i64,
);

/// The clock's state, read and written by the Tracer's Python as
/// attributes. A borrow of it is never held across a call into Python,
/// which may come back here (a listener that fails turns a feature off).
#[pyclass(module = "rankscope._native", subclass)]
pub struct StepClock {
    /// The clock runs (some feature needs steps).
    #[pyo3(get, set)]
    on: bool,
    /// The next boundary may take the short way (set by the long way).
    #[pyo3(get, set)]
    quiet: bool,
    /// The trace is on, sampling every `every` steps.
    #[pyo3(get, set)]
    tracing: bool,
    #[pyo3(get, set)]
    every: i64,
    /// The step in progress; the last boundary's time; when the step was
    /// last told to the memory timeline (perf_counter_ns).
    #[pyo3(get, set)]
    step: Option<i64>,
    #[pyo3(get, set)]
    last_end: Option<i64>,
    #[pyo3(get, set)]
    step_told: i64,
    /// The optimizer's phase: its start, and this step's time and calls.
    #[pyo3(get, set)]
    opt_start: Option<i64>,
    #[pyo3(get, set)]
    opt_ns: i64,
    #[pyo3(get, set)]
    opt_calls: i64,
    /// Who marks steps: None yet, "optimizer" or "rankscope.step()".
    #[pyo3(get, set)]
    marker: Option<String>,
    /// A weakref to the optimizer whose step ends a step.
    #[pyo3(get, set)]
    primary: Option<Py<PyAny>>,
    /// Where the program called the primary's step: its frames' (code,
    /// instruction) from the outermost; see `weigh`.
    primary_path: Vec<(Py<PyAny>, i64)>,
    /// The optimizers seen besides the primary (it among them), each a
    /// weakref and the step it was first seen in, or `WEIGHED` once it
    /// was weighed against the primary: each is weighed once.
    weighed: Vec<(Py<PyAny>, i64)>,
    /// An optimizer the Tracer did not know of was seen stepping besides
    /// the primary (a second model's, made mid-run): the next boundary
    /// looks for models again.
    rediscover: bool,
    /// Stand-ins are on for the step in progress (it is sampled).
    #[pyo3(get, set)]
    sampling: bool,
    /// Each event's (listener, method, when) tuples, non-empty or None.
    told: [Option<Py<PyTuple>>; 3],
    wired: OnceLock<Wired>,
    /// Shared, so that a boundary takes it without a borrow held.
    lean: Option<Arc<Lean>>,
    /// The NaN watch's state while it is armed (nan_arm.rs): its sentinel
    /// check in the pre-hook, and its boundary where it has nothing to do.
    nan_arm: Option<Py<NanArm>>,
}

#[pymethods]
impl StepClock {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        StepClock {
            on: false,
            quiet: false,
            tracing: false,
            every: 1,
            step: None,
            last_end: None,
            step_told: 0,
            opt_start: None,
            opt_ns: 0,
            opt_calls: 0,
            marker: None,
            primary: None,
            primary_path: Vec::new(),
            weighed: Vec::new(),
            rediscover: false,
            sampling: false,
            told: [None, None, None],
            wired: OnceLock::new(),
            lean: None,
            nan_arm: None,
        }
    }

    /// Hands the short way the stand-ins `Tracer._attach` has just put on
    /// (see `Lean`): `(plan, handles, entries, acc, zeros, roots,
    /// plan_id)`, where `entries` are (module weakref, stand-in) pairs in
    /// the order of `handles`, the list the Tracer keeps as its `handles`.
    /// Stand-ins that hold their module strongly (a `forward` that is not
    /// a plain method of it) are not taken: kept between sampled steps,
    /// they would keep a model the program dropped.
    fn lean_set(slf: &Bound<'_, Self>, given: &Bound<'_, PyTuple>) -> PyResult<bool> {
        let py = slf.py();
        let (plan, handles, entries, acc, zeros, roots, plan_id): LeanGiven = given.extract()?;
        if !entries
            .iter()
            .all(|(_, stand_in)| stand_in.bind(py).borrow().holds_weakly())
        {
            Self::lean_clear(slf);
            return Ok(false);
        }
        let lean = Lean {
            plan,
            handles,
            none_on: PyList::empty(py).unbind(),
            entries,
            acc,
            zeros,
            roots,
            plan_id,
        };
        let old = slf.borrow_mut().lean.replace(Arc::new(lean));
        drop(old); // after the borrow: see set_told
        Ok(true)
    }

    #[getter]
    fn get_nan_arm(&self, py: Python<'_>) -> Option<Py<NanArm>> {
        self.nan_arm.as_ref().map(|a| a.clone_ref(py))
    }
    /// The old arm goes after the borrow (see `replace_after_borrow`).
    #[setter]
    fn set_nan_arm(slf: &Bound<'_, Self>, value: Option<Py<NanArm>>) -> PyResult<()> {
        nan_arm::replace_after_borrow(slf, |c| &mut c.nan_arm, value)
    }

    fn lean_clear(slf: &Bound<'_, Self>) {
        let old = slf.borrow_mut().lean.take();
        drop(old);
    }

    /// The list the Tracer's `handles` is while the short way's stand-ins
    /// are on, or None.
    #[getter]
    fn lean_handles(&self, py: Python<'_>) -> Option<Py<PyList>> {
        self.lean.as_ref().map(|l| l.handles.clone_ref(py))
    }

    /// What the short way calls: trace.py's `tables` module, the memory
    /// timeline's `step_row`, and how often the step is told (ns).
    fn wire(&self, tables: Py<PyAny>, step_row: Py<PyAny>, step_told_ns: i64) -> PyResult<()> {
        self.wired
            .set(Wired {
                tables,
                step_row,
                step_told_ns,
            })
            .map_err(|_| PyValueError::new_err("the step clock is wired once"))
    }

    /// `{event: ((listener, method, when), ...)}` for each of EVENTS.
    #[getter]
    fn get_told<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (event, calls) in EVENTS.iter().zip(&self.told) {
            match calls {
                Some(calls) => dict.set_item(event, calls.bind(py))?,
                None => dict.set_item(event, PyTuple::empty(py))?,
            }
        }
        Ok(dict)
    }
    #[setter]
    fn set_told(slf: &Bound<'_, Self>, value: &Bound<'_, PyDict>) -> PyResult<()> {
        let mut told: [Option<Py<PyTuple>>; 3] = [None, None, None];
        for (slot, event) in told.iter_mut().zip(EVENTS) {
            if let Some(calls) = value.get_item(event)? {
                let calls = calls.cast_into::<PyTuple>()?;
                if !calls.is_empty() {
                    *slot = Some(calls.unbind());
                }
            }
        }
        // The old tuples are released after the borrow: that may free a
        // listener, whose code must find the clock free.
        let old = std::mem::replace(&mut slf.borrow_mut().told, told);
        drop(old);
        Ok(())
    }

    /// The `zero_grad` stand-in's call past its compiling test (trace.py,
    /// `_zero_grad_stand_in`): the usual step's `zero_grad` (a boundary
    /// came since this owner's last one, and it clears to None, by default
    /// or told so) is passed through here and its mark moved on; any other
    /// goes to `Tracer._zero_grad`. In Python, the usual step's tests cost
    /// the clock about 2 us a step on a small MLP, cold after the step's
    /// kernels. A test that fails to run sends the call the long way,
    /// whose own failures never reach the program.
    fn zero_grad_call(
        slf: &Bound<'_, Self>,
        own: &Bound<'_, PyAny>,
        owner: &Bound<'_, PyAny>,
        of_optimizer: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        kwargs: &Bound<'_, PyDict>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let call_own = || -> PyResult<Py<PyAny>> {
            let mut all = Vec::with_capacity(args.len() + 1);
            all.push(owner.clone());
            all.extend(args.iter());
            let kwargs = (!kwargs.is_empty()).then_some(kwargs);
            Ok(own.call(PyTuple::new(py, all)?, kwargs)?.unbind())
        };
        if !slf.borrow().on {
            return call_own();
        }
        let key = owner.as_ptr() as usize;
        if let Ok(Some((marks, kept))) = usual_zero_grad(slf, owner, key, args, kwargs) {
            let out = call_own()?;
            let step = slf.borrow().step;
            // (A mark that cannot be moved on sends the next call the long way.)
            let _ = PyTuple::new(
                py,
                [
                    kept.0.into_any(),
                    step.into_pyobject(py)?.into_any(),
                    kept.1.into_any(),
                    py.None().into_bound(py),
                    py.None().into_bound(py),
                ],
            )
            .and_then(|mark| marks.set_item(key, mark));
            return Ok(out);
        }
        Ok(slf
            .call_method1(
                intern!(py, "_zero_grad"),
                (own, owner, of_optimizer, args, kwargs),
            )?
            .unbind())
    }

    /// torch's pre hook: the listeners told, and the optimizer's time
    /// starts. Returns the step's arguments where the NaN watch wraps a
    /// closure (`Tracer._closure_step`), None otherwise.
    fn pre(
        slf: &Bound<'_, Self>,
        optimizer: &Bound<'_, PyAny>,
        args: &Bound<'_, PyAny>,
        kwargs: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let (on, calls, arm) = {
            let clock = slf.borrow();
            (
                clock.on,
                clock.calls(py, PRE),
                clock.nan_arm.as_ref().map(|a| a.clone_ref(py)),
            )
        };
        if !on {
            return Ok(py.None());
        }
        let armed = arm.is_some();
        let result = (|| -> PyResult<()> {
            if let Some(calls) = calls {
                // An `Exception` here leaves the step to the watch's
                // Python, whose own failure takes off the watch alone (as
                // `tell` does), not the whole clock.
                let step = current_step(slf, Some(optimizer))?;
                let checked = match arm {
                    Some(arm) => nan_arm::check_sentinels(arm.bind(py), optimizer, step, || {
                        marks_steps(slf, optimizer)
                    })
                    .or_else(|err| {
                        if err.is_instance_of::<PyException>(py) {
                            Ok(false)
                        } else {
                            Err(err)
                        }
                    })?,
                    None => false,
                };
                tell(
                    slf.as_any(),
                    &calls,
                    step,
                    std::slice::from_ref(optimizer),
                    checked,
                )?;
            }
            slf.borrow_mut().opt_start = Some(perf_ns());
            Ok(())
        })();
        guard(slf.as_any(), "the optimizer step pre-hook", result)?;
        // A step given arguments may be given a closure (LBFGS; any
        // optimizer takes one), which runs the forward and backward inside
        // the step, after this check: the watch checks after each of its
        // calls instead. torch's `args` begin with the optimizer itself; a
        // step without arguments of its own pays a length and a truth test.
        if armed && (args.len()? > 1 || kwargs.is_truthy()?) {
            match slf.call_method1(intern!(py, "_closure_step"), (optimizer, args, kwargs)) {
                Ok(replaced) => return Ok(replaced.unbind()),
                Err(err) if err.is_instance_of::<PyException>(py) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(py.None())
    }

    /// torch's post hook: the optimizer's time, the listeners told, and
    /// the step boundary where this optimizer marks steps.
    fn post(
        slf: &Bound<'_, Self>,
        optimizer: &Bound<'_, PyAny>,
        _args: &Bound<'_, PyAny>,
        _kwargs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let now = perf_ns();
        let arm = slf.borrow().nan_arm.as_ref().map(|a| a.clone_ref(slf.py()));
        if let Some(arm) = arm {
            // The gradients as the step left them (an optimizer may change
            // them in place: SGD's Nesterov momentum does): what a later
            // `zero_grad` compares with (nan_arm.rs, `applied`).
            nan_arm::note_stepped(arm.bind(slf.py()), optimizer);
        }
        if slf.borrow().on {
            let result = post_on(slf, optimizer, now);
            guard(slf.as_any(), "the optimizer step hook", result)?;
            let mut clock = slf.borrow_mut();
            if clock.last_end == Some(now) {
                // A boundary here: the next step starts when the program has
                // its thread back, so the probe's own work at the boundary
                // (models found at the first, a sampled step's rows) is in
                // no step's time, and not in the next one's data-loader wait.
                clock.last_end = Some(perf_ns());
            }
        }
        if !slf.borrow().on {
            // Turned off in the step: the hooks come off from here (see
            // Tracer._unhook_from_post).
            let py = slf.py();
            if let Err(err) = slf.call_method0(intern!(py, "_unhook_from_post")) {
                if !err.is_instance_of::<PyException>(py) {
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// A step boundary at `now` (perf_counter_ns), from the optimizer's
    /// post hook or `rankscope.step()` (`optimizer` None). Raises what the
    /// long way raises: the caller turns the clock off with it.
    fn boundary(
        slf: &Bound<'_, Self>,
        now: i64,
        optimizer: &Bound<'_, PyAny>,
        unknown: bool,
    ) -> PyResult<()> {
        boundary_at(slf, now, optimizer, unknown)
    }

    /// The listeners of `event` (one of EVENTS) told at `step`, with
    /// `args` before the step; see `tell`.
    #[pyo3(signature = (event, step, *args))]
    fn tell(
        slf: &Bound<'_, Self>,
        event: &str,
        step: i64,
        args: &Bound<'_, PyTuple>,
    ) -> PyResult<()> {
        let Some(index) = EVENTS.iter().position(|e| *e == event) else {
            return Err(PyValueError::new_err(format!("no step event {event:?}")));
        };
        let Some(calls) = slf.borrow().calls(slf.py(), index) else {
            return Ok(());
        };
        let args: Vec<Bound<'_, PyAny>> = args.iter().collect();
        tell(slf.as_any(), &calls, step, &args, false)
    }
}

impl StepClock {
    /// The listeners of EVENTS[index], where there are any.
    fn calls<'py>(&self, py: Python<'py>, index: usize) -> Option<Bound<'py, PyTuple>> {
        self.told[index].as_ref().map(|c| c.bind(py).clone())
    }
}

/// The owner's marks dict and the weakref and primary of its mark, where
/// this `zero_grad` is the usual step's (see `zero_grad_call`) and an armed
/// NaN watch has nothing new to check; None otherwise.
#[allow(clippy::type_complexity)]
fn usual_zero_grad<'py>(
    slf: &Bound<'py, StepClock>,
    owner: &Bound<'py, PyAny>,
    key: usize,
    args: &Bound<'py, PyTuple>,
    kwargs: &Bound<'py, PyDict>,
) -> PyResult<Option<(Bound<'py, PyDict>, (Bound<'py, PyAny>, Bound<'py, PyAny>))>> {
    let py = slf.py();
    // Cleared to None: by default, or told so (`zero_grad(set_to_none=True)`,
    // as many loops write it).
    let to_none = |value: Bound<'py, PyAny>| value.is(pyo3::types::PyBool::new(py, true));
    let plain_args = args.is_empty() || (args.len() == 1 && to_none(args.get_item(0)?));
    let plain_kwargs = kwargs.is_empty()
        || (kwargs.len() == 1
            && kwargs
                .get_item(intern!(py, "set_to_none"))?
                .is_some_and(to_none));
    if !(plain_args && plain_kwargs) {
        return Ok(None);
    }
    let marks = slf
        .getattr(intern!(py, "zero_marks"))?
        .cast_into::<PyDict>()?;
    let Some(mark) = marks.get_item(key)? else {
        return Ok(None);
    };
    let mark = mark.cast_into::<PyTuple>()?;
    if mark.len() < 3 {
        return Ok(None);
    }
    let (step, primary) = {
        let clock = slf.borrow();
        (clock.step, clock.primary.as_ref().map(|p| p.clone_ref(py)))
    };
    let marked_step: Option<i64> = mark.get_item(1)?.extract()?;
    if marked_step == step {
        return Ok(None);
    }
    let weak = mark.get_item(0)?;
    if !weak.call0()?.is(owner) {
        return Ok(None);
    }
    let marked_primary = mark.get_item(2)?;
    let same_primary = match &primary {
        Some(p) => marked_primary.is(p.bind(py)),
        None => marked_primary.is_none(),
    };
    if !same_primary {
        return Ok(None);
    }
    let watch = slf.getattr(intern!(py, "zero_grad_watch"))?;
    if !watch.is_none()
        && !watch
            .call_method1(intern!(py, "quiet_zero_grad"), (owner,))?
            .is_truthy()?
    {
        return Ok(None);
    }
    Ok(Some((marks, (weak, marked_primary))))
}

/// The step in progress: the clock's, or the Tracer's answer before its
/// first boundary.
fn current_step(slf: &Bound<'_, StepClock>, optimizer: Option<&Bound<'_, PyAny>>) -> PyResult<i64> {
    let step = slf.borrow().step;
    match step {
        Some(step) => Ok(step),
        None => slf
            .call_method1(intern!(slf.py(), "current_step"), (optimizer,))?
            .extract(),
    }
}

fn post_on(slf: &Bound<'_, StepClock>, optimizer: &Bound<'_, PyAny>, now: i64) -> PyResult<()> {
    let py = slf.py();
    let (calls, by_call, held) = {
        let mut clock = slf.borrow_mut();
        if let Some(start) = clock.opt_start.take() {
            clock.opt_ns += now - start;
            clock.opt_calls += 1;
        }
        (
            clock.calls(py, POST),
            clock.marker.as_deref() == Some(MARKER_CALL),
            clock.primary.as_ref().map(|p| p.clone_ref(py)),
        )
    };
    if let Some(calls) = calls {
        let step = current_step(slf, Some(optimizer))?;
        tell(
            slf.as_any(),
            &calls,
            step,
            std::slice::from_ref(optimizer),
            false,
        )?;
    }
    if by_call {
        return Ok(());
    }
    // The optimizer that steps last in the program's loop marks steps
    // (the primary); others (a GAN's first, Muon's partner) are timed, not
    // counted. The first seen stepping is the primary until another is
    // seen that the program calls later (see `weigh`).
    let primary = match held {
        Some(weak) => weak.bind(py).call0()?,
        None => py.None().into_bound(py),
    };
    let new = primary.is_none();
    if new {
        let weak = PyWeakrefReference::new(optimizer)?.into_any().unbind();
        let path = call_path(py)?;
        let (old, old_path, old_weighed) = {
            let mut clock = slf.borrow_mut();
            (
                clock.primary.replace(weak.clone_ref(py)),
                std::mem::replace(&mut clock.primary_path, path),
                std::mem::replace(&mut clock.weighed, vec![(weak, WEIGHED)]),
            )
        };
        drop((old, old_path, old_weighed));
    } else if !primary.is(optimizer) {
        // Made the primary here, it ends the step at its next step: the
        // step in progress is then longer, and the steps stay counted one
        // a loop.
        weigh(slf, optimizer)?;
        return Ok(());
    }
    slf.borrow_mut().marker = Some("optimizer".to_owned());
    let unknown = new
        && !slf
            .getattr(intern!(py, "known_optimizers"))?
            .contains(optimizer)?;
    boundary_at(slf, now, optimizer, unknown)
}

/// Where the program called the optimizer step in progress: the frames
/// above the outermost call of torch's step wrapper (the innermost frame,
/// which calls the hooks), from the outermost, each one's code and the
/// instruction it is at. torch's own frames are left out: 3.11 may show
/// the same call there at either of two instructions (a call specialised
/// or not), and what orders two steps is the program's code.
fn call_path(py: Python<'_>) -> PyResult<Vec<(Py<PyAny>, i64)>> {
    let mut path = Vec::new();
    let mut frame = py
        .import(intern!(py, "sys"))?
        .call_method1(intern!(py, "_getframe"), (0,))?;
    let mut wrapper: Option<Bound<'_, PyAny>> = None;
    while !frame.is_none() && path.len() < MAX_PATH {
        let code = frame.getattr(intern!(py, "f_code"))?;
        match &wrapper {
            None => wrapper = Some(code.clone()),
            Some(w) if code.is(w) => path.clear(),
            Some(_) => {}
        }
        if !wrapper.as_ref().is_some_and(|w| code.is(w)) {
            path.push((
                code.unbind(),
                frame.getattr(intern!(py, "f_lasti"))?.extract()?,
            ));
        }
        frame = frame.getattr(intern!(py, "f_back"))?;
    }
    path.reverse();
    Ok(path)
}

/// Frames kept of a call path (deeper ones are compared as alike).
const MAX_PATH: usize = 512;

/// Whether the call at `path` comes after the one at `than` in the
/// program's loop: where they part, the same code at a later instruction.
/// Alike paths (`for opt in optimizers: opt.step()`, or an optimizer that
/// steps inside another's step, cut at the outer step) are taken in the
/// order seen: the later seen ends later. None: they part in different
/// code, and cannot be told apart.
fn comes_later(path: &[(Py<PyAny>, i64)], than: &[(Py<PyAny>, i64)]) -> Option<bool> {
    for ((code, at), (other_code, other_at)) in path.iter().zip(than) {
        if !code.is(other_code) {
            return None;
        }
        if at != other_at {
            return Some(at > other_at);
        }
    }
    Some(path.len() <= than.len())
}

/// An entry of `weighed` that was weighed.
const WEIGHED: i64 = i64::MIN;

/// A step of an optimizer other than the primary, weighed once, at its
/// next step:
/// - the primary's step came once in between (they step at the same rate,
///   as Muon's partner and a GAN's two do): it becomes the primary if the
///   program calls it later in its loop (the step's end is after the last
///   optimizer's);
/// - the primary's step did not come in between: it steps more often (the
///   primary is an auxiliary optimizer stepped every few loops, or a
///   WGAN's generator to its critic's five), and becomes the primary.
///   Which optimizer marks steps then does not depend on where in the loop
///   the clock started, so ranks that started at different points count
///   the same steps; and the steps are numbered again from its own count
///   (`Tracer._renumber`);
/// - more than one primary step came in between: it steps less often, and
///   never marks steps (steps a hundred loops long for an optimizer
///   stepped every hundredth loop).
fn weigh(slf: &Bound<'_, StepClock>, optimizer: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = slf.py();
    let (weighed, step) = {
        let clock = slf.borrow();
        let weighed: Vec<(Py<PyAny>, i64)> = clock
            .weighed
            .iter()
            .map(|(w, seen)| (w.clone_ref(py), *seen))
            .collect();
        (weighed, clock.step.unwrap_or(0))
    };
    let mut live = Vec::with_capacity(weighed.len() + 1);
    let mut found = None;
    for (weak, seen) in weighed {
        let held = weak.bind(py).call0()?;
        if held.is(optimizer) {
            if seen == WEIGHED {
                return Ok(());
            }
            found = Some(seen);
            live.push((weak, WEIGHED));
        } else if !held.is_none() {
            live.push((weak, seen));
        }
    }
    let (later, faster) = match found {
        None => {
            // Its first step seen here: once per optimizer.
            if !slf
                .getattr(intern!(py, "known_optimizers"))?
                .contains(optimizer)?
            {
                slf.borrow_mut().rediscover = true;
            }
            let weak = PyWeakrefReference::new(optimizer)?.into_any().unbind();
            live.push((weak, step));
            (None, false)
        }
        Some(seen) if step == seen => (Some(call_path(py)?), true),
        Some(seen) if step == seen + 1 => {
            let path = call_path(py)?;
            let later = comes_later(&path, &slf.borrow().primary_path) == Some(true);
            (later.then_some(path), false)
        }
        Some(_) => (None, false),
    };
    let later = match later {
        Some(path) => Some((
            path,
            PyWeakrefReference::new(optimizer)?.into_any().unbind(),
        )),
        None => None,
    };
    let dropped = {
        let mut clock = slf.borrow_mut();
        let old_weighed = std::mem::replace(&mut clock.weighed, live);
        match later {
            Some((path, weak)) => {
                let old = clock.primary.replace(weak);
                let old_path = std::mem::replace(&mut clock.primary_path, path);
                (old_weighed, old, old_path)
            }
            None => (old_weighed, None, Vec::new()),
        }
    };
    drop(dropped);
    if faster {
        slf.call_method0(intern!(py, "_renumber"))?;
    }
    Ok(())
}

/// The short way through a boundary, where the last long one left the
/// clock `quiet`: the step's row while the trace is on, the step counted
/// and told, and the listeners told; and, where the short way holds the
/// trace's stand-ins (`Lean`), putting them on before a sampled step and
/// the sampled step's rows. Anything else is the Tracer's long way
/// (`Tracer._boundary`).
///
/// Everything up to the clock's moving on runs no Python code and makes
/// no object the cyclic collector tracks (on 3.11 making one may start a
/// collection, which runs finalizers and may let another thread in): weak
/// references, the modules' `__dict__` keyed by strings, the Tracer's own
/// attributes, ints. Nothing is released there either: what it lets go of
/// goes after. So a probe thread that turns the trace off, which first
/// clears `quiet`, finds either the boundary before or the boundary after.
/// (A module class that makes `forward` or `__dict__` a descriptor of its
/// own would run its code there; nn.Module does neither.)
fn boundary_at(
    slf: &Bound<'_, StepClock>,
    now: i64,
    optimizer: &Bound<'_, PyAny>,
    unknown: bool,
) -> PyResult<()> {
    let py = slf.py();
    let unknown = unknown || std::mem::take(&mut slf.borrow_mut().rediscover);
    // Whether the short way may take this boundary, and with which stand-ins.
    let checked = {
        let clock = slf.borrow();
        match (clock.step, clock.last_end, clock.wired.get()) {
            (Some(step), Some(_), Some(_)) if !unknown && clock.quiet && clock.on => {
                let next_sampled = clock.tracing && (step + 1) % clock.every.max(1) == 0;
                let sampled_now = clock.sampling;
                if !(next_sampled || sampled_now) {
                    Some(None)
                } else {
                    clock
                        .lean
                        .as_ref()
                        .map(|lean| Some((lean.clone(), sampled_now, next_sampled)))
                }
            }
            _ => None,
        }
    };
    let lean_step = match checked {
        None => None,
        Some(None) => Some(None),
        Some(Some((lean, sampled_now, next_sampled))) => {
            lean_turn(slf, &lean, sampled_now, next_sampled)?.map(|taken| Some((lean, taken)))
        }
    };
    let Some(lean_step) = lean_step else {
        slf.call_method1(intern!(py, "_boundary"), (now, optimizer, unknown))?;
        return Ok(());
    };
    // The clock moved on: the step counted, its end kept, its optimizer
    // time taken.
    let (step, last_end, tracing, opt, tables, step_row, calls) = {
        let mut clock = slf.borrow_mut();
        let (step, last_end) = (
            clock.step.expect("checked above"),
            clock.last_end.expect("checked above"),
        );
        let opt = (clock.opt_calls > 0).then_some(clock.opt_ns);
        let tracing = clock.tracing;
        if tracing {
            clock.opt_ns = 0;
            clock.opt_calls = 0;
        }
        if let Some((_, taken)) = &lean_step {
            clock.sampling = taken.on_next;
        }
        clock.step = Some(step + 1);
        clock.last_end = Some(now);
        let wired = clock.wired.get().expect("checked above");
        let tell_step = now - clock.step_told >= wired.step_told_ns;
        let tables = wired.tables.clone_ref(py);
        let step_row = tell_step.then(|| wired.step_row.clone_ref(py));
        if tell_step {
            clock.step_told = now;
        }
        (
            step,
            last_end,
            tracing,
            opt,
            tables,
            step_row,
            clock.calls(py, BOUNDARY),
        )
    };
    let tables = tables.bind(py);
    if tracing {
        let duration = now - last_end;
        let ms = |ns: i64| Cell::Float(ns as f64 / 1e6);
        let sampled = lean_step
            .as_ref()
            .and_then(|(lean, taken)| taken.sampled.as_ref().map(|s| (lean, s)));
        // COLUMNS["torch_steps"] after ts.
        let mut cells = vec![
            Cell::Int(step),
            Cell::Bool(sampled.is_some()),
            ms(duration),
            Cell::Null,
            Cell::Null,
            Cell::Null,
            opt.map_or(Cell::Null, ms),
            Cell::Null,
            Cell::Null,
            Cell::Null,
        ];
        let ts = wall_s();
        if let Some((lean, figures)) = sampled {
            // What Tracer._finish_step puts in a sampled step's row.
            if let Some(first) = figures.first_fwd {
                cells[3] = ms(first - last_end);
            }
            let acc = &figures.acc;
            let (mut ns, mut calls) = (0i64, 0i64);
            for &at in &lean.roots {
                ns += acc.get(at).copied().unwrap_or(0);
                calls += acc.get(at + 1).copied().unwrap_or(0);
            }
            if calls > 0 {
                cells[4] = ms(ns);
            }
            if let Some(loss) = &figures.loss {
                // A loss on the CPU (one on a GPU goes the long way), read
                // as the long way reads it: `float(loss)`, which raises
                // where that raised.
                let value = py
                    .get_type::<pyo3::types::PyFloat>()
                    .call1((loss.bind(py),))?
                    .extract::<f64>()?;
                cells[7] = Cell::Float(value);
            }
            if figures.samples > 0 {
                cells[8] = Cell::Int(figures.samples);
                if duration > 0 {
                    cells[9] = Cell::Float(figures.samples as f64 / (duration as f64 / 1e9));
                }
            }
            crate::store::keep_trace_step(lean.plan_id as u64, ts, step, figures.acc.clone())?;
        }
        crate::store::keep_step_row(ts, cells);
    }
    if let Some((lean, taken)) = &lean_step {
        // The stand-ins the program had stood something on meanwhile come
        // off the Python way, which takes one out of a chain.
        if !taken.left.is_empty() {
            let take_off = py
                .import(intern!(py, "rankscope._probe.torch.timed"))?
                .getattr(intern!(py, "take_off"))?;
            let handles = lean.handles.bind(py);
            // Each one tried, the first error then raised (the trace goes
            // off with it): the Tracer's `handles` no longer lists these.
            let mut failed = None;
            for &i in &taken.left {
                if let Err(err) = handles.get_item(i).and_then(|h| take_off.call1((h,))) {
                    failed.get_or_insert(err);
                }
            }
            if let Some(err) = failed {
                return Err(err);
            }
        }
    }
    // At every boundary (an atomic store): a profile reads it at each
    // sample, and a step told only every `step_told_ns` tagged a slow step's
    // samples with the step of the last one told, up to ten steps back.
    crate::memory::set_step(step + 1);
    if let Some(step_row) = step_row {
        step_row.bind(py).call1((now,))?;
    }
    if let Some(calls) = calls {
        let checked = quiet_nan_boundary(slf)?;
        tell(slf.as_any(), &calls, step + 1, &[], checked)?;
    }
    let due: i64 = tables.getattr(intern!(py, "due"))?.extract()?;
    if now >= due {
        tables.call_method0(intern!(py, "flush"))?;
    }
    Ok(())
}

/// What `lean_turn` did at a boundary.
struct LeanTurn {
    /// The stand-ins are on for the next step.
    on_next: bool,
    /// The step that ended was sampled: its figures.
    sampled: Option<Sampled>,
    /// Indexes of the stand-ins that could not come off here (something
    /// stood on them): taken off the Python way once the clock has moved.
    left: Vec<usize>,
    /// What the window let go of, released after it.
    dropped: Option<Py<PyAny>>,
}

struct Sampled {
    /// A copy of the stand-ins' counters for the step.
    acc: Vec<i64>,
    first_fwd: Option<i64>,
    samples: i64,
    loss: Option<Py<PyAny>>,
}

/// The short way's part in a boundary where the step that ended was
/// sampled, or the next one is: the sampled step's figures read and the
/// Tracer's step state reset, the stand-ins taken off or put on. None
/// where the long way must take the boundary; it has then changed nothing.
/// Runs no Python code and makes no tracked object (see `boundary_at`).
fn lean_turn(
    slf: &Bound<'_, StepClock>,
    lean: &Lean,
    sampled_now: bool,
    next_sampled: bool,
) -> PyResult<Option<LeanTurn>> {
    let py = slf.py();
    let tracer = slf.as_any();
    let handles = tracer.getattr(intern!(py, "handles"))?;
    if !tracer.getattr(intern!(py, "plan"))?.is(&lean.plan) {
        return Ok(None);
    }
    let ours = handles.is(&lean.handles);
    if sampled_now != ours || (!ours && !handles.cast::<PyList>().is_ok_and(|h| h.is_empty())) {
        return Ok(None);
    }
    let mut taken = LeanTurn {
        on_next: next_sampled,
        sampled: None,
        left: Vec::new(),
        dropped: None,
    };
    if sampled_now {
        if !tracer.getattr(intern!(py, "loss_event"))?.is_none() {
            return Ok(None); // a loss on its way from a GPU
        }
        // A loss that `_loss_into` reads otherwise than `float(loss)`: the
        // parts of an accumulated batch's loss (divided by their number),
        // or a validation loss in a step that trained on one not seen.
        if tracer.getattr(intern!(py, "loss_divisor"))?.is_truthy()?
            || (tracer
                .getattr(intern!(py, "samples_trained"))?
                .is_truthy()?
                && !tracer.getattr(intern!(py, "loss_trained"))?.is_truthy()?
                && !tracer.getattr(intern!(py, "loss"))?.is_none())
        {
            return Ok(None);
        }
        // Stand-ins that stay on (every step sampled) with a module gone (a
        // model the program dropped, maybe for another): the long way's,
        // which looks for models again.
        if next_sampled
            && lean
                .entries
                .iter()
                .any(|(module, _)| module.bind(py).upgrade().is_none())
        {
            return Ok(None);
        }
        let (first_fwd, samples, loss) = take_root_figures(tracer)?;
        let acc = lean.acc.bind(py);
        let copy = acc
            .iter()
            .map(|n| n.extract::<i64>())
            .collect::<PyResult<Vec<i64>>>()?;
        taken.sampled = Some(Sampled {
            acc: copy,
            first_fwd,
            samples,
            loss: (!loss.is_none()).then(|| loss.unbind()),
        });
        let count: i64 = tracer.getattr(intern!(py, "sampled_steps"))?.extract()?;
        tracer.setattr(intern!(py, "sampled_steps"), count + 1)?;
        if next_sampled {
            reset_counters(py, lean)?;
        } else {
            for (i, (module, stand_in)) in lean.entries.iter().enumerate() {
                let Some(module) = module.bind(py).upgrade() else {
                    continue;
                };
                let attrs = module.getattr(intern!(py, "__dict__"))?;
                let attrs = attrs.cast::<PyDict>()?;
                match attrs.get_item(intern!(py, "forward"))? {
                    Some(on) if on.is(stand_in) => attrs.del_item(intern!(py, "forward"))?,
                    _ => taken.left.push(i),
                }
            }
            tracer.setattr(intern!(py, "handles"), &lean.none_on)?;
        }
    } else if next_sampled {
        // All as the last sampled step left them, or the long way.
        let mut dicts = Vec::with_capacity(lean.entries.len());
        for (module, stand_in) in &lean.entries {
            let Some(module) = module.bind(py).upgrade() else {
                return Ok(None);
            };
            let Ok(attrs) = module
                .getattr(intern!(py, "__dict__"))?
                .cast_into::<PyDict>()
            else {
                return Ok(None);
            };
            if attrs.contains(intern!(py, "forward"))?
                || attrs
                    .get_item(intern!(py, "_compiled_call_impl"))?
                    .is_some_and(|c| !c.is_none())
            {
                return Ok(None);
            }
            let forward = module.get_type().getattr(intern!(py, "forward"))?;
            if !stand_in.bind(py).borrow().stands_for(&forward) {
                return Ok(None);
            }
            dicts.push(attrs);
        }
        reset_counters(py, lean)?;
        for (attrs, (_, stand_in)) in dicts.iter().zip(&lean.entries) {
            attrs.set_item(intern!(py, "forward"), stand_in)?;
        }
        tracer.setattr(intern!(py, "handles"), &lean.handles)?;
        // Reset here too: a program that wrapped a root stand-in calls it
        // at every step, sampled or not, and the sampled step's row is its
        // own. (The old loss goes with `taken`, after the window.)
        taken.dropped = Some(take_root_figures(tracer)?.2.unbind());
    }
    Ok(Some(taken))
}

/// Tracer._reset_step's part that a root stand-in writes (its first
/// forward, samples, loss): read and reset. The loss is returned, not
/// released: the window may release nothing.
fn take_root_figures<'py>(
    tracer: &Bound<'py, PyAny>,
) -> PyResult<(Option<i64>, i64, Bound<'py, PyAny>)> {
    let py = tracer.py();
    let first_fwd: Option<i64> = tracer.getattr(intern!(py, "first_fwd"))?.extract()?;
    // Under gradient accumulation, the later micro-batches' waits for data
    // (reset at the step's first forward): the step's wait is both, so the
    // start that `first - last_end` reads is moved on by them.
    let between: i64 = tracer.getattr(intern!(py, "between"))?.extract()?;
    let first_fwd = first_fwd.map(|first| first + between);
    let samples: i64 = tracer.getattr(intern!(py, "samples"))?.extract()?;
    let loss = tracer.getattr(intern!(py, "loss"))?;
    let none = py.None();
    tracer.setattr(intern!(py, "first_fwd"), &none)?;
    tracer.setattr(intern!(py, "samples"), 0)?;
    tracer.setattr(intern!(py, "loss"), &none)?;
    Ok((first_fwd, samples, loss))
}

fn reset_counters(py: Python<'_>, lean: &Lean) -> PyResult<()> {
    let acc = lean.acc.bind(py);
    acc.set_slice(0, acc.len(), lean.zeros.bind(py))
}

/// Calls each listener's method with `(*args, step)` where its `when` lets
/// it: None, always; "sampled", at the steps its `every` samples;
/// "unchecked", unless `checked` (the NaN watch's native part did this
/// step's work: nan_arm.rs); another name, while that attribute of the
/// listener is true (a GPU's values waiting). A listener whose call
/// raises an `Exception` is taken off (`Tracer._listener_failed`); the
/// others are still told.
fn tell(
    tracer: &Bound<'_, PyAny>,
    calls: &Bound<'_, PyTuple>,
    step: i64,
    args: &[Bound<'_, PyAny>],
    checked: bool,
) -> PyResult<()> {
    let py = tracer.py();
    for entry in calls.iter() {
        let entry = entry.cast_into::<PyTuple>()?;
        let listener = entry.get_item(0)?;
        let call = entry.get_item(1)?;
        let when = entry.get_item(2)?;
        let result = (|| -> PyResult<()> {
            if !when.is_none() {
                if when.eq(intern!(py, "unchecked"))? {
                    if checked {
                        return Ok(());
                    }
                } else if when.eq(intern!(py, "sampled"))? {
                    let every: i64 = listener.getattr(intern!(py, "every"))?.extract()?;
                    if every > 0 && step % every != 0 {
                        return Ok(());
                    }
                } else if !listener.getattr(when.cast::<PyString>()?)?.is_truthy()? {
                    return Ok(());
                }
            }
            let mut all: Vec<Bound<'_, PyAny>> = Vec::with_capacity(args.len() + 1);
            all.extend(args.iter().cloned());
            all.push(step.into_pyobject(py)?.into_any());
            call.call1(PyTuple::new(py, all)?)?;
            Ok(())
        })();
        if let Err(err) = result {
            if !err.is_instance_of::<PyException>(py) {
                return Err(err);
            }
            if let Err(err) = tracer.call_method1(
                intern!(py, "_listener_failed"),
                (listener, call, err.into_value(py)),
            ) {
                if !err.is_instance_of::<PyException>(py) {
                    return Err(err);
                }
            }
        }
    }
    Ok(())
}

/// The NaN watch's boundary, done here where its Python has nothing to do
/// (see `nan_arm::quiet_boundary`): steps marked by an optimizer, whose
/// pre-hook checked them.
fn quiet_nan_boundary(slf: &Bound<'_, StepClock>) -> PyResult<bool> {
    let py = slf.py();
    let Some(arm) = by_optimizer(slf, |c| c.nan_arm.as_ref().map(|a| a.clone_ref(py))) else {
        return Ok(false);
    };
    // As in the pre-hook: an `Exception` leaves it to the Python.
    match slf.getattr(intern!(py, "models")) {
        Ok(models) => Ok(nan_arm::quiet_boundary(arm.bind(py), &models)),
        Err(err) if err.is_instance_of::<PyException>(py) => Ok(false),
        Err(err) => Err(err),
    }
}

/// `read` of the clock where an optimizer marks steps; None where none
/// does (yet, or `rankscope.step()` does).
fn by_optimizer<T>(
    slf: &Bound<'_, StepClock>,
    read: impl FnOnce(&StepClock) -> Option<T>,
) -> Option<T> {
    let clock = slf.borrow();
    if clock.marker.as_deref() != Some("optimizer") {
        return None;
    }
    read(&clock)
}

/// Whether `optimizer` is the one that marks steps (the primary, with the
/// optimizer as marker): the step's input may go at its pre-hook.
fn marks_steps(slf: &Bound<'_, StepClock>, optimizer: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = slf.py();
    match by_optimizer(slf, |c| c.primary.as_ref().map(|p| p.clone_ref(py))) {
        Some(weak) => Ok(weak.bind(py).call0()?.is(optimizer)),
        None => Ok(false),
    }
}

/// What a hook returns to torch: nothing, whatever happened, but for a
/// `BaseException` of the program's own (see the module's comment).
fn guard(tracer: &Bound<'_, PyAny>, place: &str, result: PyResult<()>) -> PyResult<()> {
    let py = tracer.py();
    let Err(err) = result else {
        return Ok(());
    };
    if !err.is_instance_of::<PyException>(py) {
        return Err(err);
    }
    if tracer
        .call_method1(intern!(py, "_fail"), (place, err.into_value(py)))
        .is_err()
    {
        // The last resort: the clock stops (its hooks then do nothing).
        let _ = tracer.setattr(intern!(py, "quiet"), false);
        let _ = tracer.setattr(intern!(py, "on"), false);
    }
    Ok(())
}
