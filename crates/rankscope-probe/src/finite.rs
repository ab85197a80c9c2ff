//! The NaN watch's check on a CPU, read in place: whether every element of
//! a few small tensors (the loss, the sentinel gradients) is finite.
//!
//! The check runs on the training thread at every step. Through torch it is
//! a fused norm and a `.item()` per value: dispatcher calls, an output
//! tensor each, all of it cold after the step's kernels, about 19 us a step
//! on a small MLP. Here it is a few attribute reads and a scan of the
//! values' bytes (already in cache: backward wrote them last). Only
//! contiguous CPU tensors of the four float types are read; for anything
//! else the answer is None and the caller asks torch.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::torch_abi;

/// Elements scanned at most per tensor (the sentinels are small by choice).
const MAX_ELEMENTS: usize = 1 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Float {
    F32,
    F64,
    F16,
    BF16,
}

/// `FiniteCheck((float32, float64, float16, bfloat16))`, made once; then
/// `check(tensors)`: True or False, or None where a tensor is not one this
/// reads (on a GPU, strided, another dtype, too large) before any that is
/// not finite. Each tensor is read as soon as its address is known.
/// Frozen: nan_arm.rs reads with it at every step, with no borrow to take.
#[pyclass(module = "rankscope._native", frozen)]
pub struct FiniteCheck {
    dtypes: Dtypes,
}

impl Float {
    /// Bytes an element.
    pub(crate) fn size(self) -> usize {
        match self {
            Float::F32 => 4,
            Float::F64 => 8,
            Float::F16 | Float::BF16 => 2,
        }
    }
}

/// torch's float dtypes, as given by the caller (float32, float64, float16,
/// bfloat16), to tell a tensor's element type by identity; and the tensor
/// types whose `data_ptr()` is always an address in a storage of their own.
pub(crate) struct Dtypes {
    kinds: Vec<(Py<PyAny>, Float)>,
    /// `torch.Tensor` and `torch.nn.Parameter`.
    plain: Vec<Py<PyAny>>,
    /// `torch.strided`: the one layout whose values lie at `data_ptr()`.
    strided: Py<PyAny>,
}

/// A contiguous CPU tensor's values: `count` elements of `kind` at `ptr`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct View {
    pub ptr: usize,
    pub count: usize,
    pub kind: Float,
}

impl Dtypes {
    pub(crate) fn new(dtypes: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let py = dtypes.py();
        let kinds = [Float::F32, Float::F64, Float::F16, Float::BF16];
        let torch = py.import("torch")?;
        Ok(Dtypes {
            kinds: dtypes
                .iter()
                .zip(kinds)
                .map(|(dtype, kind)| (dtype.unbind(), kind))
                .collect(),
            plain: vec![
                torch.getattr("Tensor")?.unbind(),
                torch.getattr("nn")?.getattr("Parameter")?.unbind(),
            ],
            strided: torch.getattr("strided")?.unbind(),
        })
    }

    /// Where `tensor`'s values are, if this can read them in place: a
    /// contiguous CPU tensor of one of the four float types, at most
    /// `max_elements` long; None for anything else.
    pub(crate) fn view(
        &self,
        tensor: &Bound<'_, PyAny>,
        max_elements: usize,
    ) -> PyResult<Option<View>> {
        Ok(self.view_at(tensor, max_elements)?.map(|(view, _)| view))
    }

    /// `view`, and the tensor's `TensorImpl` where its metadata was read
    /// through torch's C functions (torch_abi.rs), for more questions.
    fn view_at(
        &self,
        tensor: &Bound<'_, PyAny>,
        max_elements: usize,
    ) -> PyResult<Option<(View, Option<usize>)>> {
        // Names interned once: each read is then a lookup, not a new string.
        let py = tensor.py();
        let ty = tensor.get_type();
        let plain = self.plain.iter().any(|plain| ty.is(plain));
        let at = match torch_abi::abi() {
            Some(abi) if plain => tensor
                .getattr(intern!(py, "_cdata"))
                .and_then(|at| at.extract::<usize>())
                .ok()
                .map(|at| (abi, at)),
            _ => None,
        };
        let (kind, count, at) = match at {
            Some((abi, at)) => {
                // Safety: a plain tensor's `_cdata`, the tensor held.
                let Some(meta) = (unsafe { abi.contiguous_cpu_float(at) }) else {
                    return Ok(None);
                };
                (meta.kind, meta.count, Some(at))
            }
            _ => {
                let dtype = tensor.getattr(intern!(py, "dtype"))?;
                let Some(&(_, kind)) = self.kinds.iter().find(|(d, _)| d.is(&dtype)) else {
                    return Ok(None);
                };
                // A sparse gradient (an Embedding's) has no values at data_ptr().
                if !tensor.getattr(intern!(py, "layout"))?.is(&self.strided)
                    || !tensor.getattr(intern!(py, "is_cpu"))?.extract::<bool>()?
                    || !tensor
                        .call_method0(intern!(py, "is_contiguous"))?
                        .extract::<bool>()?
                {
                    return Ok(None);
                }
                let count: usize = tensor.call_method0(intern!(py, "numel"))?.extract()?;
                (kind, count, None)
            }
        };
        let ptr: usize = tensor.call_method0(intern!(py, "data_ptr"))?.extract()?;
        // A tensor made over a byte buffer at an odd offset is not aligned
        // to its element type, and is not read as one here.
        if count > max_elements || (count > 0 && (ptr == 0 || !ptr.is_multiple_of(kind.size()))) {
            return Ok(None);
        }
        if count > 0 && !plain && !within_own_storage(tensor, ptr, count * kind.size()) {
            return Ok(None);
        }
        Ok(Some((View { ptr, count, kind }, at)))
    }

