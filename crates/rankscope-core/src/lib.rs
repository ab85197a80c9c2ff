//! Types shared by the probe (inside the target) and the CLI (the user's side).
//!
//! Nothing here knows about Python or SQL engines: the probe crate adds the
//! Python side, the query crate the SQL side.

pub mod crash;
pub mod fd;
pub mod host;
pub mod http;
pub mod paths;
pub mod protocol;
pub mod ranks;
pub mod secrets;
pub mod tables;

/// Version of the wire protocol; a CLI refuses probes that speak another one.
pub const PROTOCOL_VERSION: u32 = 1;
/// Version of this build, reported by probes so mixed installs can be spotted.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
