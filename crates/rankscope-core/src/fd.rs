//! A descriptor the program may close under the probe. Daemon code closes
//! every descriptor from 3 up (`os.closerange`, python-daemon), and the
//! program's next `open()` takes the same numbers: written through or
//! closed by number after that, a run store file's Arrow batches went into
//! the program's log, and a stopping probe's wake-up byte into another of
//! its files. A `Guarded` descriptor remembers what it was opened on
//! (device and inode, which `fstat` reads without touching the file), is
//! used only while the number still names that, and is never closed once
//! it does not: the number is the program's then.

use std::os::fd::{AsRawFd, IntoRawFd, RawFd};

/// Device and inode of what `fd` names now; None where it names nothing.
pub fn identity(fd: RawFd) -> Option<(u64, u64)> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a whole `stat` into the buffer where it returns 0.
    let rc = unsafe { libc::fstat(fd, stat.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: fstat succeeded, so the struct is initialised.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::unnecessary_cast)] // u32 and u64 on other targets
    Some((stat.st_dev as u64, stat.st_ino as u64))
}

pub struct Guarded<T: AsRawFd + IntoRawFd> {
    inner: Option<T>,
    id: Option<(u64, u64)>,
}

impl<T: AsRawFd + IntoRawFd> Guarded<T> {
    pub fn new(inner: T) -> Self {
        let id = identity(inner.as_raw_fd());
        Guarded {
            inner: Some(inner),
            id,
        }
    }

    /// Whether the descriptor still names what it was opened on.
    pub fn ours(&self) -> bool {
        match &self.inner {
            Some(inner) => self.id.is_some() && identity(inner.as_raw_fd()) == self.id,
            None => false,
        }
    }

    /// The descriptor, to use right after `ours()` said yes.
    pub fn get(&self) -> &T {
        self.inner.as_ref().expect("held until dropped")
    }

    pub fn get_mut(&mut self) -> &mut T {
        self.inner.as_mut().expect("held until dropped")
    }
}

impl<T: AsRawFd + IntoRawFd> Drop for Guarded<T> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            if self.id.is_some() && identity(inner.as_raw_fd()) == self.id {
                drop(inner);
            } else {
                // The number is the program's now, or no one's: not closed.
                let _ = inner.into_raw_fd();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_descriptor_the_program_closed_and_opened_again_is_not_ours() {
        let dir = std::env::temp_dir().join(format!("rankscope-fd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ours = std::fs::File::create(dir.join("ours")).unwrap();
        let fd = ours.as_raw_fd();
        let guarded = Guarded::new(ours);
        assert!(guarded.ours());
        // The program's closerange, then its own open, which takes the
        // number (put there with dup2, as other tests open files meanwhile).
        let theirs = std::fs::File::create(dir.join("theirs")).unwrap();
        assert_eq!(unsafe { libc::dup2(theirs.as_raw_fd(), fd) }, fd);
        assert!(!guarded.ours());
        drop(guarded);
        // Not closed by the drop: the number still writes to their file.
        let mut again = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        again.write_all(b"still open").unwrap();
        assert_eq!(std::fs::read(dir.join("theirs")).unwrap(), b"still open");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