    /// The size of `tensor`'s first dimension where it has two or more;
    /// `at` as `view_at` gave it.
    fn rows(&self, tensor: &Bound<'_, PyAny>, at: Option<usize>) -> PyResult<Option<usize>> {
        if let (Some(abi), Some(at)) = (torch_abi::abi(), at) {
            // Safety: as in `view_at`, the tensor still held.
            return Ok(unsafe { abi.rows(at) });
        }
        let py = tensor.py();
        if tensor
            .call_method0(intern!(py, "dim"))?
            .extract::<usize>()?
            < 2
        {
            return Ok(None);
        }
        Ok(Some(
            tensor.call_method1(intern!(py, "size"), (0,))?.extract()?,
        ))
    }
}

/// Whether `bytes` at `ptr` lie inside `tensor`'s own storage. A tensor
/// subclass may have none: a wrapper such as DTensor (an FSDP2 or
/// tensor-parallel parameter, and its gradient) answers `data_ptr()` with
/// its storage offset in bytes (0x40, 0x100), not an address, and its
/// `numel()` counts every rank's shard; reading there killed the process.
fn within_own_storage(tensor: &Bound<'_, PyAny>, ptr: usize, bytes: usize) -> bool {
    let py = tensor.py();
    let Ok(storage) = tensor.call_method0(intern!(py, "untyped_storage")) else {
        return false;
    };
    let number = |name: &Bound<'_, pyo3::types::PyString>| {
        storage
            .call_method0(name)
            .and_then(|v| v.extract::<usize>())
            .ok()
    };
    let (Some(base), Some(size)) = (
        number(intern!(py, "data_ptr")),
        number(intern!(py, "nbytes")),
    ) else {
        return false;
    };
    base != 0
        && ptr >= base
        && ptr
            .checked_add(bytes)
            .is_some_and(|end| end <= base.saturating_add(size))
}

/// Reads `count` values at `ptr` (a live CPU tensor's storage, held by the
/// caller's reference for the call; the GIL is held, so no Python code of
/// the program frees it meanwhile).
unsafe fn all_finite(ptr: usize, count: usize, kind: Float) -> bool {
    #[cfg(target_arch = "x86_64")]
    if wide() {
        return unsafe { all_finite_avx2(ptr, count, kind) };
    }
    unsafe { all_finite_plain(ptr, count, kind) }
}

/// # Safety
/// As `all_finite`, on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn all_finite_avx2(ptr: usize, count: usize, kind: Float) -> bool {
    unsafe { all_finite_plain(ptr, count, kind) }
}

/// # Safety
/// As `all_finite`.
#[inline(always)]
unsafe fn all_finite_plain(ptr: usize, count: usize, kind: Float) -> bool {
    // A value is not finite exactly when its exponent is all ones, that is
    // when its bits without the sign are at least those of infinity: so the
    // largest of them, taken in blocks with no early exit inside (each block
    // one vectorised pass of an `and` and a `max`), tells. Half the
    // instructions of a compare per value.
    #[inline(always)]
    fn below<T: Copy + Ord + Default + std::ops::BitAnd<Output = T>>(
        values: &[T],
        magnitude: T,
        infinity: T,
    ) -> bool {
        values.chunks(2048).all(|block| {
            block
                .iter()
                .fold(T::default(), |top, &v| top.max(v & magnitude))
                < infinity
        })
    }
    unsafe {
        match kind {
            Float::F32 => below(
                std::slice::from_raw_parts(ptr as *const u32, count),
                0x7FFF_FFFF,
                0x7F80_0000,
            ),
            // As signed: the sign taken off, a signed max is the unsigned
            // one, and AVX2 has a signed compare of 64-bit lanes only.
            Float::F64 => below(
                std::slice::from_raw_parts(ptr as *const i64, count),
                0x7FFF_FFFF_FFFF_FFFF,
                0x7FF0_0000_0000_0000,
            ),
            // Infinity's bits: half's exponent is 5 bits, bfloat16's 8.
            Float::F16 | Float::BF16 => below(
                std::slice::from_raw_parts(ptr as *const u16, count),
                0x7FFF,
                if kind == Float::F16 { 0x7C00 } else { 0x7F80 },
            ),
        }
    }
}

