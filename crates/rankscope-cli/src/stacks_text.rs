//! `bt` as people read it: one block per thread, innermost frame first.
//! Each Python frame carries its number (`#N`), the depth that
//! `eval --frame N` and `python.backtrace` use; native frames are not
//! numbered, since no code can run in them.

use std::fmt::Write;

use rankscope_core::protocol::{ProcessMeta, StacksReply, ThreadStack};

fn thread_title(thread: &ThreadStack) -> String {
    let name = if thread.name.is_empty() {
        "<no name>"
    } else {
        &thread.name
    };
    let mut tags = Vec::new();
    if thread.is_main {
        tags.push("main".to_string());
    }
    if thread.daemon {
        tags.push("daemon".to_string());
    }
    if thread.holds_gil == Some(true) {
        tags.push("holds the GIL".to_string());
    }
    if let Some(native) = thread.native_id {
        tags.push(format!("tid {native}"));
    }
    let tags = if tags.is_empty() {
        String::new()
    } else {
        format!(" ({})", tags.join(", "))
    };
    format!("Thread {:#x} \"{name}\"{tags}", thread.thread_id)
}

pub fn render(meta: &ProcessMeta, stacks: &StacksReply) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Process {}: {}  [rank {}, Python {}]",
        meta.pid,
        meta.cmdline.join(" "),
        meta.rank,
        meta.python_version
    );
    if stacks.threads.is_empty() {
        let _ = writeln!(out, "\n(no Python threads are running)");
    }
    for thread in &stacks.threads {
        let _ = writeln!(out, "\n{}", thread_title(thread));
        let mut depth = 0;
        for frame in &thread.frames {
            let name = if frame.qualname.is_empty() {
                &frame.func
            } else {
                &frame.qualname
            };
            match &frame.native_module {
                // Native frames: the library, and the source line when its
                // debug information has one.
                Some(module) if frame.lineno > 0 && frame.file != *module => {
                    let _ = writeln!(
                        out,
                        "    [native] {name} ({}:{}) in {}",
                        frame.file,
                        frame.lineno,
                        short_module(module)
                    );
                }
                Some(module) => {
                    let _ = writeln!(out, "    [native] {name} in {}", short_module(module));
                }
                None => {
                    let _ = writeln!(
                        out,
                        "  #{depth:<2} {name} ({}:{})",
                        frame.file, frame.lineno
                    );
                    depth += 1;
                }
            }
            if let Some(locals) = &frame.locals {
                for local in locals {
                    let _ = writeln!(
                        out,
                        "        {} = {}",
                        local.name,
                        indent_continuation(&local.repr)
                    );
                }
            }
        }
    }
    out
}

fn short_module(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Multi-line reprs stay inside their frame's block.
fn indent_continuation(text: &str) -> String {
    text.replace('\n', "\n          ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_core::protocol::{Frame, Local};

    #[test]
    fn threads_frames_and_locals_are_laid_out_innermost_first() {
        let meta = ProcessMeta {
            pid: 9,
            ppid: 1,
            host: "h".into(),
            rank: 0,
            local_rank: 0,
            world_size: 1,
            cmdline: vec!["python".into(), "t.py".into()],
            exe: String::new(),
            cwd: String::new(),
            python_version: "3.11.7".into(),
            started_at: 0.0,
            process_started_at: None,
            rankscope_version: "0".into(),
            protocol: 1,
            tcp: None,
            job_id: None,
            step_address: None,
        };
        let stacks = StacksReply {
            taken_at: 0.0,
            threads: vec![ThreadStack {
                thread_id: 255,
                native_id: Some(77),
                name: "MainThread".into(),
                daemon: false,
                is_main: true,
                holds_gil: None,
                frames: vec![
                    Frame {
                        func: "inner".into(),
                        qualname: "Model.inner".into(),
                        file: "t.py".into(),
                        lineno: 3,
                        locals: Some(vec![Local {
                            name: "x".into(),
                            repr: "1".into(),
                            type_name: "int".into(),
                        }]),
                        native_module: None,
                    },
                    Frame {
                        func: "<module>".into(),
                        qualname: "".into(),
                        file: "t.py".into(),
                        lineno: 9,
                        locals: None,
                        native_module: None,
                    },
                ],
            }],
            counts: None,
        };
        let text = render(&meta, &stacks);
        let expected = "Process 9: python t.py  [rank 0, Python 3.11.7]\n\n\
                        Thread 0xff \"MainThread\" (main, tid 77)\n  \
                        #0  Model.inner (t.py:3)\n        x = 1\n  #1  <module> (t.py:9)\n";
        assert_eq!(text, expected);
    }
}
