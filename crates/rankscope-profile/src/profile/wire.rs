//! A fold as JSON, for a probe that sampled its own process and hands the
//! fold to the CLI (`POST /v1/profile`: ranks on other machines). What
//! crosses the wire is the fold, never one record per sample. The indexes
//! the fold keeps for adding samples are rebuilt on arrival.

use serde_json::{json, Value};

use super::{FrameKey, Profile, Slice, StackKey};
use crate::ProfileError;

/// `[thread, stack, idle, gil]`: the key's fields in a row.
fn key_json(k: &StackKey) -> Value {
    json!([k.thread, k.stack, k.idle, k.gil])
}

pub fn to_json(p: &Profile) -> Value {
    json!({
        "pid": p.pid,
        "rank": p.rank,
        "frames": p.frames.iter().map(|f| json!([f.func, f.file, f.line])).collect::<Vec<_>>(),
        "stacks": p.stacks,
        "threads": p.threads.iter().map(|t| json!([t.id, t.name])).collect::<Vec<_>>(),
        "counts": p.counts.iter().map(|(k, n)| json!([key_json(k), n])).collect::<Vec<_>>(),
        "slices": p.slices.iter().map(|s| { let k = s.key(); json!([k.thread, k.stack, k.idle, k.gil, s.start_s, s.end_s]) }).collect::<Vec<_>>(),
        "ticks": p.ticks,
        "missed": p.missed,
        "errors": p.errors,
        "rate_hz": p.rate_hz,
        "started_at": p.started_at,
        "duration_s": p.duration_s,
        "steps": p.steps.iter().map(|((k, step), n)| json!([key_json(k), step, n])).collect::<Vec<_>>(),
        "step_spans": p.step_spans,
    })
}

fn bad(what: &str) -> ProfileError {
    ProfileError::Wire(format!(
        "a profile whose {what} is not as rankscope writes it"
    ))
}

fn rows<'a>(v: &'a Value, key: &str) -> Result<&'a [Value], ProfileError> {
    match v.get(key) {
        Some(Value::Array(rows)) => Ok(rows),
        None | Some(Value::Null) => Ok(&[]),
        Some(_) => Err(bad(key)),
    }
}

fn uint(v: &Value, what: &str) -> Result<u64, ProfileError> {
    v.as_u64().ok_or_else(|| bad(what))
}

fn index(v: &Value, what: &str, len: usize) -> Result<usize, ProfileError> {
    let i = uint(v, what)? as usize;
    if i < len {
        Ok(i)
    } else {
        Err(bad(what))
    }
}

fn float(v: &Value, what: &str) -> Result<f64, ProfileError> {
    v.as_f64().ok_or_else(|| bad(what))
}

fn flag(v: &Value, what: &str) -> Result<bool, ProfileError> {
    v.as_bool().ok_or_else(|| bad(what))
}

fn key_from(v: &Value, p: &Profile) -> Result<StackKey, ProfileError> {
    Ok(StackKey {
        thread: index(&v[0], "counts", p.threads.len())?,
        stack: index(&v[1], "counts", p.stacks.len())?,
        idle: flag(&v[2], "counts")?,
        gil: flag(&v[3], "counts")?,
    })
}

