//! `rankscope PID torch ...`: what the probe found of PyTorch in the process
//! (models, optimizers, the step), and the trace switched on and off. The
//! work is the probe's (`rankscope._probe.torch`); this file asks and prints.

use anyhow::Result;
use serde_json::{json, Value};

use crate::client::Probe;
use crate::hint::Hinted;
use crate::{BtFormat, Switch, TorchAction, TraceAction};

pub fn run(probe: &Probe, action: Option<TorchAction>, format: BtFormat) -> Result<u8> {
    let request = request_of(action.as_ref())?;
    let reply = probe.torch(&request)?;
    if let BtFormat::Json = format {
        println!("{}", serde_json::to_string_pretty(&reply)?);
        return Ok(0);
    }
    print!("{}", text_of(action.as_ref(), &reply));
    Ok(0)
}

/// The probe's request for a `torch` command (`POST /v1/torch`).
pub fn request_of(action: Option<&TorchAction>) -> Result<Value> {
    Ok(match action {
        None => json!({"action": "status"}),
        Some(TorchAction::Trace {
            action:
                TraceAction::On {
                    every,
                    modules,
                    backward,
                },
        }) => {
            if *every == 0 {
                return Err(Hinted::new(
                    "--every must be 1 or more",
                    "e.g. --every 20: one step in 20 is traced",
                )
                .into());
            }
            json!({"action": "trace_on", "every": every, "modules": some_modules(modules)?, "backward": backward})
        }
        Some(TorchAction::Trace {
            action: TraceAction::Off,
        }) => json!({"action": "trace_off"}),
        Some(TorchAction::Nan { switch }) => {
            json!({"action": "nan", "switch": switch_word(*switch)})
        }
        // With neither a switch nor an option, the probe turns the feature
        // on where it is off and otherwise only says how it stands, so that
        // looking does not reset a running feature's options.
        Some(TorchAction::Grads { switch, every }) => {
            json!({"action": "grads", "switch": switch_word(*switch), "every": every.map(at_least_one).transpose()?})
        }
        Some(TorchAction::Activations {
            switch,
            modules,
            every,
        }) => json!({
            "action": "activations", "switch": switch_word(*switch), "modules": modules.as_deref().map(some_modules).transpose()?, "every": every.map(at_least_one).transpose()?,
        }),
        Some(TorchAction::Collectives { switch }) => {
            json!({"action": "collectives", "switch": switch_word(*switch)})
        }
    })
}

/// A `--modules` glob that names something: an empty one (a shell
/// variable that was not set) would otherwise be taken as every module.
fn some_modules(glob: &str) -> Result<&str> {
    if glob.trim().is_empty() {
        return Err(Hinted::new(
            "--modules is empty",
            "give a glob of qualified module names, e.g. --modules 'encoder.*', or '*' for every module",
        )
        .into());
    }
    Ok(glob)
}

fn switch_word(switch: Option<Switch>) -> Option<&'static str> {
    switch.map(|s| match s {
        Switch::On => "on",
        Switch::Off => "off",
    })
}

fn at_least_one(every: u64) -> Result<u64> {
    if every == 0 {
        return Err(Hinted::new(
            "--every must be 1 or more",
            "e.g. --every 10: one step in 10",
        )
        .into());
    }
    Ok(every)
}

/// What a user reads of the probe's reply to `request_of(action)`.
pub fn text_of(action: Option<&TorchAction>, reply: &Value) -> String {
    match action {
        None => status_text(reply),
        Some(TorchAction::Trace {
            action: TraceAction::On { .. },
        }) => trace_on_text(reply),
        Some(TorchAction::Trace {
            action: TraceAction::Off,
        }) => trace_off_text(reply),
        Some(TorchAction::Nan { .. }) => nan_text(reply),
        Some(TorchAction::Grads { .. }) => {
            stats_text("grads", "python.grad_stats", "parameters", reply)
        }
        Some(TorchAction::Activations { .. }) => {
            stats_text("activations", "python.activation_stats", "modules", reply)
        }
        Some(TorchAction::Collectives { .. }) => collectives_text(reply),
    }
}

fn number(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if v.is_f64() => format!("{x:.4e}"),
        _ => v
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string()),
    }
}

