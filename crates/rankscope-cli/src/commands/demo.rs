//! `rankscope demo`: runs the bundled sample (`python -m rankscope.demo`)
//! under the probe and shows each command's real output on it.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::hint::Hinted;

const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Kills the sample when the demo ends, however it ends.
struct Sample(Child);

impl Drop for Sample {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn find_python(explicit: Option<PathBuf>) -> PathBuf {
    if let Some(python) =
        explicit.or_else(|| std::env::var_os("RANKSCOPE_PYTHON").map(PathBuf::from))
    {
        return python;
    }
    // Installed by pip, the CLI sits next to the interpreter that has the package.
    if let Some(bin) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(PathBuf::from))
    {
        for name in ["python", "python3"] {
            let candidate = bin.join(name);
            if candidate.exists() {
                return candidate;
            }
        }
    }
    PathBuf::from("python3")
}

pub fn run(python: Option<PathBuf>) -> Result<u8> {
    let python = find_python(python);
    let mut child = Command::new(&python)
        .args(["-u", "-m", "rankscope.demo"])
        .env("RANKSCOPE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| {
            Hinted::new(
                format!("cannot start {}: {e}", python.display()),
                "pass --python /path/to/python",
            )
        })?;
    let stdout = child.stdout.take().expect("piped");
    let sample = Sample(child);
    let pid = sample.0.id();

    // The sample prints READY once its probe listens and its state is set up.
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.trim() == "READY" {
                let _ = ready_tx.send(());
            }
        }
    });
    ready_rx.recv_timeout(READY_TIMEOUT).map_err(|_| {
        Hinted::new(
            format!(
                "the sample program (PID {pid}) did not get ready in {}s",
                READY_TIMEOUT.as_secs()
            ),
            format!(
                "check that `{} -c 'import rankscope'` works",
                python.display()
            ),
        )
    })?;

    let me = std::env::current_exe().context("cannot find the rankscope executable")?;
    let pid_s = pid.to_string();
    let steps: Vec<(&str, Vec<&str>)> = vec![
        ("Which processes have a probe?", vec!["list"]),
        ("Every thread's stack, at the line running now", vec![&pid_s, "bt"]),
        ("The same, with each frame's locals", vec![&pid_s, "bt", "--locals"]),
        ("Run code inside the process", vec![&pid_s, "eval", "print('hello from inside'); len(model_cfg), model_cfg['lr']"]),
        ("Errors come back as tracebacks", vec![&pid_s, "eval", "1 / step_zero"]),
        ("The tables you can query", vec![&pid_s, "query", "SHOW TABLES"]),
        (
            "SQL over the live stacks",
            vec![&pid_s, "query", "SELECT thread_name, depth, func, file, lineno FROM python.backtrace WHERE depth < 3 ORDER BY thread_name, depth"],
        ),
        ("Secrets in the environment stay hidden", vec![&pid_s, "query", "SELECT name, value FROM process.env WHERE name LIKE 'DEMO%' ORDER BY name"]),
        ("A breakpoint that records and goes on: the next 3 calls of forward()", vec![&pid_s, "break", "add", "demo.py:forward", "--max", "3"]),
        ("What it recorded (the program never stopped)", vec![&pid_s, "snapshots"]),
    ];
    println!("rankscope demo: a sample training loop runs as PID {pid} with the probe on.\n");
    for (title, args) in steps {
        if args.get(1) == Some(&"snapshots") {
            wait_for_hits(&me, &pid_s, 3);
        }
        println!("# {title}");
        let shown: Vec<String> = args
            .iter()
            .map(|a| {
                if a.contains(' ') {
                    format!("\"{a}\"")
                } else {
                    a.to_string()
                }
            })
            .collect();
        println!("$ rankscope {}", shown.join(" "));
        let status = Command::new(&me)
            .args(&args)
            .status()
            .context("cannot run rankscope")?;
        if !status.success() && !args.contains(&"1 / step_zero") {
            anyhow::bail!("`rankscope {}` failed in the demo", args.join(" "));
        }
        println!();
    }
    println!("That was the sample; the demo stops it now. On your own program:");
    println!("    RANKSCOPE=1 python train.py      # or: rankscope run -- python train.py");
    println!("    rankscope list                   # then: rankscope PID bt | eval | repl | query | break | watch");
    drop(sample);
    Ok(0)
}

/// The sample calls forward() every 50 ms: give the breakpoint its hits
/// (at most 5 s) before showing them.
fn wait_for_hits(me: &std::path::Path, pid: &str, hits: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        let out = Command::new(me)
            .args([pid, "snapshots", "--format", "json"])
            .output();
        let recorded = out
            .ok()
            .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
            .and_then(|v| v.as_array().map(Vec::len))
            .unwrap_or(0);
        if recorded >= hits {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