/// The fold `to_json` wrote; every index is checked, so a bad answer is an
/// error and never a panic later.
pub fn from_json(v: &Value) -> Result<Profile, ProfileError> {
    let mut p = Profile::new(
        uint(&v["pid"], "pid")? as u32,
        float(&v["rate_hz"], "rate_hz")?,
        float(&v["started_at"], "started_at")?,
    );
    p.rank = v["rank"].as_i64();
    for f in rows(v, "frames")? {
        let key = FrameKey {
            func: f[0].as_str().ok_or_else(|| bad("frames"))?.to_string(),
            file: f[1].as_str().ok_or_else(|| bad("frames"))?.to_string(),
            line: f[2].as_i64().ok_or_else(|| bad("frames"))?,
        };
        p.frame(key);
    }
    for s in rows(v, "stacks")? {
        let ids = s
            .as_array()
            .ok_or_else(|| bad("stacks"))?
            .iter()
            .map(|f| index(f, "stacks", p.frames.len()))
            .collect::<Result<Vec<_>, _>>()?;
        let before = p.stacks.len();
        if p.stack(ids) != before {
            return Err(bad("stacks"));
        }
    }
    for t in rows(v, "threads")? {
        let id = uint(&t[0], "threads")?;
        let name = t[1].as_str().ok_or_else(|| bad("threads"))?;
        let before = p.threads.len();
        if p.thread(id, name) != before {
            return Err(bad("threads"));
        }
    }
    for c in rows(v, "counts")? {
        let key = key_from(&c[0], &p)?;
        p.counts.insert(key, uint(&c[1], "counts")?);
    }
    for s in rows(v, "slices")? {
        let key = StackKey {
            thread: index(&s[0], "slices", p.threads.len())?,
            stack: index(&s[1], "slices", p.stacks.len())?,
            idle: flag(&s[2], "slices")?,
            gil: flag(&s[3], "slices")?,
        };
        let slice = Slice::new(key, float(&s[4], "slices")?, float(&s[5], "slices")?);
        p.slices.push(slice.ok_or_else(|| bad("slices"))?);
    }
    for s in rows(v, "steps")? {
        let key = key_from(&s[0], &p)?;
        let step = s[1].as_i64().ok_or_else(|| bad("steps"))?;
        p.steps.insert((key, step), uint(&s[2], "steps")?);
    }
    for s in rows(v, "step_spans")? {
        let step = s[0].as_i64().ok_or_else(|| bad("step_spans"))?;
        p.step_spans.push((
            step,
            float(&s[1], "step_spans")?,
            float(&s[2], "step_spans")?,
        ));
    }
    p.ticks = uint(&v["ticks"], "ticks")?;
    p.missed = uint(&v["missed"], "missed")?;
    p.errors = uint(&v["errors"], "errors")?;
    p.duration_s = float(&v["duration_s"], "duration_s")?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FrameRef;

    #[test]
    fn a_fold_comes_back_as_it_went() {
        let mut p = Profile::new(42, 100.0, 1_700_000_000.5);
        p.rank = Some(3);
        let main = p.thread(7, "MainThread");
        let loader = p.thread(9, "loader");
        let frames = |line| {
            [("main", 1), ("hot", line)].map(|(func, line)| FrameRef {
                func,
                file: "/x/a.py",
                line,
            })
        };
        p.set_step(Some(5), 0.0);
        p.add_sample(main, &frames(5), false, true, 0.0);
        p.add_sample(main, &frames(5), false, true, 0.01);
        p.set_step(Some(6), 0.02);
        p.add_sample(loader, &frames(6), true, false, 0.02);
        p.ticks = 3;
        p.missed = 1;
        p.finish(0.03);

        let text = to_json(&p).to_string();
        let back = from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(
            (back.pid, back.rank, back.ticks, back.missed),
            (42, Some(3), 3, 1)
        );
        assert_eq!(back.frames, p.frames);
        assert_eq!(back.stacks, p.stacks);
        assert_eq!(back.threads, p.threads);
        assert_eq!(back.counts, p.counts);
        assert_eq!(back.slices, p.slices);
        assert_eq!(back.steps, p.steps);
        assert_eq!(back.step_spans, p.step_spans);
        assert_eq!(back.sorted_counts(), p.sorted_counts());
        // The indexes are rebuilt: the same frames land on the same stack.
        let mut back = back;
        back.add_sample(main, &frames(5), false, true, 0.04);
        assert_eq!(back.stacks.len(), p.stacks.len());
    }

    #[test]
    fn a_bad_index_is_an_error_not_a_panic() {
        let mut v = to_json(&Profile::new(1, 100.0, 0.0));
        v["stacks"] = json!([[0]]);
        assert!(from_json(&v).is_err());
        v["stacks"] = json!([]);
        v["counts"] = json!([[[0, 0, false, false], 1]]);
        assert!(from_json(&v).is_err());
        assert!(from_json(&json!({"pid": "x"})).is_err());
    }
}
