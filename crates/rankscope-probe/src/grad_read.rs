//! Gradient statistics on a CPU, read in place (`torch grads`): each
//! gradient's norm and max |g|, the weights' norms, and the norm of the
//! optimizer's update, with one pass over each tensor.
//!
//! Through torch, a sampled step of a small CPU model was about 30
//! dispatcher calls (fused norms, an `aminmax` per gradient, the weights'
//! copy, the subtraction, stacking) and six passes over the parameters,
//! about 450 us against a 1.6 ms step: +4 % at `--every 10`. Here the
//! gradient's sum of squares and max |g| come from one pass, the weights'
//! norms from the pass that copies them, and the update's norm from one pass
//! over the copy and the weights. On a GPU the statistics stay torch's fused
//! `_foreach` kernels (`stats.py`).
//!
//! Nothing here writes to a tensor: the weights are copied into this
//! object's own buffer and compared with the weights after the step.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::finite::{wide, Dtypes, Float, View};

/// Elements summed in each lane before the lane's sum joins an f64 total:
/// short enough that f32 sums lose nothing a norm shows.
const BLOCK: usize = 1024;
const LANES: usize = 16;

trait Num:
    Copy
    + PartialOrd
    + Into<f64>
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
{
    const ZERO: Self;
    fn magnitude(self) -> Self;
}

impl Num for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn magnitude(self) -> Self {
        self.abs()
    }
}

impl Num for f64 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn magnitude(self) -> Self {
        self.abs()
    }
}

/// The larger, keeping the old one when `value` is NaN (so that the lanes
/// vectorise; a NaN shows in the sum of squares instead).
#[inline(always)]
fn larger<A: Num>(top: A, value: A) -> A {
    if value > top {
        value
    } else {
        top
    }
}

/// (sum of squares, max |x|) of `values`, each widened by `to`.
#[inline(always)]
fn sumsq_max<T: Copy, A: Num>(values: &[T], to: impl Fn(T) -> A + Copy) -> (f64, f64) {
    let mut total = 0f64;
    let mut top = A::ZERO;
    for block in values.chunks(BLOCK) {
        let mut squares = [A::ZERO; LANES];
        let mut tops = [A::ZERO; LANES];
        let mut lanes = block.chunks_exact(LANES);
        for chunk in &mut lanes {
            let chunk: &[T; LANES] = chunk.try_into().expect("chunks_exact");
            for (i, &value) in chunk.iter().enumerate() {
                let x = to(value);
                squares[i] = squares[i] + x * x;
                tops[i] = larger(tops[i], x.magnitude());
            }
        }
        for &value in lanes.remainder() {
            let x = to(value);
            squares[0] = squares[0] + x * x;
            tops[0] = larger(tops[0], x.magnitude());
        }
        total += squares.iter().map(|&s| s.into()).sum::<f64>();
        top = tops.iter().fold(top, |m, &t| larger(m, t));
    }
    (total, top.into())
}

/// Sum of squares of `before - after`, element by element.
#[inline(always)]
fn diff_sumsq<T: Copy, A: Num>(before: &[T], after: &[T], to: impl Fn(T) -> A + Copy) -> f64 {
    let mut total = 0f64;
    for (old, new) in before.chunks(BLOCK).zip(after.chunks(BLOCK)) {
        let mut squares = [A::ZERO; LANES];
        let mut lanes = old.chunks_exact(LANES).zip(new.chunks_exact(LANES));
        for (a, b) in &mut lanes {
            let a: &[T; LANES] = a.try_into().expect("chunks_exact");
            let b: &[T; LANES] = b.try_into().expect("chunks_exact");
            for i in 0..LANES {
                let d = to(a[i]) - to(b[i]);
                squares[i] = squares[i] + d * d;
            }
        }
        let done = old.len() / LANES * LANES;
        for (&a, &b) in old[done..].iter().zip(&new[done..]) {
            let d = to(a) - to(b);
            squares[0] = squares[0] + d * d;
        }
        total += squares.iter().map(|&s| s.into()).sum::<f64>();
    }
    total
}

#[inline(always)]
fn half_bits(bits: u16) -> f32 {
    // The const conversion is plain arithmetic, inlined and vectorised;
    // `to_f32` asks the CPU for F16C at every element.
    half::f16::from_bits(bits).to_f32_const()
}

