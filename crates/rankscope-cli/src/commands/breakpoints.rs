//! `rankscope PID break ...` and `rankscope PID snapshots`: breakpoints that
//! record and go on, kept by the probe (`rankscope._probe.breakpoints`).

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::{json, Value};

use crate::client::Probe;
use crate::hint::Hinted;
use rankscope_query::table::{Align, Style, Table};

use crate::{BreakAction, BtFormat, ListFormat};

/// The probe request for a `break` action (the same for one process and
/// for every rank of a job).
pub fn request_of(action: &BreakAction) -> Result<Value> {
    Ok(match action {
        BreakAction::Add {
            spec,
            condition,
            log,
            max,
            every,
            hit,
            pause,
            pause_timeout,
        } => {
            if let Some(t) = pause_timeout {
                super::seconds(*t, "--pause-timeout")?;
            }
            json!({
                "op": "add", "spec": spec, "condition": condition, "log": log, "max": max, "every": every, "hit": hit,
                "pause": pause, "pause_timeout": pause_timeout,
            })
        }
        BreakAction::List { .. } => json!({"op": "list"}),
        BreakAction::Rm { id } => json!({"op": "rm", "id": id}),
        BreakAction::Clear => json!({"op": "clear"}),
    })
}

/// What the user reads for the probe's reply: (stdout lines, notes for stderr).
pub fn render(action: &BreakAction, reply: &Value) -> (Vec<String>, Vec<String>) {
    let notes = reply["note"]
        .as_str()
        .map(|n| vec![format!("note: {n}")])
        .unwrap_or_default();
    let lines = match action {
        BreakAction::Add { .. } => {
            vec![format!(
                "breakpoint {} at {}:{}",
                reply["id"],
                reply["file"].as_str().unwrap_or("?"),
                reply["line"]
            )]
        }
        BreakAction::List {
            format: ListFormat::Json,
        } => vec![serde_json::to_string_pretty(reply).unwrap_or_default()],
        BreakAction::List {
            format: ListFormat::Table,
        } => {
            let bps = reply.as_array().cloned().unwrap_or_default();
            if bps.is_empty() {
                vec!["No breakpoints.".to_string()]
            } else {
                let mut table = Table::new(Style::Plain)
                    .whole_column("ID", Align::Right)
                    .column("WHERE", Align::Left)
                    .whole_column("PASSES", Align::Right)
                    .whole_column("HITS", Align::Right)
                    .column("DETAILS", Align::Left);
                for bp in &bps {
                    table.row(describe(bp));
                }
                table
                    .render(crate::term::width())
                    .lines()
                    .map(str::to_string)
                    .collect()
            }
        }
        BreakAction::Rm { .. } => vec![format!(
            "removed breakpoint {} ({} hits)",
            reply["id"], reply["hits"]
        )],
        BreakAction::Clear => vec![format!(
            "removed {} breakpoints",
            reply.as_array().map_or(0, Vec::len)
        )],
    };
    (lines, notes)
}

pub fn run(probe: &Probe, action: BreakAction) -> Result<u8> {
    let reply = probe.breakpoints(&request_of(&action)?)?;
    let (lines, notes) = render(&action, &reply);
    for note in notes {
        eprintln!("{note}");
    }
    for line in lines {
        println!("{line}");
    }
    Ok(0)
}

/// A breakpoint's row: id, where, passes, hits, and the rest of its settings.
fn describe(bp: &Value) -> Vec<String> {
    let place = match &bp["line"] {
        Value::String(function) => function.clone(),
        other => other.to_string(),
    };
    let kind = if bp["kind"] == "watch" { "watch " } else { "" };
    let mut details = Vec::new();
    for (key, label) in [
        ("watch", "var"),
        ("tensor", "tensor"),
        ("condition", "if"),
        ("log", "log"),
        ("every", "every"),
        ("hit_from", "hit"),
        ("max", "max"),
        ("pause", "pause"),
    ] {
        if !bp[key].is_null() {
            let value = bp[key]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| bp[key].to_string());
            details.push(format!("{label} {value}"));
        }
    }
    if bp["enabled"] == Value::Bool(false) {
        details.push("[disabled]".to_string());
    }
    for thread in bp["paused"].as_array().into_iter().flatten() {
        details.push(format!(
            "[paused: thread {}]",
            thread.as_str().unwrap_or("?")
        ));
    }
    if let Some(note) = bp["note"].as_str() {
        details.push(format!("({note})"));
    }
    vec![
        bp["id"].to_string(),
        format!("{kind}{}:{place}", bp["file"].as_str().unwrap_or("?")),
        bp["passes"].to_string(),
        bp["hits"].to_string(),
        details.join("  "),
    ]
}

