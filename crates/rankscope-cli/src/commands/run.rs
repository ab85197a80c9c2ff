//! `rankscope run -- CMD`: the probe starts in CMD and in its Python children
//! through the `.pth` hook, which reads RANKSCOPE from the inherited environment.

use std::os::unix::process::CommandExt;
use std::process::Command;

use anyhow::Result;

use crate::hint::Hinted;

pub fn run(listen: Option<String>, command: Vec<String>) -> Result<u8> {
    let (program, args) = command.split_first().expect("clap requires a command");
    let mut cmd = Command::new(program);
    cmd.args(args).env("RANKSCOPE", "1");
    if let Some(listen) = listen {
        cmd.env("RANKSCOPE_LISTEN", listen);
    }
    // exec only returns on failure.
    let err = cmd.exec();
    let hint = if err.kind() == std::io::ErrorKind::NotFound {
        format!("`{program}` is not on PATH; give its full path")
    } else {
        "check that the command can run without rankscope".to_string()
    };
    Err(Hinted::new(format!("cannot run {program}: {err}"), hint).into())
}
