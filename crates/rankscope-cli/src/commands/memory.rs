//! `rankscope PID memory ...`: the process's memory now, and allocation
//! sites. The work is the probe's (`rankscope._probe.memory`, and
//! `_probe/torch/tensors.py` for the tensors); this file asks and prints.

use anyhow::Result;
use serde_json::{json, Value};

use crate::client::Probe;
use crate::hint::Hinted;
use crate::{BtFormat, MemoryAction, Switch};

pub fn request_of(action: Option<&MemoryAction>, top: usize) -> Value {
    match action {
        None => json!({"action": "summary", "top": top}),
        Some(MemoryAction::Track {
            switch,
            python,
            cuda,
        }) => json!({
            "action": "track", "switch": if *switch == Switch::On { "on" } else { "off" }, "python": python, "cuda": cuda,
        }),
        Some(MemoryAction::Diff { .. }) => json!({"action": "diff", "top": top}),
        Some(MemoryAction::Export { what, path }) => {
            // The probe writes it: a relative path is the CLI's, made absolute here.
            let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
            json!({"action": "export", "what": what, "path": path})
        }
    }
}

/// `A..B` -> (A, B).
fn span(text: &str) -> Result<(u64, u64)> {
    let parsed = text
        .split_once("..")
        .and_then(|(a, b)| Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?)));
    match parsed {
        Some((a, b)) if a < b => Ok((a, b)),
        _ => Err(Hinted::new(
            format!("--steps {text} is not a span of steps"),
            "e.g. --steps 100..200: from the end of step 100 to the end of step 200",
        )
        .into()),
    }
}