/// Where a stage puts a rank when the ranks are compared: a rank whose
/// own input, forward or loss went non-finite made the value; one whose
/// gradients came non-finite out of DDP's all-reduce got it from another.
fn stage_order(stage: &str) -> u8 {
    match stage {
        "input" => 0,
        "forward" => 1,
        "loss" => 2,
        "backward" => 3,
        "update" => 4,
        "all_reduce" => 6,
        _ => 5,
    }
}

/// `cluster torch nan`: one line for the job, naming the rank where the
/// first non-finite value began (each rank's first event compared: the
/// earliest step, then the stage that made it rather than received it,
/// then the time); None while no rank has an event.
pub fn job_nan_line(replies: &[(i64, &Value)]) -> Option<String> {
    let mut firsts: Vec<(i64, i64, &str, &str, f64)> = replies
        .iter()
        .filter_map(|(rank, reply)| {
            let e = reply["events"].as_array()?.first()?;
            Some((
                *rank,
                e["step"].as_i64()?,
                e["stage"].as_str().unwrap_or("unknown"),
                e["module"].as_str().unwrap_or("?"),
                e["ts"].as_f64().unwrap_or(f64::MAX),
            ))
        })
        .collect();
    firsts.sort_by(|a, b| {
        (a.1, stage_order(a.2))
            .cmp(&(b.1, stage_order(b.2)))
            .then(a.4.total_cmp(&b.4))
    });
    let (rank, step, stage, module, _) = *firsts.first()?;
    let mut line = format!("job: the first non-finite value began on rank {rank}, at step {step} ({stage}, in {module})");
    let same: Vec<String> = firsts[1..]
        .iter()
        .filter(|f| f.1 == step)
        .map(|f| format!("rank {} ({})", f.0, f.2))
        .collect();
    if !same.is_empty() {
        line += &format!("; at the same step: {}", same.join(", "));
    }
    let later: Vec<String> = firsts[1..]
        .iter()
        .filter(|f| f.1 != step)
        .map(|f| format!("rank {} at step {} ({})", f.0, f.1, f.2))
        .collect();
    if !later.is_empty() {
        line += &format!("; later: {}", later.join(", "));
    }
    let clean: Vec<i64> = replies
        .iter()
        .filter(|(rank, _)| !firsts.iter().any(|f| f.0 == *rank))
        .map(|(rank, _)| *rank)
        .collect();
    if !clean.is_empty() {
        line += &format!("; none on ranks {}", rankscope_core::ranks::compress(clean));
    }
    Some(line)
}

/// `torch nan [on|off]`: whether the watch is armed, and what it found.
fn nan_text(reply: &Value) -> String {
    let mut out = String::new();
    let checked = reply["checked_steps"].as_i64().unwrap_or(0);
    out += &if reply["armed"].as_bool() == Some(true) {
        format!("nan watch: armed ({checked} steps checked: the loss and the gradients' norms)\n")
    } else {
        format!("nan watch: off ({checked} steps checked while armed)\n")
    };
    if let Some(reason) = reply["disabled"].as_str() {
        out += &format!("nan watch: turned itself off after an error: {reason}\n");
    }
    if reply["armed"].as_bool() == Some(true) {
        out += numbering_note(reply);
    }
    if reply["armed"].as_bool() == Some(true)
        && checked == 0
        && reply["events"].as_array().is_none_or(|e| e.is_empty())
    {
        out += "note: steps are checked at the optimizer's step: a forward without grad (an eval pass, an inference loop) is not checked\n";
    }
    // Its cost on a GPU is of another kind: said, so that a slower step
    // is not a mystery.
    let waits = reply["gpu_waits"].as_i64().unwrap_or(0);
    if waits > 0 {
        out += &format!(
            "nan watch: {waits} of its checks waited for the GPU to finish the step's backward, \
             before the optimizer's update (so that a trip's search runs on the step's own weights)\n"
        );
    }
    out + &nan_events_text(reply)
}

