//! `rankscope PID repl`: line editing and history here, execution there.

use anyhow::Result;
use rankscope_core::protocol::EvalRequest;
use rustyline::error::ReadlineError;
use rustyline::DefaultEditor;

use crate::client::Probe;

fn history_file() -> Option<std::path::PathBuf> {
    std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".rankscope_history"))
}

pub fn run(probe: &Probe, timeout_s: f64) -> Result<u8> {
    let meta = probe.meta(std::time::Duration::from_secs(5))?;
    println!(
        "rankscope repl in PID {} (Python {}, rank {}); code runs in its __main__. Ctrl-D leaves.",
        meta.pid, meta.python_version, meta.rank
    );
    let mut editor = DefaultEditor::new()?;
    let history = history_file();
    if let Some(path) = &history {
        let _ = editor.load_history(path);
    }
    let mut buffer = String::new();
    loop {
        let prompt = if buffer.is_empty() { ">>> " } else { "... " };
        match editor.readline(prompt) {
            Ok(line) => {
                if buffer.is_empty() && line.trim().is_empty() {
                    continue;
                }
                if !buffer.is_empty() {
                    buffer.push('\n');
                }
                buffer.push_str(&line);
                let check = probe.eval(&EvalRequest { code: buffer.clone(), timeout_s, check_only: true })?;
                if check.incomplete {
                    continue;
                }
                let _ = editor.add_history_entry(buffer.as_str());
                let code = std::mem::take(&mut buffer);
                match probe.eval(&EvalRequest { code, timeout_s, check_only: false }) {
                    Ok(reply) => {
                        super::print_eval(&reply);
                    }
                    Err(err) => {
                        crate::hint::report(&err);
                    }
                }
            }
            Err(ReadlineError::Interrupted) => {
                buffer.clear();
                println!("KeyboardInterrupt");
            }
            Err(ReadlineError::Eof) => break,
            Err(err) => return Err(err.into()),
        }
    }
    if let Some(path) = &history {
        let _ = editor.save_history(path);
    }
    Ok(0)
}