pub fn watch(probe: &Probe, spec: &str, name: &str, tensor: bool) -> Result<u8> {
    let watch =
        probe.breakpoints(&json!({"op": "watch", "spec": spec, "name": name, "tensor": tensor}))?;
    if let Some(note) = watch["note"].as_str() {
        eprintln!("note: {note}");
    }
    let what = if tensor {
        "in-place changes of tensor"
    } else {
        "changes of"
    };
    println!(
        "watch {}: {what} {name} in {}:{}",
        watch["id"],
        watch["file"].as_str().unwrap_or("?"),
        watch["line"].as_str().unwrap_or("?")
    );
    Ok(0)
}

/// Waits (up to `wait`) for a thread paused by a `--pause` breakpoint and
/// joins its pdb session.
pub fn attach(probe: &Probe, thread: Option<&str>, wait: Duration) -> Result<u8> {
    let started = Instant::now();
    let mut told = false;
    let session = loop {
        let paused = probe.breakpoints(&json!({"op": "paused"}))?;
        let paused = paused.as_array().cloned().unwrap_or_default();
        let names: Vec<&str> = paused.iter().filter_map(|s| s["thread"].as_str()).collect();
        let chosen: Vec<&Value> = paused
            .iter()
            .filter(|s| thread.is_none_or(|t| s["thread"] == t))
            .collect();
        match chosen.as_slice() {
            [one] => break (*one).clone(),
            [_, _, ..] => {
                return Err(Hinted::new(
                    format!("several threads are paused: {}", names.join(", ")),
                    "pick one with --thread NAME",
                )
                .into())
            }
            [] if started.elapsed() >= wait => {
                let hint = if names.is_empty() {
                    "set one with `rankscope PID break add FILE:LINE --pause`; `break list` shows the breakpoints and their hits".to_string()
                } else {
                    format!("paused now: {}", names.join(", "))
                };
                let what = thread.map_or("no thread".to_string(), |t| {
                    format!("no thread named {t:?}")
                });
                return Err(Hinted::new(
                    format!("{what} paused within {:.0} s", wait.as_secs_f64()),
                    hint,
                )
                .into());
            }
            [] => {
                if !told {
                    eprintln!(
                        "waiting for a thread to pause (up to {:.0} s)...",
                        wait.as_secs_f64()
                    );
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let socket = session["socket"].as_str().unwrap_or_default();
    let stream = UnixStream::connect(socket).map_err(|e| {
        Hinted::new(
            format!("cannot join the paused thread {}: {e}", session["thread"]),
            "it may have resumed (pause timeout) or another attach took it",
        )
    })?;
    super::debug::relay(stream)
}

pub fn snapshots(probe: &Probe, format: BtFormat) -> Result<u8> {
    let snaps = probe.breakpoints(&json!({"op": "snapshots"}))?;
    if let BtFormat::Json = format {
        println!("{}", serde_json::to_string_pretty(&snaps)?);
        return Ok(0);
    }
    let snaps = snaps.as_array().cloned().unwrap_or_default();
    if snaps.is_empty() {
        println!("No snapshots recorded.");
    }
    for snap in snaps {
        println!(
            "snapshot {}: breakpoint {}, hit {}, thread \"{}\"",
            snap["id"],
            snap["bp_id"],
            snap["hit"],
            snap["thread"].as_str().unwrap_or("?")
        );
        if let Some(log) = snap["log"].as_str() {
            println!("    log: {log}");
        }
        for frame in snap["frames"].as_array().into_iter().flatten() {
            println!(
                "    {} ({}:{})",
                frame["func"].as_str().unwrap_or("?"),
                frame["file"].as_str().unwrap_or("?"),
                frame["lineno"]
            );
            for local in frame["locals"].as_array().into_iter().flatten() {
                let [name, repr, _] = snapshot_local(local);
                println!(
                    "        {} = {}",
                    name.as_str().unwrap_or("?"),
                    repr.as_str().unwrap_or("?")
                );
            }
        }
    }
    Ok(0)
}

/// A snapshot's local is `[name, repr, type]`: the probe writes it compact,
/// since encoding it is a part of every hit's cost.
pub fn snapshot_local(local: &Value) -> [Value; 3] {
    let field = |i: usize| local.get(i).cloned().unwrap_or(Value::Null);
    [field(0), field(1), field(2)]
}