/// The events of a `torch nan` reply (or of `python.nan_events` rows), one
/// block each.
pub fn nan_events_text(reply: &Value) -> String {
    let mut out = String::new();
    let events = reply["events"].as_array().cloned().unwrap_or_default();
    if events.is_empty() {
        out += "no non-finite loss or gradient seen\n";
    }
    for e in &events {
        let module = e["module"].as_str().unwrap_or("?");
        let kind = e["module_type"]
            .as_str()
            .map(|t| format!(" ({t})"))
            .unwrap_or_default();
        out += &format!(
            "step {}: first non-finite in {}, module {module}{kind}: {} ({} non-finite)\n",
            e["step"],
            e["stage"].as_str().unwrap_or("?"),
            e["what"].as_str().unwrap_or("?"),
            e["nonfinite"],
        );
        if !e["input_min"].is_null() || !e["input_nonfinite"].is_null() {
            out += &format!(
                "  inputs:  min {} max {}, {} non-finite\n",
                number(&e["input_min"]),
                number(&e["input_max"]),
                e["input_nonfinite"]
            );
        }
        if !e["weight_min"].is_null() || !e["weight_nonfinite"].is_null() {
            out += &format!(
                "  weights: min {} max {}, {} non-finite\n",
                number(&e["weight_min"]),
                number(&e["weight_max"]),
                e["weight_nonfinite"]
            );
        }
        if !e["loss"].is_null() {
            out += &format!("  loss: {}\n", number(&e["loss"]));
        }
        if let Some(detail) = e["detail"].as_str().filter(|d| !d.is_empty()) {
            out += &format!("  {detail}\n");
        }
        if let Some(record) = e["record"].as_str() {
            out += &format!("  record: {record} (rankscope crashes)\n");
        }
    }
    out
}

/// `torch grads|activations [on|off]`.
fn stats_text(feature: &str, table: &str, what: &str, reply: &Value) -> String {
    let mut out = if reply["on"].as_bool() == Some(true) {
        let every = reply["every"].as_i64().unwrap_or(1);
        format!(
            "{feature}: on, {} {what}, every {every} step{}, into {table}\n",
            reply["count"],
            if every == 1 { "" } else { "s" }
        )
    } else {
        format!("{feature}: off\n")
    };
    if let Some(rows) = reply["rows"].as_i64() {
        out += &format!("{rows} rows in {table}\n");
    }
    out += &last_step_text(&reply["last"]);
    if reply["on"].as_bool() == Some(true) {
        out += numbering_note(reply);
    }
    if let Some(reason) = reply["disabled"].as_str() {
        out += &format!("{feature}: turned itself off after an error: {reason}\n");
        if reply["on"].as_bool() != Some(true) {
            out += &format!("(`torch {feature} on` turns it on again)\n");
        }
    }
    if let Some(note) = reply["note"].as_str() {
        out += &format!("note: {note}\n");
    }
    out
}