/// Whether the CPU has AVX2 (asked once): the passes over a tensor's
/// values then take eight floats an instruction instead of four.
pub(crate) fn wide() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *WIDE.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[pymethods]
impl FiniteCheck {
    #[new]
    fn new(dtypes: &Bound<'_, PyTuple>) -> PyResult<Self> {
        Ok(FiniteCheck {
            dtypes: Dtypes::new(dtypes)?,
        })
    }

    /// Whether tensors' metadata is read through torch's C shim here
    /// (torch_abi.rs), not its Python API.
    #[getter]
    fn c_shim(&self) -> bool {
        torch_abi::abi().is_some()
    }

    fn check(&self, tensors: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
        for tensor in tensors.try_iter()? {
            match self.read(&tensor?)? {
                Some(true) => {}
                other => return Ok(other),
            }
        }
        Ok(Some(true))
    }

    /// `check` of the gradients of `params` (those that have one) and of
    /// `loss` (a tensor or None): the step's check in one call, without a
    /// list of the gradients made in Python first; None also where there
    /// is nothing to read.
    pub(crate) fn check_grads(
        &self,
        params: &Bound<'_, PyAny>,
        loss: &Bound<'_, PyAny>,
    ) -> PyResult<Option<bool>> {
        let mut read = Reads::default();
        for param in params.try_iter()? {
            if !read.grad_of(&param?, |grad| self.read_sentinel(grad))? {
                return Ok(read.answer);
            }
        }
        read.then_loss(loss, |loss| self.read(loss))
    }
}

/// What a check has read so far: how many tensors, and the answer where a
/// read ended it (one not finite, or one this cannot read).
#[derive(Default)]
struct Reads {
    count: usize,
    answer: Option<bool>,
}

impl Reads {
    /// Reads `param`'s gradient where it has one; false where that ended
    /// the check (`answer` then says how).
    fn grad_of(
        &mut self,
        param: &Bound<'_, PyAny>,
        read: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<Option<bool>>,
    ) -> PyResult<bool> {
        let grad = param.getattr(intern!(param.py(), "grad"))?;
        if grad.is_none() {
            return Ok(true);
        }
        self.take(read(&grad)?)
    }

    fn take(&mut self, read: Option<bool>) -> PyResult<bool> {
        if read == Some(true) {
            self.count += 1;
            return Ok(true);
        }
        self.answer = read;
        Ok(false)
    }

    /// The loss (a tensor or None) read last; then the answer, None also
    /// where there was nothing to read (the caller then counts no check).
    fn then_loss(
        mut self,
        loss: &Bound<'_, PyAny>,
        read: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<Option<bool>>,
    ) -> PyResult<Option<bool>> {
        if !loss.is_none() && !self.take(read(loss)?)? {
            return Ok(self.answer);
        }
        Ok((self.count > 0).then_some(true))
    }
}

impl FiniteCheck {
    /// The full check, which nan.py makes every `FULL_EVERY`-th step: every
    /// gradient of `optimizer`'s parameters read whole, then `loss`; as
    /// `check_grads` answers. Made here with the sentinels' check, so that
    /// a step of it needs no list made in Python and no call into the
    /// watch's Python where all is finite.
    pub(crate) fn check_optimizer(
        &self,
        optimizer: &Bound<'_, PyAny>,
        loss: &Bound<'_, PyAny>,
    ) -> PyResult<Option<bool>> {
        let py = optimizer.py();
        let mut read = Reads::default();
        for group in optimizer.getattr(intern!(py, "param_groups"))?.try_iter()? {
            for param in group?.get_item(intern!(py, "params"))?.try_iter()? {
                if !read.grad_of(&param?, |grad| self.read(grad))? {
                    return Ok(read.answer);
                }
            }
        }
        read.then_loss(loss, |loss| self.read(loss))
    }
}

/// A sentinel's gradient up to this many elements is read whole; a larger
/// one, of a weight, its first slice along its first dimension only.
const WHOLE_UP_TO: usize = 4096;