#[inline(always)]
fn bfloat_bits(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// # Safety
/// `ptr` holds `count` live elements of `T`, and stays alive and
/// unmoved for the returned slice's use (the caller holds the tensor and
/// the GIL).
unsafe fn slice<'a, T>(ptr: usize, count: usize) -> &'a [T] {
    if count == 0 {
        return &[];
    }
    unsafe { std::slice::from_raw_parts(ptr as *const T, count) }
}

/// (sum of squares, max |x|) of a tensor's values.
///
/// # Safety
/// As `slice`, for `view`.
unsafe fn stats_of(view: View) -> (f64, f64) {
    #[cfg(target_arch = "x86_64")]
    if wide() {
        return unsafe { stats_of_avx2(view) };
    }
    unsafe { stats_of_plain(view) }
}

/// # Safety
/// As `stats_of`, on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stats_of_avx2(view: View) -> (f64, f64) {
    unsafe { stats_of_plain(view) }
}

/// # Safety
/// As `slice`, for `view`.
#[inline(always)]
unsafe fn stats_of_plain(view: View) -> (f64, f64) {
    let (ptr, n) = (view.ptr, view.count);
    unsafe {
        match view.kind {
            Float::F32 => sumsq_max(slice::<f32>(ptr, n), |x| x),
            Float::F64 => sumsq_max(slice::<f64>(ptr, n), |x| x),
            Float::F16 => sumsq_max(slice::<u16>(ptr, n), half_bits),
            // bfloat16 reaches 3.4e38: its squares are summed in f64.
            Float::BF16 => sumsq_max(slice::<u16>(ptr, n), |b| f64::from(bfloat_bits(b))),
        }
    }
}

/// Sum of squares of `before - view`, `before` being a copy of a tensor of
/// the same kind and count.
///
/// # Safety
/// As `slice`, for `view` and for `before_ptr`.
unsafe fn diff_of(before_ptr: usize, view: View) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if wide() {
        return unsafe { diff_of_avx2(before_ptr, view) };
    }
    unsafe { diff_of_plain(before_ptr, view) }
}

/// # Safety
/// As `diff_of`, on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn diff_of_avx2(before_ptr: usize, view: View) -> f64 {
    unsafe { diff_of_plain(before_ptr, view) }
}

/// # Safety
/// As `diff_of`.
#[inline(always)]
unsafe fn diff_of_plain(before_ptr: usize, view: View) -> f64 {
    let (ptr, n) = (view.ptr, view.count);
    unsafe {
        match view.kind {
            Float::F32 => diff_sumsq(slice::<f32>(before_ptr, n), slice(ptr, n), |x: f32| x),
            Float::F64 => diff_sumsq(slice::<f64>(before_ptr, n), slice(ptr, n), |x: f64| x),
            Float::F16 => diff_sumsq(slice::<u16>(before_ptr, n), slice(ptr, n), half_bits),
            Float::BF16 => diff_sumsq(slice::<u16>(before_ptr, n), slice(ptr, n), bfloat_bits),
        }
    }
}

/// Reads past this many elements in all are made without the GIL: the
/// program's other threads (a data loader's, a heartbeat) run meanwhile.
/// The tensors are then read through `detach()`ed views, which hold their
/// storage even if the program swaps a parameter's `.data` in between.
const WITHOUT_GIL_OVER: usize = 1 << 20;

/// The weights' copy: pages of its own (`mmap`), so that freeing it gives
/// the memory back to the system at once, where a heap would keep it.
struct Pages {
    ptr: *mut u64,
    words: usize,
}

// Owned outright: its pages are reached only through this value.
unsafe impl Send for Pages {}
unsafe impl Sync for Pages {}

impl Pages {
    const fn none() -> Self {
        Pages {
            ptr: std::ptr::null_mut(),
            words: 0,
        }
    }

    /// Room for `words` words (what was there is not kept); false where
    /// the system gives no memory (nothing is copied then).
    fn make_room(&mut self, words: usize) -> bool {
        if words == self.words {
            return true;
        }
        self.free();
        if words == 0 {
            return true;
        }
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                words * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return false;
        }
        self.ptr = ptr.cast();
        self.words = words;
        true
    }

    fn free(&mut self) {
        if !self.ptr.is_null() {
            unsafe {
                libc::munmap(self.ptr.cast(), self.words * 8);
            }
        }
        // Fields, not `*self = ...`: that would drop (and free) the old
        // value again.
        self.ptr = std::ptr::null_mut();
        self.words = 0;
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        self.free();
    }
}

