//! A tensor's metadata read through torch's C functions instead of its
//! Python API: the `aoti_torch_*` shim that AOTInductor's compiled models
//! call, made to stay stable across torch releases, found in the
//! libtorch_cpu the program has loaded.
//!
//! The NaN watch reads a few small tensors at every step (finite.rs), and
//! each of its questions through Python (`dtype`, `layout`, `is_cpu`,
//! `is_contiguous()`, `numel()`, `dim()`, `size(0)`) is a call through
//! torch's argument parser and error guards: about 4,000 instructions a
//! tensor in all, most of what the check cost a small model's step. Here
//! one attribute read (`_cdata`, the tensor's `TensorImpl`) and a few C
//! calls answer them. `data_ptr()` is still asked of Python: for a tensor
//! with no storage (a functorch or functionalization wrapper that Python
//! sees as a plain `Tensor`) the shim's version throws, and the shim then
//! writes the error to the program's stderr; Python's raises instead.
//!
//! The shim takes an `at::Tensor*`; an `at::Tensor` is one
//! `intrusive_ptr<TensorImpl>`, that is one pointer, so the address of a
//! word holding the `TensorImpl*` is one. Nothing here takes or drops a
//! reference: the caller holds the Python tensor, which holds the
//! `TensorImpl`, for every call.
//!
//! Any symbol missing (a torch without the shim, or without
//! `aoti_torch_is_contiguous`) leaves the Python way in use.

use std::ffi::{c_char, c_void, CString};
use std::sync::OnceLock;

use crate::finite::Float;

type Handle = *const c_void;
type Get32 = unsafe extern "C" fn(Handle, *mut i32) -> i32;
type Get64 = unsafe extern "C" fn(Handle, *mut i64) -> i32;
type GetBool = unsafe extern "C" fn(Handle, *mut bool) -> i32;
type GetSize = unsafe extern "C" fn(Handle, i64, *mut i64) -> i32;
type Code = unsafe extern "C" fn() -> i32;

pub(crate) struct Abi {
    device_type: Get32,
    layout: Get32,
    dtype: Get32,
    is_contiguous: GetBool,
    numel: Get64,
    dim: Get64,
    size: GetSize,
    cpu: i32,
    strided: i32,
    floats: [(i32, Float); 4],
}

/// What `Abi::contiguous_cpu_float` found: the element type and count.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Meta {
    pub kind: Float,
    pub count: usize,
}

/// The shim, looked up once per process (None: the Python way).
pub(crate) fn abi() -> Option<&'static Abi> {
    static ABI: OnceLock<Option<Abi>> = OnceLock::new();
    ABI.get_or_init(|| unsafe { Abi::load() }).as_ref()
}

/// The path of the libtorch_cpu this process has mapped, from its maps
/// (torch's wheel keeps it under torch/lib, conda's under the prefix).
fn loaded_libtorch() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .map(str::to_owned)
}

impl Abi {
    /// # Safety
    /// Calls the shim's constant functions (dtype and device codes), which
    /// take nothing and cannot fail.
    unsafe fn load() -> Option<Abi> {
        let path = CString::new(loaded_libtorch()?).ok()?;
        // RTLD_NOLOAD: only a library already loaded (torch imported), so
        // nothing of the program's is loaded or run by this. The handle
        // is kept: torch is never unloaded.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if lib.is_null() {
            return None;
        }
        let sym = |name: &str| -> Option<*mut c_void> {
            let name = CString::new(name).ok()?;
            let found = unsafe { libc::dlsym(lib, name.as_ptr() as *const c_char) };
            (!found.is_null()).then_some(found)
        };
        // The symbols' C types are the shim's header's (shim.h).
        let code = |name: &str| -> Option<i32> {
            let f: Code = unsafe { std::mem::transmute(sym(name)?) };
            Some(unsafe { f() })
        };
        Some(Abi {
            device_type: unsafe {
                std::mem::transmute::<*mut c_void, Get32>(sym("aoti_torch_get_device_type")?)
            },
            layout: unsafe {
                std::mem::transmute::<*mut c_void, Get32>(sym("aoti_torch_get_layout")?)
            },
            dtype: unsafe {
                std::mem::transmute::<*mut c_void, Get32>(sym("aoti_torch_get_dtype")?)
            },
            is_contiguous: unsafe {
                std::mem::transmute::<*mut c_void, GetBool>(sym("aoti_torch_is_contiguous")?)
            },
            numel: unsafe {
                std::mem::transmute::<*mut c_void, Get64>(sym("aoti_torch_get_numel")?)
            },
            dim: unsafe { std::mem::transmute::<*mut c_void, Get64>(sym("aoti_torch_get_dim")?) },
            size: unsafe {
                std::mem::transmute::<*mut c_void, GetSize>(sym("aoti_torch_get_size")?)
            },
            cpu: code("aoti_torch_device_type_cpu")?,
            strided: code("aoti_torch_layout_strided")?,
            floats: [
                (code("aoti_torch_dtype_float32")?, Float::F32),
                (code("aoti_torch_dtype_float64")?, Float::F64),
                (code("aoti_torch_dtype_float16")?, Float::F16),
                (code("aoti_torch_dtype_bfloat16")?, Float::BF16),
            ],
        })
    }

    /// The element type and count of the tensor whose `TensorImpl` is at
    /// `tensor_impl`, where it is a contiguous, strided CPU tensor of one of
    /// the four float types; None for any other, or where a call failed.
    /// Asked in an order in which no call can throw on a tensor an earlier
    /// answer let through (a sparse tensor's contiguity throws: its layout
    /// is asked first).
    ///
    /// # Safety
    /// `tensor_impl` is the `_cdata` of a plain `torch.Tensor` (or
    /// `Parameter`) that the caller holds for the call.
    pub(crate) unsafe fn contiguous_cpu_float(&self, tensor_impl: usize) -> Option<Meta> {
        let handle = &tensor_impl as *const usize as Handle;
        let mut code = 0i32;
        unsafe {
            if (self.device_type)(handle, &mut code) != 0 || code != self.cpu {
                return None;
            }
            if (self.layout)(handle, &mut code) != 0 || code != self.strided {
                return None;
            }
            if (self.dtype)(handle, &mut code) != 0 {
                return None;
            }
            let &(_, kind) = self.floats.iter().find(|(c, _)| *c == code)?;
            let mut contiguous = false;
            if (self.is_contiguous)(handle, &mut contiguous) != 0 || !contiguous {
                return None;
            }
            let mut count = 0i64;
            if (self.numel)(handle, &mut count) != 0 {
                return None;
            }
            Some(Meta {
                kind,
                count: usize::try_from(count).ok()?,
            })
        }
    }

    /// The size of the first dimension of a tensor of two or more (None
    /// for fewer), as `contiguous_cpu_float` takes `tensor_impl`.
    ///
    /// # Safety
    /// As `contiguous_cpu_float`.
    pub(crate) unsafe fn rows(&self, tensor_impl: usize) -> Option<usize> {
        let handle = &tensor_impl as *const usize as Handle;
        let mut value = 0i64;
        unsafe {
            if (self.dim)(handle, &mut value) != 0 || value < 2 {
                return None;
            }
            if (self.size)(handle, 0, &mut value) != 0 {
                return None;
            }
        }
        usize::try_from(value).ok()
    }
}