impl FiniteCheck {
    /// `read` of a sentinel's gradient: a large weight's first slice along
    /// its first dimension (a Linear's first row, a convolution's first
    /// output channel). It is the output's gradient times the module's
    /// input, so a non-finite input (a bad batch) spoils every slice; a
    /// non-finite gradient coming back spoils the bias (the other
    /// sentinel) in any column. Read whole, the first Linear of the
    /// bench's MLP was 256 kB a step.
    fn read_sentinel(&self, grad: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
        let Some((mut view, at)) = self.dtypes.view_at(grad, usize::MAX)? else {
            return Ok(None);
        };
        if view.count > WHOLE_UP_TO {
            if let Some(slice) = self
                .dtypes
                .rows(grad, at)?
                .and_then(|rows| view.count.checked_div(rows))
            {
                view.count = slice;
            }
        }
        if view.count > MAX_ELEMENTS {
            return Ok(None);
        }
        Ok(Some(
            view.count == 0 || unsafe { all_finite(view.ptr, view.count, view.kind) },
        ))
    }

    /// Whether every element of `tensor` is finite, read in place at once
    /// after its address is taken (no Python code in between, so nothing
    /// can free or move its values meanwhile; the reference held keeps the
    /// storage alive); None where this cannot read it (the whole answer is
    /// then left to torch).
    fn read(&self, tensor: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
        let Some(view) = self.dtypes.view(tensor, MAX_ELEMENTS)? else {
            return Ok(None);
        };
        Ok(Some(
            view.count == 0 || unsafe { all_finite(view.ptr, view.count, view.kind) },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_float_type_tells_nan_and_inf_from_numbers() {
        // The sign does not count: the most negative values, subnormals
        // and -0.0 are finite.
        let f32s = [1.0f32, -0.0, f32::MAX, f32::MIN, -1e-45];
        assert!(unsafe { all_finite(f32s.as_ptr() as usize, 5, Float::F32) });
        let f64s = [f64::MIN, -5e-324, f64::MAX];
        assert!(unsafe { all_finite(f64s.as_ptr() as usize, 3, Float::F64) });
        assert!(!unsafe { all_finite([-1.0f64, f64::NAN].as_ptr() as usize, 2, Float::F64) });
        assert!(!unsafe { all_finite([f32::NEG_INFINITY].as_ptr() as usize, 1, Float::F32) });
        let bad = [1.0f32, f32::NAN];
        assert!(!unsafe { all_finite(bad.as_ptr() as usize, 2, Float::F32) });
        let f64s = [1.0f64, f64::NEG_INFINITY];
        assert!(!unsafe { all_finite(f64s.as_ptr() as usize, 2, Float::F64) });
        assert!(unsafe { all_finite(f64s.as_ptr() as usize, 1, Float::F64) });
        // half: 0x7C00 is +inf, 0x7E00 a NaN, 0x7BFF the largest finite.
        let f16s = [0x3C00u16, 0x7BFF, 0xFBFF];
        assert!(unsafe { all_finite(f16s.as_ptr() as usize, 3, Float::F16) });
        assert!(!unsafe { all_finite([0x7E00u16].as_ptr() as usize, 1, Float::F16) });
        assert!(!unsafe { all_finite([0xFC00u16].as_ptr() as usize, 1, Float::F16) });
        // bfloat16: 0x7F80 is +inf, 0x7FC0 a NaN, 0x7F7F the largest finite.
        assert!(unsafe { all_finite([0x3F80u16, 0x7F7F].as_ptr() as usize, 2, Float::BF16) });
        assert!(!unsafe { all_finite([0x7FC0u16].as_ptr() as usize, 1, Float::BF16) });
        assert!(!unsafe { all_finite([0xFF80u16].as_ptr() as usize, 1, Float::BF16) });
    }

    #[test]
    fn a_bad_value_anywhere_in_a_long_tensor_is_found_on_both_paths() {
        // Past the 2,048-element blocks, at each edge, and in the tail;
        // the plain path always, the AVX2 one where the CPU has it.
        for n in [1023usize, 2047, 2048, 2049, 4097] {
            for at in [0, 1022, 2047, 2048, n - 1] {
                if at >= n {
                    continue;
                }
                let mut values = vec![1.5f32; n];
                let ptr = values.as_ptr() as usize;
                assert!(unsafe { all_finite_plain(ptr, n, Float::F32) });
                values[at] = f32::INFINITY;
                assert!(
                    !unsafe { all_finite_plain(ptr, n, Float::F32) },
                    "n {n}, at {at}"
                );
                assert!(!unsafe { all_finite(ptr, n, Float::F32) }, "n {n}, at {at}");
                let mut wide = vec![-2.0f64; n];
                wide[at] = f64::NAN;
                let ptr = wide.as_ptr() as usize;
                assert!(!unsafe { all_finite(ptr, n, Float::F64) }, "n {n}, at {at}");
                assert!(unsafe { all_finite(ptr, at, Float::F64) });
            }
        }
    }
}