/// Norm and max |g| of gradients; then, around an optimizer step, the
/// weights' norms and copy (`keep`) and the update's norms (`update`).
/// One per optimizer: the copy is kept between sampled steps for a small
/// model (`release` frees it).
#[pyclass(module = "rankscope._native")]
pub struct GradRead {
    dtypes: Dtypes,
    /// The weights as they were at `keep`, each at a multiple of 8 bytes.
    kept: Pages,
    /// Each weight's view at `keep`, and where its copy starts in `kept`
    /// (in u64 words).
    views: Vec<(View, usize)>,
}

/// Tensors with where their values are, held for the reads.
type Views<'py> = Vec<(Bound<'py, PyAny>, View)>;

impl GradRead {
    /// Each tensor's view, or None where one cannot be read here; and
    /// whether the reads are long enough to make without the GIL (the
    /// tensors are then `detach()`ed views: see `WITHOUT_GIL_OVER`).
    fn views_of<'py>(&self, tensors: &Bound<'py, PyAny>) -> PyResult<Option<(Views<'py>, bool)>> {
        let mut out = Vec::new();
        let mut elements = 0usize;
        for tensor in tensors.try_iter()? {
            let tensor = tensor?;
            let Some(view) = self.dtypes.view(&tensor, usize::MAX)? else {
                return Ok(None);
            };
            elements = elements.saturating_add(view.count);
            out.push((tensor, view));
        }
        let free = elements > WITHOUT_GIL_OVER;
        if free {
            for (tensor, view) in &mut out {
                let held = tensor.call_method0(intern!(tensor.py(), "detach"))?;
                if self.dtypes.view(&held, usize::MAX)? != Some(*view) {
                    return Ok(None);
                }
                *tensor = held;
            }
        }
        Ok(Some((out, free)))
    }
}

/// `work`, without the GIL where `free`.
fn run<T: Send>(py: Python<'_>, free: bool, work: impl FnOnce() -> T + Send) -> T {
    if free {
        py.detach(work)
    } else {
        work()
    }
}

#[pymethods]
impl GradRead {
    #[new]
    fn new(dtypes: &Bound<'_, PyTuple>) -> PyResult<Self> {
        Ok(GradRead {
            dtypes: Dtypes::new(dtypes)?,
            kept: Pages::none(),
            views: Vec::new(),
        })
    }

    /// `(norms, max |g|)` of each tensor, or None where one cannot be read
    /// here (the caller asks torch). A NaN anywhere makes both NaN.
    fn norms(&self, tensors: &Bound<'_, PyAny>) -> PyResult<Option<(Vec<f64>, Vec<f64>)>> {
        let Some((views, free)) = self.views_of(tensors)? else {
            return Ok(None);
        };
        let plain: Vec<View> = views.iter().map(|(_, view)| *view).collect();
        let read = run(tensors.py(), free, || {
            plain
                .iter()
                .map(|view| {
                    let (sumsq, top) = unsafe { stats_of(*view) };
                    // Squares summed in f32 can round a norm just under the
                    // largest element, which a norm never is.
                    let norm = sumsq.sqrt();
                    (
                        if norm < top { top } else { norm },
                        if sumsq.is_nan() { f64::NAN } else { top },
                    )
                })
                .collect::<Vec<_>>()
        });
        drop(views);
        Ok(Some(read.into_iter().unzip()))
    }

