//! The editor's long poll for debug events waits here, in Rust, outside
//! the GIL and outside `gil::attach`.
//!
//! A request that sits in `gil::attach` counts as one that wants the GIL:
//! a poll that waited in Python (on a condition, the GIL released) looked
//! to the nudger like a request starved of the GIL, and the main thread
//! was asked to step aside again and again for nothing (measured: +5 % on
//! a call-heavy loop on 3.13 with an editor attached). So the helper is
//! asked without waiting, and between two asks the request waits on this
//! counter, which the session bumps whenever it posts an event or ends.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

use pyo3::prelude::*;

static POSTS: Mutex<u64> = Mutex::new(0);
static POSTED: Condvar = Condvar::new();

/// Called by `rankscope._probe.debugger` after it posts an event.
#[pyfunction]
pub fn debug_posted() {
    let mut posts = POSTS.lock().unwrap_or_else(|e| e.into_inner());
    *posts += 1;
    POSTED.notify_all();
}

pub fn generation() -> u64 {
    *POSTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Until something was posted after `seen`, or `until`.
pub fn wait_for_post(seen: u64, until: Instant) {
    let mut posts = POSTS.lock().unwrap_or_else(|e| e.into_inner());
    while *posts == seen {
        let now = Instant::now();
        if now >= until {
            return;
        }
        posts = POSTED
            .wait_timeout(posts, until - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}