/// `memory diff --steps A..B`: arms the span, then asks again until the
/// training has passed step B (the probe's snapshots are taken by the
/// training thread at the two boundaries).
fn diff_steps(probe: &Probe, text: &str, wait: f64, top: usize) -> Result<Value> {
    let (first, last) = span(text)?;
    let request = json!({"action": "diff", "steps": [first, last], "top": top});
    let deadline = std::time::Instant::now()
        + std::time::Duration::from_secs_f64(if wait.is_finite() {
            wait.clamp(0.0, 86_400.0)
        } else {
            0.0
        });
    let mut told = false;
    loop {
        let reply = probe.memory(&request)?;
        if reply["state"].as_str() != Some("waiting") {
            return Ok(reply);
        }
        if !told {
            eprintln!(
                "waiting for step {last} (now at step {}); Ctrl-C leaves the span armed",
                reply["step"]
            );
            told = true;
        }
        if std::time::Instant::now() >= deadline {
            return Err(Hinted::new(
                format!(
                    "step {last} did not end within {wait:.0} s (the training is at step {})",
                    reply["step"]
                ),
                "ask again later with the same --steps: the span stays armed",
            )
            .into());
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

pub fn run(
    probe: &Probe,
    action: Option<MemoryAction>,
    top: usize,
    format: BtFormat,
) -> Result<u8> {
    let reply = match &action {
        Some(MemoryAction::Diff {
            steps: Some(steps),
            wait,
        }) => diff_steps(probe, steps, *wait, top)?,
        _ => probe.memory(&request_of(action.as_ref(), top))?,
    };
    if let BtFormat::Json = format {
        println!("{}", serde_json::to_string_pretty(&reply)?);
        return Ok(0);
    }
    print!("{}", text_of(action.as_ref(), &reply));
    Ok(0)
}

pub fn text_of(action: Option<&MemoryAction>, reply: &Value) -> String {
    match action {
        None => summary_text(reply),
        Some(MemoryAction::Track { .. }) => tracking_text(reply),
        Some(MemoryAction::Diff { .. }) => diff_text(reply),
        Some(MemoryAction::Export { .. }) => {
            format!("written: {}\n", reply["path"].as_str().unwrap_or("?"))
        }
    }
}

fn mb(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.abs() >= 1024.0 => format!("{:.2} GB", x / 1024.0),
        Some(x) => format!("{x:.1} MB"),
        None => "?".to_string(),
    }
}

fn signed_mb(v: &Value) -> String {
    match v.as_f64() {
        Some(x) => format!(
            "{}{}",
            if x >= 0.0 { "+" } else { "-" },
            mb(&json!(x.abs()))
        ),
        None => "?".to_string(),
    }
}

fn summary_text(r: &Value) -> String {
    let mut out = format!(
        "process: RSS {} (peak {}), USS {}, PSS {}, swap {}\n",
        mb(&r["rss_mb"]),
        mb(&r["rss_peak_mb"]),
        mb(&r["uss_mb"]),
        mb(&r["pss_mb"]),
        mb(&r["swap_mb"])
    );
    out += &format!(
        "python: {} objects tracked by gc, {} allocated blocks",
        r["gc_objects"], r["python_blocks"]
    );
    if !r["python_traced_mb"].is_null() {
        out += &format!(
            ", {} traced by tracemalloc (peak {})",
            mb(&r["python_traced_mb"]),
            mb(&r["python_traced_peak_mb"])
        );
    }
    out += "\n";
    for d in r["cuda"].as_array().into_iter().flatten() {
        out += &format!(
            "{}: allocated {}, reserved {}, peak {}, {} allocation retries, {} OOMs\n",
            d["device"].as_str().unwrap_or("cuda"),
            mb(&d["allocated_mb"]),
            mb(&d["reserved_mb"]),
            mb(&d["peak_mb"]),
            d["alloc_retries"],
            d["ooms"]
        );
    }
    if let Some(t) = r.get("tensors").filter(|t| !t.is_null()) {
        out += &format!(
            "tensors: {} storages, {}{}\n",
            t["count"],
            mb(&t["mb"]),
            if t["complete"].as_bool() == Some(false) {
                " (scan cut short)"
            } else {
                ""
            }
        );
        for row in t["largest"].as_array().into_iter().flatten() {
            out += &format!(
                "  {:>10}  {} {} on {}  {}\n",
                mb(&row["mb"]),
                row["shape"].as_str().unwrap_or("?"),
                row["dtype"].as_str().unwrap_or("?"),
                row["device"].as_str().unwrap_or("?"),
                row["holder"].as_str().unwrap_or("(no name found)")
            );
        }
    } else if r["torch"].as_bool() != Some(true) {
        out += "tensors: torch is not imported in this process\n";
    }
    let g = &r["growth"];
    if let Some(seconds) = g["seconds"].as_f64() {
        out += &format!(
            "since the last look ({seconds:.0} s ago): RSS {}, USS {}, {:+} gc objects\n",
            signed_mb(&g["rss_mb"]),
            signed_mb(&g["uss_mb"]),
            g["gc_objects"].as_i64().unwrap_or(0)
        );
    }
    out += &tracking_line(&r["tracking"]);
    out
}

fn tracking_line(t: &Value) -> String {
    let on: Vec<&str> = [
        ("python", "Python (tracemalloc)"),
        ("cuda", "CUDA (memory history)"),
    ]
    .iter()
    .filter(|(k, _)| t[*k].as_bool() == Some(true))
    .map(|(_, name)| *name)
    .collect();
    if on.is_empty() {
        "tracking: off (`memory track on` records allocation sites)\n".to_string()
    } else {
        format!("tracking: {}\n", on.join(", "))
    }
}

fn tracking_text(r: &Value) -> String {
    let mut out = tracking_line(r);
    if let Some(overhead) = r["overhead_mb"].as_f64() {
        out += &format!("tracemalloc's own memory: {overhead:.1} MB\n");
    }
    out
}

fn diff_text(r: &Value) -> String {
    let sites = r["sites"].as_array().cloned().unwrap_or_default();
    let since = match r["steps"].as_array() {
        Some(steps) if steps.len() == 2 => format!(
            "from the end of step {} to the end of step {}",
            steps[0], steps[1]
        ),
        _ => "since the last look".to_string(),
    };
    let mut out = format!(
        "RSS now {}, traced {}; what grew {since}, by the line of your code that allocated it (with the stack below it):\n",
        mb(&r["rss_mb"]),
        mb(&r["traced_mb"])
    );
    if sites.is_empty() {
        out += "  nothing grew\n";
    }
    if let Some(note) = r["tensor_note"].as_str() {
        out += &format!("  ({note})\n");
    }
    if r["tensor_scan_complete"] == Value::Bool(false) {
        out += "  (the tensors were not all counted: the scan ran out of time)\n";
    }
    for s in &sites {
        // Python's allocations and the data of the tensors made there
        // (torch's own memory, which tracemalloc does not see).
        let total = if s["total_diff_mb"].is_number() {
            &s["total_diff_mb"]
        } else {
            &s["size_diff_mb"]
        };
        let tensors = match s["tensor_count_diff"].as_i64() {
            Some(n) if n != 0 || s["tensor_diff_mb"].as_f64().unwrap_or(0.0) != 0.0 => format!(
                "  ({:+} tensors, {} of tensor data)",
                n,
                signed_mb(&s["tensor_diff_mb"])
            ),
            _ => String::new(),
        };
        out += &format!(
            "  {:>10}  {:+} blocks  {}:{}{tensors}\n",
            signed_mb(total),
            s["count_diff"].as_i64().unwrap_or(0),
            s["file"].as_str().unwrap_or("?"),
            s["lineno"]
        );
        let site = format!("{}:{}", s["file"].as_str().unwrap_or("?"), s["lineno"]);
        for frame in s["stack"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|f| *f != site)
            .take(4)
        {
            out += &format!("              via {frame}\n");
        }
    }
    out
}