    /// Returns the weights' norms and copies the weights into this object
    /// where they come to at most `cap` bytes (else nothing is kept, and
    /// `update` answers None); None where one cannot be read here.
    fn keep(&mut self, weights: &Bound<'_, PyAny>, cap: usize) -> PyResult<Option<Vec<f64>>> {
        self.views.clear();
        let Some((views, free)) = self.views_of(weights)? else {
            return Ok(None);
        };
        let mut words = 0;
        let mut placed = Vec::with_capacity(views.len());
        for (_, view) in &views {
            placed.push((*view, words));
            words += (view.count * view.kind.size()).div_ceil(8);
        }
        let py = weights.py();
        if words * 8 > cap || !self.kept.make_room(words) {
            self.kept.free();
            let norms = run(py, free, || {
                placed
                    .iter()
                    .map(|(view, _)| unsafe { stats_of(*view) }.0.sqrt())
                    .collect()
            });
            drop(views);
            return Ok(Some(norms));
        }
        // Reused between sampled steps: the same model needs the same size.
        let base = self.kept.ptr as usize;
        let norms = run(py, free, || {
            placed
                .iter()
                .map(|&(view, at)| {
                    let bytes = view.count * view.kind.size();
                    let into = base + at * 8;
                    if bytes > 0 {
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                view.ptr as *const u8,
                                into as *mut u8,
                                bytes,
                            );
                        }
                    }
                    // Read back from the copy just written (in cache).
                    unsafe { stats_of(View { ptr: into, ..view }) }.0.sqrt()
                })
                .collect()
        });
        drop(views);
        self.views = placed;
        Ok(Some(norms))
    }

    /// The norm of each weight's change since `keep`: None for a weight
    /// that is not the tensor it was (another storage, size or type), and
    /// None for all where nothing is kept.
    fn update(&self, weights: &Bound<'_, PyAny>) -> PyResult<Option<Vec<Option<f64>>>> {
        if self.views.is_empty() {
            return Ok(None);
        }
        let Some((views, free)) = self.views_of(weights)? else {
            return Ok(None);
        };
        if views.len() != self.views.len() {
            return Ok(None);
        }
        let base = self.kept.ptr as usize;
        let pairs: Vec<(View, View, usize)> = views
            .iter()
            .zip(&self.views)
            .map(|((_, now), &(then, at))| (*now, then, at))
            .collect();
        let out = run(weights.py(), free, || {
            pairs
                .iter()
                .map(|&(now, then, at)| {
                    (now == then).then(|| unsafe { diff_of(base + at * 8, then) }.sqrt())
                })
                .collect()
        });
        drop(views);
        Ok(Some(out))
    }

    /// Frees the copy (a model too large to keep one between steps).
    fn release(&mut self) {
        self.kept.free();
        self.views.clear();
    }

    /// Bytes held by the copy.
    #[getter]
    fn kept_bytes(&self) -> usize {
        self.kept.words * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_and_maxima_match_a_plain_loop_for_every_length() {
        for n in [0usize, 1, 15, 16, 17, 1023, 1024, 1025, 5000] {
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 13.0)
                .collect();
            let (sumsq, top) = sumsq_max(&values, |x: f32| x);
            let want: f64 = values.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let want_top = values.iter().fold(0f32, |m, &x| m.max(x.abs()));
            assert!(
                (sumsq - want).abs() <= want * 1e-5 + 1e-9,
                "{n}: {sumsq} vs {want}"
            );
            assert_eq!(top, f64::from(want_top), "{n}");
            let after: Vec<f32> = values.iter().map(|&x| x * 0.999).collect();
            let diff = diff_sumsq(&values, &after, |x: f32| x);
            let want_diff: f64 = values
                .iter()
                .zip(&after)
                .map(|(&a, &b)| f64::from(a - b) * f64::from(a - b))
                .sum();
            assert!((diff - want_diff).abs() <= want_diff * 1e-5 + 1e-12, "{n}");
        }
    }

    #[test]
    fn non_finite_values_show_in_the_sum() {
        let mut values = vec![1.0f32; 100];
        values[57] = f32::NAN;
        assert!(sumsq_max(&values, |x: f32| x).0.is_nan());
        values[57] = f32::NEG_INFINITY;
        let (sumsq, top) = sumsq_max(&values, |x: f32| x);
        assert!(sumsq.is_infinite() && top.is_infinite());
    }

    #[test]
    fn pages_are_given_back_and_made_again() {
        let mut pages = Pages::none();
        assert!(pages.make_room(1000));
        unsafe { *pages.ptr.add(999) = 7 };
        assert!(pages.make_room(1000) && unsafe { *pages.ptr.add(999) } == 7);
        assert!(pages.make_room(10) && pages.words == 10);
        pages.free();
        assert!(pages.ptr.is_null() && pages.words == 0);
        assert!(pages.make_room(0) && pages.ptr.is_null());
        drop(pages);
    }

    #[test]
    fn half_and_bfloat_widen_exactly() {
        // 0x3C00 is 1.0 and 0xC000 -2.0 in half; 0x3F80 1.0 and 0xC000 -2.0 in bfloat16.
        assert_eq!(sumsq_max(&[0x3C00u16, 0xC000], half_bits), (5.0, 2.0));
        assert_eq!(sumsq_max(&[0x3F80u16, 0xC000], bfloat_bits), (5.0, 2.0));
        assert_eq!(diff_sumsq(&[0x3C00u16], &[0xC000], half_bits), 9.0);
    }
}
