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

/// An error and its causes as one line, each reason once: an error that
/// prints its source in its own message and also returns it (py-spy's I/O
/// errors) would otherwise repeat it.
pub fn reasons(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let reason = e.to_string();
        if !text.ends_with(&reason) {
            text = format!("{text}: {reason}");
        }
        cause = e.source();
    }
    text
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read PID {pid}: {message}")]
    Read { pid: u32, message: String },
    // The reason is in the message, so it is not also the source: a chain
    // printed in full would say it twice.
    #[error("cannot write {path}: {error}")]
    Write { path: String, error: std::io::Error },
    #[error("unknown output format for {0}")]
    Format(String),
    #[error("flame graph: {0}")]
    FlameGraph(String),
    #[error("{0}")]
    Diff(String),
    #[error("{0}")]
    Wire(String),
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Echo(#[from] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("no executable name")]
    struct Context(#[source] Echo);

    #[test]
    fn a_reason_its_error_prints_and_returns_is_said_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let text = super::reasons(&Context(Echo(io)));
        assert_eq!(text, "no executable name: entity not found");
    }
}
