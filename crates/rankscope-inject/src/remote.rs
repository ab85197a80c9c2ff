//! Borrowing one thread of the target to call functions in it.
//!
//! The thread is seized and interrupted (the others keep running), its
//! registers are saved, and each call is made by pointing the instruction
//! pointer at the function with a return address of 0: the return faults,
//! the fault stops the thread for us, and we read the result. When the
//! `Hijack` is dropped, the bytes written below the stack pointer and the
//! registers are put back and the thread is released, on every path.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::InjectError;

/// Syscalls a thread makes while it may hold the allocator's lock: a thread
/// stopped in one of these is not borrowed, since the dlopen we make it run
/// allocates too.
const ALLOCATOR_SYSCALLS: [i64; 6] = [
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_munmap,
    libc::SYS_brk,
    libc::SYS_mremap,
    libc::SYS_madvise,
];

const DIRECTION_FLAG: u64 = 1 << 10;

/// Stack bytes left alone below the saved stack pointer: the x86-64 red
/// zone (128) with room to spare.
const STACK_GAP: u64 = 1024;

pub struct Hijack {
    pid: u32,
    tid: Pid,
    saved: libc::user_regs_struct,
    /// The thread's floating-point and vector registers (x87, MXCSR, SSE,
    /// AVX and up). The calls we make clobber them, and a thread taken in
    /// the middle of user code (not at a call or a syscall) may be using
    /// them: CPython's eval loop keeps values in xmm registers, and giving
    /// back only the general registers crashed it.
    saved_vector: Option<VectorState>,
    mem: File,
    /// Where our scratch bytes start, and what was there before.
    scratch: u64,
    original: Vec<u8>,
    used: u64,
    released: bool,
    /// True while the thread runs one of our calls.
    running: bool,
}

fn ptrace_error(pid: u32, tid: i32, errno: Errno) -> InjectError {
    match errno {
        Errno::ESRCH => InjectError::Exited(pid),
        Errno::EPERM | Errno::EACCES => InjectError::Denied {
            pid,
            tracer: tracer_of(pid, tid),
        },
        other => InjectError::Ptrace { pid, errno: other },
    }
}

/// The PID already tracing the thread (gdb, strace, py-spy ...), if any.
fn tracer_of(pid: u32, tid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("TracerPid:"))?;
    line.split_whitespace()
        .nth(1)?
        .parse()
        .ok()
        .filter(|&p| p != 0)
}

