//! `rankscope PID repl`: line editing and history here, execution there.

use anyhow::Result;
use rankscope_core::protocol::EvalRequest;
use rustyline::error::ReadlineError;
use rustyline::DefaultEditor;

use crate::client::Probe;
use crate::FrameArgs;

fn history_file() -> Option<std::path::PathBuf> {
    std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".rankscope_history"))
}

pub fn run(probe: &Probe, timeout_s: f64, at: &FrameArgs) -> Result<u8> {
    let meta = probe.meta(std::time::Duration::from_secs(5))?;
    let request = |code: String| EvalRequest::new(code, timeout_s).at(at.thread.clone(), at.frame);
    let place = match request(String::new()) {
        // Nothing runs; a thread or frame that is not there ends the session
        // before it starts, and one that is says where it is.
        empty if empty.in_frame() => super::eval_at(probe, &empty)?.frame.unwrap_or_default(),
        _ => "its __main__".to_string(),
    };
    println!(
        "rankscope repl in PID {} (Python {}, rank {}); code runs in {place}. Ctrl-D leaves.",
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
                let check = probe.eval(&EvalRequest { check_only: true, ..request(buffer.clone()) })?;
                if check.incomplete {
                    continue;
                }
                let _ = editor.add_history_entry(buffer.as_str());
                let code = std::mem::take(&mut buffer);
                match super::eval_at(probe, &request(code)) {
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
