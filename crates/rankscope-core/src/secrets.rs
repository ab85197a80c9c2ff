//! Which environment values must never leave the target in clear.

const SECRET_MARKERS: &[&str] = &[
    "TOKEN",
    "KEY",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "AUTH",
    "COOKIE",
];

/// Shown instead of a secret's value.
pub const HIDDEN: &str = "<hidden>";

/// True when a variable's name suggests its value is a secret.
/// Deliberately broad: hiding a harmless value costs little, leaking a key a lot.
pub fn looks_secret(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    SECRET_MARKERS.iter().any(|m| upper.contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_secret_names_are_caught_case_insensitively() {
        for name in [
            "HF_TOKEN",
            "aws_secret_access_key",
            "DB_PASSWORD",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "WANDB_API_KEY",
        ] {
            assert!(looks_secret(name), "{name}");
        }
    }

    #[test]
    fn ordinary_names_are_shown() {
        for name in ["PATH", "RANK", "WORLD_SIZE", "MASTER_ADDR", "HOME"] {
            assert!(!looks_secret(name), "{name}");
        }
    }
}
