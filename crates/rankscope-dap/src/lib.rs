//! `rankscope dap`: the Debug Adapter Protocol that editors speak (VSCode,
//! nvim-dap, Emacs dape, Helix, Zed), translated into the probe's
//! `POST /v1/debug` operations.
//!
//! The crate knows nothing of how a probe is reached: the CLI gives it a
//! [`Backend`], and tests give it a fake one.

pub mod adapter;
pub mod framing;
mod ids;
pub mod paths;

pub use adapter::{serve, Backend, BackendError, Ending, Options, Target, LAUNCH_REFUSED};
pub use framing::{FramingError, MessageReader, DEFAULT_MAX_MESSAGE};
pub use paths::PathMap;

#[cfg(test)]
mod tests;
