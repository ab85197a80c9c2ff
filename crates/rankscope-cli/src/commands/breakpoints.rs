//! `rankscope PID break ...` and `rankscope PID snapshots`: breakpoints that
//! record and go on, kept by the probe (`rankscope._probe.breakpoints`).

use std::fmt::Write as _;

use anyhow::Result;
use serde_json::{json, Value};

use crate::client::Probe;
use crate::{BreakAction, BtFormat};

pub fn run(probe: &Probe, action: BreakAction) -> Result<u8> {
    match action {
        BreakAction::Add { spec, condition, log, max, every, hit } => {
            let request = json!({"op": "add", "spec": spec, "condition": condition, "log": log, "max": max, "every": every, "hit": hit});
            let bp = probe.breakpoints(&request)?;
            if let Some(note) = bp["note"].as_str() {
                eprintln!("note: {note}");
            }
            println!("breakpoint {} at {}:{}", bp["id"], bp["file"].as_str().unwrap_or("?"), bp["line"]);
        }
        BreakAction::List => {
            let bps = probe.breakpoints(&json!({"op": "list"}))?;
            let bps = bps.as_array().cloned().unwrap_or_default();
            if bps.is_empty() {
                println!("No breakpoints.");
            }
            for bp in bps {
                println!("{}", describe(&bp));
            }
        }
        BreakAction::Rm { id } => {
            let bp = probe.breakpoints(&json!({"op": "rm", "id": id}))?;
            println!("removed breakpoint {} ({} hits)", bp["id"], bp["hits"]);
        }
        BreakAction::Clear => {
            let removed = probe.breakpoints(&json!({"op": "clear"}))?;
            println!("removed {} breakpoints", removed.as_array().map_or(0, Vec::len));
        }
    }
    Ok(0)
}

fn describe(bp: &Value) -> String {
    let mut line = format!(
        "{:>3}  {}:{}  passes {} hits {}",
        bp["id"],
        bp["file"].as_str().unwrap_or("?"),
        bp["line"],
        bp["passes"],
        bp["hits"]
    );
    for (key, label) in [("condition", "if"), ("log", "log"), ("every", "every"), ("hit_from", "hit"), ("max", "max")] {
        if !bp[key].is_null() {
            let value = bp[key].as_str().map(str::to_string).unwrap_or_else(|| bp[key].to_string());
            let _ = write!(line, "  {label} {value}");
        }
    }
    if bp["enabled"] == Value::Bool(false) {
        line.push_str("  [disabled]");
    }
    if let Some(note) = bp["note"].as_str() {
        let _ = write!(line, "  ({note})");
    }
    line
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
        println!("snapshot {}: breakpoint {}, hit {}, thread \"{}\"", snap["id"], snap["bp_id"], snap["hit"], snap["thread"].as_str().unwrap_or("?"));
        if let Some(log) = snap["log"].as_str() {
            println!("    log: {log}");
        }
        for frame in snap["frames"].as_array().into_iter().flatten() {
            println!("    {} ({}:{})", frame["func"].as_str().unwrap_or("?"), frame["file"].as_str().unwrap_or("?"), frame["lineno"]);
            for local in frame["locals"].as_array().into_iter().flatten() {
                println!("        {} = {}", local["name"].as_str().unwrap_or("?"), local["repr"].as_str().unwrap_or("?"));
            }
        }
    }
    Ok(0)
}