/// `torch grads`: the last sampled step's total gradient norm, its largest
/// norms and every parameter flagged (exploding, vanishing, non-finite).
fn last_step_text(last: &Value) -> String {
    if !last.is_object() {
        return String::new();
    }
    let named = |entries: &Value, with_flag: bool| -> String {
        entries
            .as_array()
            .map(|list| {
                list.iter()
                    .map(|e| {
                        let name = e["param"].as_str().unwrap_or("?");
                        if with_flag {
                            format!(
                                "{name} {} (norm {})",
                                e["flag"].as_str().unwrap_or("?"),
                                number(&e["norm"])
                            )
                        } else {
                            format!("{name} {}", number(&e["norm"]))
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    let mut out = format!(
        "step {}: total gradient norm {} (as the optimizer was given them, after any clipping); largest: {}\n",
        last["step"],
        number(&last["total_norm"]),
        named(&last["largest"], false)
    );
    let flagged = named(&last["flagged"], true);
    out += &if flagged.is_empty() {
        "flagged: none\n".to_string()
    } else {
        format!("flagged: {flagged}\n")
    };
    out
}

/// `torch collectives [on|off]`: each group's last collective, and those in flight.
fn collectives_text(reply: &Value) -> String {
    let mut out = String::new();
    out += &match (reply["on"].as_bool(), reply["initialized"].as_bool()) {
        (Some(true), Some(true)) => format!(
            "collectives: recorded ({} backend)\n",
            reply["backend"].as_str().unwrap_or("?")
        ),
        (Some(true), _) => {
            "collectives: on; torch.distributed is not initialised yet\n".to_string()
        }
        _ => "collectives: off\n".to_string(),
    };
    let plural = |n: &Value| if n.as_i64() == Some(1) { "" } else { "s" };
    for group in reply["groups"].as_array().into_iter().flatten() {
        out += &format!(
            "  group {} ({} rank{}, this is rank {}): {} collective{}, last #{} {}\n",
            group["group"].as_str().unwrap_or("?"),
            group["size"],
            plural(&group["size"]),
            group["group_rank"],
            group["count"],
            plural(&group["count"]),
            group["last_seq"],
            group["last_op"].as_str().unwrap_or("?"),
        );
        for f in group["in_flight"].as_array().into_iter().flatten() {
            let op = f["op"].as_str().unwrap_or("?");
            // A point-to-point call's number is among its calls to that peer.
            let peer = match (f["peer"].as_i64(), op.ends_with("send")) {
                (Some(peer), true) => format!(" to rank {peer}"),
                (Some(peer), false) => format!(" from rank {peer}"),
                (None, false) if op.ends_with("recv") => " from any rank".to_string(),
                _ => String::new(),
            };
            out += &format!(
                "    in flight: {op} #{}{peer} for {:.1} s ({})\n",
                f["seq"],
                f["waiting_s"].as_f64().unwrap_or(0.0),
                f["caller"].as_str().unwrap_or("?"),
            );
        }
    }
    if let Some(errors) = reply["errors"].as_i64().filter(|&n| n > 0) {
        out += &format!(
            "  {errors} call{} ran unrecorded: the recording failed, not the call\n",
            if errors == 1 { "" } else { "s" }
        );
    }
    let flight = &reply["flight_recorder"];
    if flight["enabled"].as_bool() == Some(true) {
        let rows = flight["rows"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        let now = rankscope_core::host::now_seconds();
        out += &format!(
            "flight recorder: on, its last {} collectives read
",
            rows.len()
        );
        // Rows are [seq, op, group, members, state, caller, ts] (stuck::COLUMNS).
        for row in rows.iter().filter(|r| r[4].as_str() == Some("in flight")) {
            out += &format!(
                "    in flight: {} #{} on group {} for {:.1} s (Flight Recorder)\n",
                row[1].as_str().unwrap_or("?"),
                row[0],
                row[2].as_str().unwrap_or("?"),
                now - row[6].as_f64().unwrap_or(now),
            );
        }
    } else if reply["initialized"].as_bool() == Some(true) && !flight.is_null() {
        out += "flight recorder: off (collectives issued from C++, such as DDP's, are seen where the job starts with TORCH_FR_BUFFER_SIZE=2000)\n";
    }
    out
}

/// 1234567 -> "1,234,567".
fn thousands(n: &Value) -> String {
    let Some(n) = n.as_i64() else {
        return n.to_string();
    };
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

fn words(list: &Value) -> String {
    list.as_array()
        .map(|v| {
            v.iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// The model's module tree, indented by depth; a run of alike siblings is
/// one line (`blocks.0-11  Block x12  ... each`). From a probe before the
/// tree, its top-level children.
fn tree_text(model: &Value) -> String {
    let mut out = String::new();
    let (rows, left_out) = match model["tree"]["rows"].as_array() {
        Some(rows) => (
            rows.clone(),
            model["tree"]["left_out"].as_u64().unwrap_or(0),
        ),
        None => {
            let children = model["children"].as_array().cloned().unwrap_or_default();
            let more = model["children_total"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(children.len() as u64);
            (children, more)
        }
    };
    let depth = |row: &Value| row["depth"].as_u64().unwrap_or(1) as usize;
    let label = |row: &Value| {
        format!(
            "{}{}",
            "  ".repeat(depth(row).saturating_sub(1)),
            row["name"].as_str().unwrap_or("?")
        )
    };
    let kind = |row: &Value| match row["repeat"].as_u64() {
        Some(n) if n > 1 => format!("{} x{n}", row["type"].as_str().unwrap_or("?")),
        _ => row["type"].as_str().unwrap_or("?").to_string(),
    };
    let width = rows.iter().map(|r| label(r).len()).max().unwrap_or(0);
    let type_width = rows.iter().map(|r| kind(r).len()).max().unwrap_or(0);
    for row in &rows {
        let each = if row["repeat"].as_u64().unwrap_or(1) > 1 {
            " each"
        } else {
            ""
        };
        out += &format!(
            "  {:width$}  {:type_width$}  {:>12} parameters{each}\n",
            label(row),
            kind(row),
            thousands(&row["parameters"]),
        );
    }
    if left_out > 0 {
        out += &format!("  ... {left_out} more modules\n");
    }
    out
}

fn status_text(status: &Value) -> String {
    let mut out = String::new();
    let cuda = if status["cuda_initialized"].as_bool() == Some(true) {
        "CUDA in use"
    } else {
        "CUDA not initialised"
    };
    out += &format!(
        "torch {} ({cuda})\n",
        status["torch_version"].as_str().unwrap_or("?")
    );
    out += &match (status["step"].as_i64(), status["step_source"].as_str()) {
        (Some(step), Some("optimizer")) => {
            format!("step {step} (the optimizer's steps mark them)\n")
        }
        (Some(step), Some(source)) => format!("step {step} (from {source})\n"),
        (Some(step), None) => format!("step {step}\n"),
        (None, _) => {
            "step unknown (counted while the trace is on: optimizer steps, or rankscope.step())\n"
                .to_string()
        }
    };
    let models = status["models"].as_array().cloned().unwrap_or_default();
    if models.is_empty() {
        out += "no model found (an nn.Module whose parameters an optimizer updates, or any root module with parameters)\n";
    }
    for model in &models {
        out += &format!(
            "model {}: {} submodules, {} parameters ({} trainable), {} on {}, {}\n",
            model["name"].as_str().unwrap_or("?"),
            thousands(&model["submodules"]),
            thousands(&model["parameters"]),
            thousands(&model["trainable"]),
            words(&model["dtypes"]),
            words(&model["devices"]),
            if model["training"].as_bool() == Some(true) {
                "training"
            } else {
                "eval"
            },
        );
        out += &tree_text(model);
    }
    for (i, opt) in status["optimizers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let groups = opt["param_groups"].as_array().cloned().unwrap_or_default();
        let name = opt["name"]
            .as_str()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default();
        out += &format!(
            "optimizer {i}{name}: {}, {} param group{}\n",
            opt["type"].as_str().unwrap_or("?"),
            groups.len(),
            if groups.len() == 1 { "" } else { "s" }
        );
        for (g, group) in groups.iter().enumerate() {
            let hyper: Vec<String> = group["hyperparameters"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| {
                    format!(
                        "{k}={}",
                        v.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| v.to_string())
                    )
                })
                .collect();
            out += &format!(
                "  group {g} ({} tensors): {}\n",
                group["params"],
                hyper.join(" ")
            );
        }
    }
    if let Some(losses) = status["losses"].as_array().filter(|l| !l.is_empty()) {
        out += &format!("loss modules: {}\n", words(&Value::from(losses.clone())));
    }
    out += &trace_line(&status["trace"]);
    out += &features_lines(&status["features"]);
    out
}

/// One line per other feature that was ever switched on in the process.
fn features_lines(features: &Value) -> String {
    let mut out = String::new();
    if let Some(nan) = features.get("nan") {
        let state = if nan["armed"].as_bool() == Some(true) {
            "armed"
        } else {
            "off"
        };
        let found = match nan["tripped_at"].as_i64() {
            Some(step) => format!("first non-finite at step {step} (`torch nan` says where)"),
            None => "no non-finite loss or gradient seen".to_string(),
        };
        out += &format!(
            "nan watch: {state}, {} steps checked, {found}\n",
            nan["checked_steps"]
        );
    }
    for (name, what) in [("grads", "parameters"), ("activations", "modules")] {
        let Some(f) = features.get(name) else {
            continue;
        };
        if f["on"].as_bool() == Some(true) {
            out += &format!(
                "{name}: on, {} {what}, every {}, {} rows\n",
                f["count"], f["every"], f["rows"]
            );
        } else if let Some(reason) = f["disabled"].as_str() {
            out += &format!("{name}: off, after an error: {reason}\n");
        }
    }
    if let Some(c) = features
        .get("collectives")
        .filter(|c| c["on"].as_bool() == Some(true))
    {
        let groups = c["groups"].as_array().map(Vec::len).unwrap_or(0);
        out += &format!(
            "collectives: recorded, {groups} group{}\n",
            if groups == 1 { "" } else { "s" }
        );
    }
    out
}

fn trace_line(trace: &Value) -> String {
    let rows = &trace["rows"];
    let kept = format!(
        "{} rows in python.torch_trace, {} in python.torch_steps",
        rows["torch_trace"], rows["torch_steps"]
    );
    let mut out =
        if trace["on"].as_bool() == Some(true) {
            let stages = if trace["backward"].as_bool() == Some(true) {
                "forward and backward"
            } else {
                "forward"
            };
            let now = if trace["sampling_now"].as_bool() == Some(true) {
                format!("{} modules timed now", trace["hooked_modules"])
            } else {
                "no module timed now (between sampled steps)".to_string()
            };
            format!(
            "trace: on, every {} step{}, modules '{}', {stages}; {now}; {} sampled steps; {kept}\n",
            trace["every"],
            if trace["every"].as_i64() == Some(1) { "" } else { "s" },
            trace["modules"].as_str().unwrap_or("*"),
            trace["sampled_steps"],
        )
        } else {
            format!("trace: off; {kept}\n")
        };
    if let Some(reason) = trace["disabled"].as_str() {
        out += &format!(
            "trace: turned itself off after an error ({} in all): {reason}\n",
            trace["errors"]
        );
    }
    // The run store's trouble, said where people look: after the job, a
    // run store that stopped part way looks whole.
    let spill = &trace["store"]["spill"];
    if let Some(error) = spill["error"].as_str() {
        out += &format!(
            "run store: nothing more is written to disk ({} rows lost): {error}\n",
            spill["rows_lost"].as_u64().unwrap_or(0)
        );
    } else if let Some(lost) = spill["rows_lost"].as_u64().filter(|&n| n > 0) {
        out += &format!(
            "run store: {lost} rows never reached the disk (it fell behind; RANKSCOPE_TABLE_ROWS holds more)\n"
        );
    }
    // Where another feature keeps the step clock, its hooks stay.
    if trace["on"].as_bool() != Some(true)
        && trace["clock"].as_bool() != Some(true)
        && trace["optimizer_hooks"].as_i64().unwrap_or(0) > 0
    {
        out += "note: the optimizer hooks come off at the end of the step in progress\n";
    }
    out
}

/// Said where the steps' numbers are the clock's own count: a feature
/// turned on mid-run numbers from there, not from the program's start.
fn numbering_note(reply: &Value) -> &'static str {
    if reply["numbered"].as_str() == Some("clock") {
        "note: steps are counted from here, as the probe found no count of the program's to read (SGD and rankscope.step() keep none, and an optimizer that keeps one has none before its first step), so their numbers may not be your loop's\n"
    } else {
        ""
    }
}

fn trace_on_text(reply: &Value) -> String {
    let status = &reply["status"];
    let mut out = String::new();
    if reply["models"].as_i64() == Some(0) {
        out += "note: no model found yet: the probe looks again when an optimizer steps (or at rankscope.step())\n";
    }
    if reply["optimizer_hooks"].as_bool() != Some(true) {
        out += "note: the optimizer step hooks are not in yet (the program stayed inside an optimizer step); try again\n";
    }
    let every = status["trace"]["every"].as_i64().unwrap_or(1);
    let first = status["trace"]["step"]
        .as_i64()
        .map(|s| (s / every + 1) * every);
    out += &format!(
        "trace on: {} modules, every {} step{}{}; timing starts at the next step boundary\n",
        reply["modules"],
        every,
        if every == 1 { "" } else { "s" },
        first
            .map(|f| format!(" (first sampled step: {f})"))
            .unwrap_or_default(),
    );
    if status["optimizers"]
        .as_array()
        .is_some_and(|o| o.is_empty())
        && status["step_source"].as_str() != Some("rankscope.step()")
    {
        out += "note: no optimizer found: steps end at an optimizer's step, or where the program calls rankscope.step() (an inference loop needs it, once a batch)\n";
    } else {
        out += numbering_note(&status["trace"]);
    }
    out += &trace_line(&status["trace"]);
    out
}

fn trace_off_text(reply: &Value) -> String {
    let mut out = if reply["was_on"].as_bool() == Some(true) {
        format!(
            "trace off: {} modules as they were\n",
            reply["modules_restored"]
        )
    } else {
        "trace was off\n".to_string()
    };
    out += &trace_line(&reply["status"]["trace"]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_get_thousands_separators() {
        assert_eq!(thousands(&json!(1234567)), "1,234,567");
        assert_eq!(thousands(&json!(999)), "999");
        assert_eq!(thousands(&json!(1000)), "1,000");
    }

    #[test]
    fn collectives_say_their_groups_and_the_calls_left_unrecorded() {
        let reply = json!({"on": true, "initialized": true, "backend": "gloo", "errors": 2, "groups": [
            {"group": "0", "size": 4, "group_rank": 1, "count": 5, "last_seq": 5, "last_op": "all_reduce", "in_flight": []},
            {"group": "1", "size": 1, "group_rank": 0, "count": 1, "last_seq": 1, "last_op": "broadcast", "in_flight": []}]});
        let text = collectives_text(&reply);
        assert!(
            text.contains("group 0 (4 ranks, this is rank 1): 5 collectives, last #5 all_reduce"),
            "{text}"
        );
        assert!(
            text.contains("group 1 (1 rank, this is rank 0): 1 collective, last #1 broadcast"),
            "{text}"
        );
        assert!(
            text.contains("2 calls ran unrecorded: the recording failed, not the call"),
            "{text}"
        );
        let clean =
            collectives_text(&json!({"on": true, "initialized": true, "errors": 0, "groups": []}));
        assert!(!clean.contains("unrecorded"), "{clean}");
    }

    #[test]
    fn the_nan_watch_says_when_its_checks_waited_for_a_gpu() {
        let on_gpu =
            nan_text(&json!({"armed": true, "checked_steps": 12, "gpu_waits": 12, "events": []}));
        assert!(
            on_gpu.contains("nan watch: 12 of its checks waited for the GPU"),
            "{on_gpu}"
        );
        let on_cpu =
            nan_text(&json!({"armed": true, "checked_steps": 12, "gpu_waits": 0, "events": []}));
        assert!(!on_cpu.contains("waited"), "{on_cpu}");
    }

    #[test]
    fn a_trace_that_turned_itself_off_says_why() {
        let trace = json!({"on": false, "disabled": "the forward hook of fc1 failed: ValueError: x", "errors": 1,
                           "rows": {"torch_trace": 3, "torch_steps": 1}, "optimizer_hooks": 0});
        let text = trace_line(&trace);
        assert!(text.contains("trace: off; 3 rows"), "{text}");
        assert!(
            text.contains(
                "turned itself off after an error (1 in all): the forward hook of fc1 failed"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_run_store_that_stopped_writing_says_so() {
        let trace = |spill| {
            json!({"on": true, "every": 1, "sampled_steps": 2, "rows": {"torch_trace": 3, "torch_steps": 1},
                   "store": {"spill": spill}})
        };
        let stopped = trace_line(&trace(
            json!({"error": "the spill stopped at 1 MB (RANKSCOPE_STORE_MAX_MB)", "rows_lost": 40}),
        ));
        assert!(
            stopped.contains("run store: nothing more is written to disk (40 rows lost): the spill stopped at 1 MB"),
            "{stopped}"
        );
        let behind = trace_line(&trace(json!({"error": null, "rows_lost": 7})));
        assert!(
            behind.contains("run store: 7 rows never reached the disk"),
            "{behind}"
        );
        assert!(!trace_line(&trace(json!({"error": null, "rows_lost": 0}))).contains("run store"));
    }
}

#[cfg(test)]
mod job_nan_tests {
    use super::*;

    fn reply(step: i64, stage: &str, ts: f64) -> Value {
        json!({"events": [{"step": step, "stage": stage, "module": "m", "ts": ts}]})
    }

    #[test]
    fn the_rank_that_made_the_value_is_named_before_those_that_received_it() {
        // Rank 0's all-reduce tripped a moment before rank 1's own input did.
        let (a, b, c) = (
            reply(5, "all_reduce", 1.0),
            reply(5, "input", 2.0),
            json!({"events": []}),
        );
        let line = job_nan_line(&[(0, &a), (1, &b), (2, &c)]).expect("a line");
        assert!(
            line.starts_with(
                "job: the first non-finite value began on rank 1, at step 5 (input, in m)"
            ),
            "{line}"
        );
        assert!(
            line.contains("at the same step: rank 0 (all_reduce)"),
            "{line}"
        );
        assert!(line.ends_with("none on ranks 2"), "{line}");
    }

    #[test]
    fn an_earlier_step_comes_first_and_no_event_gives_no_line() {
        let (a, b) = (reply(9, "forward", 1.0), reply(7, "all_reduce", 2.0));
        let line = job_nan_line(&[(0, &a), (1, &b)]).expect("a line");
        assert!(
            line.contains("began on rank 1, at step 7")
                && line.contains("later: rank 0 at step 9 (forward)"),
            "{line}"
        );
        let none = json!({"events": []});
        assert_eq!(job_nan_line(&[(0, &none)]), None);
    }
}
