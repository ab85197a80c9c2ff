//! Sampling profiles of Python processes.
//!
//! `sample` reads a process's stacks from outside at a fixed rate with
//! py-spy's library, without pausing it (py-spy's non-blocking mode; only
//! `native` pauses threads, to unwind them). Each sample is folded where it
//! is taken into a [`Profile`]: interned frames, interned stacks, and a count
//! per (thread, stack, idle, GIL). What leaves the sampler is that fold and,
//! for the Chrome trace, the runs of equal stacks per thread; never one
//! record per sample. `formats` writes the formats people open; `job`
//! merges the ranks of a job and sets one rank against the others; `table`
//! keeps a profile in the run store as `python.profile`.

pub mod formats;
pub mod job;
mod profile;
mod sampler;
pub mod table;

pub use job::JobProfile;
pub use profile::wire;
pub use profile::{FrameKey, FrameRef, Profile, Slice, StackKey, ThreadInfo};
pub use sampler::{is_probe_thread, sample, SampleOptions};

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read PID {pid}: {message}")]
    Read { pid: u32, message: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("unknown output format for {0}")]
    Format(String),
    #[error("flame graph: {0}")]
    FlameGraph(String),
    #[error("{0}")]
    Diff(String),
    #[error("{0}")]
    Wire(String),
}