/// The syscall a thread sits in without stopping it, from `/proc`: None
/// when it is running in user space.
fn blocked_in(pid: u32, tid: i32) -> Option<i64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// The thread to borrow: one blocked in a syscall that is not the
/// allocator's (the main thread first), since a thread stopped in the middle
/// of user code may hold a lock that our dlopen needs.
pub fn choose_thread(pid: u32, wait: Duration) -> Result<i32, InjectError> {
    let deadline = Instant::now() + wait;
    loop {
        let mut tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map_err(|_| InjectError::NoProcess(pid))?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        tids.sort_by_key(|&t| (t != pid as i32, t));
        if let Some(&tid) = tids.iter().find(|&&t| matches!(blocked_in(pid, t), Some(nr) if nr >= 0 && !ALLOCATOR_SYSCALLS.contains(&nr))) {
            return Ok(tid);
        }
        if Instant::now() >= deadline {
            // Every thread is busy in user space: take the main thread at
            // whatever point it is at.
            return Ok(pid as i32);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Hijack {
    pub fn seize(pid: u32, tid: i32, timeout: Duration) -> Result<Hijack, InjectError> {
        let thread = Pid::from_raw(tid);
        ptrace::seize(thread, ptrace::Options::empty()).map_err(|e| ptrace_error(pid, tid, e))?;
        let mut hijack = Hijack {
            pid,
            tid: thread,
            // Filled in once stopped; until then there is nothing to restore.
            saved: unsafe { std::mem::zeroed() },
            mem: File::open("/dev/null").map_err(|e| InjectError::Io {
                what: "/dev/null".into(),
                source: e,
            })?,
            saved_vector: None,
            scratch: 0,
            original: Vec::new(),
            used: 0,
            released: true,
            running: false,
        };
        let detach_on_error = |h: &Hijack, e: InjectError| {
            let _ = ptrace::detach(h.tid, None);
            e
        };
        let deadline = Instant::now() + timeout;
        loop {
            if let Err(e) = hijack.stop(deadline) {
                return Err(detach_on_error(&hijack, e));
            }
            hijack.saved = match ptrace::getregs(thread) {
                Ok(r) => r,
                Err(e) => return Err(detach_on_error(&hijack, ptrace_error(pid, tid, e))),
            };
            if safe_to_borrow(pid, &hijack.saved) {
                break;
            }
            // Inside the C library or the loader, the thread may hold a lock
            // that dlopen takes (malloc's, the loader's, stdio's): let it run
            // on a little and look again. A thread that never leaves gives
            // a timeout and is left as it was, rather than a deadlock.
            if Instant::now() >= deadline {
                return Err(detach_on_error(&hijack, InjectError::Timeout(pid)));
            }
            if let Err(e) = ptrace::cont(thread, None) {
                return Err(detach_on_error(&hijack, ptrace_error(pid, tid, e)));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        hijack.saved_vector = match VectorState::read(thread) {
            Ok(state) => Some(state),
            Err(e) => return Err(detach_on_error(&hijack, ptrace_error(pid, tid, e))),
        };
        hijack.released = false;
        hijack.mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/task/{tid}/mem"))
            .map_err(|e| InjectError::Io {
                what: format!("/proc/{pid}/mem"),
                source: e,
            })?;
        hijack.scratch = (hijack.saved.rsp - STACK_GAP) & !0xf;
        Ok(hijack)
    }

    /// Interrupts the seized thread and waits for it to stop. A signal that
    /// arrives first is delivered as it would have been.
    fn stop(&mut self, deadline: Instant) -> Result<(), InjectError> {
        let (pid, tid) = (self.pid, self.tid.as_raw());
        ptrace::interrupt(self.tid).map_err(|e| ptrace_error(pid, tid, e))?;
        loop {
            match self.wait(deadline)? {
                WaitStatus::PtraceEvent(_, _, libc::PTRACE_EVENT_STOP) => return Ok(()),
                WaitStatus::Stopped(_, signal) => {
                    ptrace::cont(self.tid, signal).map_err(|e| ptrace_error(pid, tid, e))?;
                    ptrace::interrupt(self.tid).map_err(|e| ptrace_error(pid, tid, e))?;
                }
                _ => ptrace::cont(self.tid, None).map_err(|e| ptrace_error(pid, tid, e))?,
            }
        }
    }

    fn wait(&self, deadline: Instant) -> Result<WaitStatus, InjectError> {
        loop {
            match waitpid(self.tid, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {
                    if Instant::now() >= deadline {
                        return Err(InjectError::Timeout(self.pid));
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..))
                | Err(Errno::ECHILD | Errno::ESRCH) => return Err(InjectError::Exited(self.pid)),
                Ok(status) => return Ok(status),
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    return Err(InjectError::Ptrace {
                        pid: self.pid,
                        errno: e,
                    })
                }
            }
        }
    }

    /// Copies `bytes` (NUL-terminated by the caller where C wants a string)
    /// below the stack pointer; returns their address in the target.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> Result<u64, InjectError> {
        let len = (bytes.len() as u64 + 15) & !15;
        let addr = self.scratch - self.used - len;
        let mut before = vec![0u8; len as usize];
        self.mem
            .read_exact_at(&mut before, addr)
            .map_err(|e| self.memory_error(e))?;
        // Kept in address order, lowest first, so one write restores all.
        before.extend_from_slice(&self.original);
        self.original = before;
        self.mem
            .write_all_at(bytes, addr)
            .map_err(|e| self.memory_error(e))?;
        self.used += len;
        Ok(addr)
    }

    pub fn read_c_string(&self, addr: u64, max: usize) -> String {
        let mut buf = vec![0u8; max];
        let n = self.mem.read_at(&mut buf, addr).unwrap_or(0);
        buf.truncate(n);
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    }

    fn memory_error(&self, e: std::io::Error) -> InjectError {
        if !std::path::Path::new(&format!("/proc/{}", self.pid)).exists() {
            return InjectError::Exited(self.pid);
        }
        InjectError::Io {
            what: format!("/proc/{}/mem", self.pid),
            source: e,
        }
    }

    /// Calls `function(args...)` (System V x86-64, up to 6 integer
    /// arguments) on the borrowed thread and returns `rax`.
    pub fn call(
        &mut self,
        function: u64,
        args: &[u64],
        timeout: Duration,
    ) -> Result<u64, InjectError> {
        let (pid, tid) = (self.pid, self.tid.as_raw());
        let mut regs = self.saved;
        let stack = (self.scratch - self.used - 256) & !0xf;
        // A `call` pushes the return address, so at entry rsp % 16 == 8.
        let return_slot = stack - 8;
        self.mem
            .write_all_at(&0u64.to_ne_bytes(), return_slot)
            .map_err(|e| self.memory_error(e))?;
        regs.rsp = return_slot;
        regs.rip = function;
        regs.rax = 0;
        // The ABI wants the direction flag clear at every call.
        regs.eflags &= !DIRECTION_FLAG;
        // Not in a syscall any more: keeps the kernel from "restarting" one
        // by moving rip back when the thread resumes.
        regs.orig_rax = u64::MAX;
        let slots = [
            &mut regs.rdi,
            &mut regs.rsi,
            &mut regs.rdx,
            &mut regs.rcx,
            &mut regs.r8,
            &mut regs.r9,
        ];
        for (slot, value) in slots.into_iter().zip(args) {
            *slot = *value;
        }
        ptrace::setregs(self.tid, regs).map_err(|e| ptrace_error(pid, tid, e))?;
        ptrace::cont(self.tid, None).map_err(|e| ptrace_error(pid, tid, e))?;
        self.running = true;
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.wait(deadline)?;
            self.running = false;
            match status {
                WaitStatus::Stopped(_, Signal::SIGSEGV) => {
                    let now = ptrace::getregs(self.tid).map_err(|e| ptrace_error(pid, tid, e))?;
                    if now.rip == 0 {
                        return Ok(now.rax);
                    }
                    return Err(InjectError::Faulted {
                        pid,
                        address: now.rip,
                    });
                }
                // The target's own signals reach its handlers on top of our
                // call, which then goes on.
                WaitStatus::Stopped(_, signal) => {
                    ptrace::cont(self.tid, signal).map_err(|e| ptrace_error(pid, tid, e))?
                }
                _ => ptrace::cont(self.tid, None).map_err(|e| ptrace_error(pid, tid, e))?,
            }
            self.running = true;
        }
    }

    /// Puts the bytes and registers back and lets the thread go.
    pub fn release(mut self) -> Result<(), InjectError> {
        self.restore()
    }

    fn restore(&mut self) -> Result<(), InjectError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let (pid, tid) = (self.pid, self.tid.as_raw());
        if self.running {
            // A call that did not return in time is abandoned: the thread
            // must be stopped to get its registers back. Letting it run on
            // would end in a jump to address 0.
            self.running = false;
            let _ = ptrace::interrupt(self.tid);
            let deadline = Instant::now() + Duration::from_secs(2);
            while !matches!(
                self.wait(deadline),
                Ok(WaitStatus::PtraceEvent(..) | WaitStatus::Stopped(..)) | Err(_)
            ) {}
        }
        if !self.original.is_empty() {
            let start = self.scratch - self.used;
            let _ = self.mem.write_all_at(&self.original, start);
        }
        let vector = match &self.saved_vector {
            Some(state) => state.write(self.tid).map_err(|e| ptrace_error(pid, tid, e)),
            None => Ok(()),
        };
        let restored = ptrace::setregs(self.tid, self.saved).map_err(|e| ptrace_error(pid, tid, e));
        let restored = vector.and(restored);
        let detached = ptrace::detach(self.tid, None).map_err(|e| ptrace_error(pid, tid, e));
        restored.and(detached)
    }
}

/// Whether a thread stopped with these registers can run our calls: not in
/// one of the allocator's syscalls, and, when stopped in user code, not
/// inside the C library or the dynamic loader.
fn safe_to_borrow(pid: u32, regs: &libc::user_regs_struct) -> bool {
    let syscall = regs.orig_rax as i64;
    if syscall >= 0 {
        return !ALLOCATOR_SYSCALLS.contains(&syscall);
    }
    match crate::maps::file_at(pid, regs.rip) {
        Some(path) => {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            !LOCKING_LIBRARIES
                .iter()
                .any(|prefix| name.starts_with(prefix))
        }
        None => true,
    }
}

/// Libraries whose code may run with a lock held that dlopen also takes.
const LOCKING_LIBRARIES: [&str; 6] = [
    "libc.so",
    "libc-2.",
    "ld-linux",
    "ld-musl",
    "libpthread",
    "libdl",
];

/// The thread's extended register state, as the kernel hands it out: the
/// whole XSAVE area where the kernel has it (AVX and later included), else
/// the 512-byte FXSAVE area.
struct VectorState {
    note: libc::c_int,
    bytes: Vec<u8>,
}

/// `NT_X86_XSTATE` from the kernel's elf.h; the libc crate lacks it.
const NT_X86_XSTATE: libc::c_int = 0x202;
/// Larger than any XSAVE area so far (AMX tiles take it near 11 KiB).
const XSTATE_MAX: usize = 32 * 1024;

impl VectorState {
    fn read(tid: Pid) -> Result<VectorState, Errno> {
        let mut last = Errno::EINVAL;
        for (note, size) in [(NT_X86_XSTATE, XSTATE_MAX), (libc::NT_PRFPREG, 512)] {
            let mut bytes = vec![0u8; size];
            match regset(libc::PTRACE_GETREGSET, tid, note, &mut bytes) {
                Ok(len) => {
                    bytes.truncate(len);
                    return Ok(VectorState { note, bytes });
                }
                Err(Errno::ESRCH) => return Err(Errno::ESRCH),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn write(&self, tid: Pid) -> Result<(), Errno> {
        let mut bytes = self.bytes.clone();
        regset(libc::PTRACE_SETREGSET, tid, self.note, &mut bytes).map(drop)
    }
}

/// `PTRACE_GETREGSET` / `PTRACE_SETREGSET` of one note; returns the length
/// the kernel read or wrote.
fn regset(
    request: libc::c_uint,
    tid: Pid,
    note: libc::c_int,
    bytes: &mut [u8],
) -> Result<usize, Errno> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_mut_ptr().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: the kernel reads or writes at most iov_len bytes of `bytes`,
    // and stores the length it used back into iov_len.
    let rc = unsafe {
        libc::ptrace(
            request,
            tid.as_raw(),
            note as usize as *mut libc::c_void,
            &mut iov as *mut libc::iovec,
        )
    };
    Errno::result(rc).map(|_| iov.iov_len)
}

impl Drop for Hijack {
    fn drop(&mut self) {
        let _ = self.restore();
    }
}
