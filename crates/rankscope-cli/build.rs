// A position-dependent executable: the dynamic loader then has no relative
// relocations to apply at start (about 200,000 for this binary, over 1,000
// copy-on-write page faults), which is most of `rankscope`'s start-up time.
// Only the final link changes; the crates stay position-independent.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bins=-no-pie");
    }
}
