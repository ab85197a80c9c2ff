//! Errors that tell the user what to do next.

use std::fmt;

/// An error with a hint, printed as `error: ...` then `hint: ...`.
#[derive(Debug)]
pub struct Hinted {
    pub message: String,
    pub hint: String,
}

impl Hinted {
    pub fn new(message: impl Into<String>, hint: impl Into<String>) -> Self {
        Hinted {
            message: message.into(),
            hint: hint.into(),
        }
    }
}

impl fmt::Display for Hinted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Hinted {}

/// Prints an error the way every command does, and returns the exit code.
pub fn report(err: &anyhow::Error) -> i32 {
    match err.downcast_ref::<Hinted>() {
        Some(h) => {
            eprintln!("error: {}", h.message);
            eprintln!("hint: {}", h.hint);
        }
        None => eprintln!("error: {err:#}"),
    }
    1
}
