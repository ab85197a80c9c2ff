//! The formats a profile is written in, chosen by the output's name:
//! `.svg` (a flame graph, by inferno), `.speedscope.json` (speedscope),
//! `.json` (Chrome's trace event format, which Perfetto opens), `.folded`
//! (Brendan Gregg's folded stacks) and `.txt` (the top table).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;

use serde_json::{json, Value};

use crate::profile::{Profile, StackKey};
use crate::ProfileError;

/// What is appended to the innermost frame of an idle sample (sleeping, or
/// waiting on a lock, I/O or a collective): idle time is kept by default,
/// since a hang or a collective wait is what users look for.
pub const IDLE: &str = " [idle]";
/// The same mark as the flame graph gets it: inferno merges a frame over
/// lines that sort next to each other, and a plain space sorts before the
/// `;` of the frame's callees (`work [idle]` between `work` and
/// `work;compute` split `work` in two); a no-break space sorts after it.
const IDLE_SVG: &str = "\u{a0}[idle]";

/// A name as a folded line can carry it: `;` parts frames and a line
/// break ends the line, so neither may be in a thread's or a frame's name.
pub(crate) fn clean(name: &str) -> String {
    if name.contains([';', '\n', '\r']) {
        name.replace(';', ":").replace(['\n', '\r'], " ")
    } else {
        name.to_string()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Svg,
    Speedscope,
    Chrome,
    Folded,
    Top,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Svg => "flame graph",
            Format::Speedscope => "speedscope",
            Format::Chrome => "Chrome trace",
            Format::Folded => "folded stacks",
            Format::Top => "top table",
        })
    }
}

impl Format {
    pub fn of(path: &str) -> Result<Format, ProfileError> {
        let lower = path.to_ascii_lowercase();
        Ok(if lower.ends_with(".speedscope.json") {
            Format::Speedscope
        } else if lower.ends_with(".json") {
            Format::Chrome
        } else if lower.ends_with(".svg") {
            Format::Svg
        } else if lower.ends_with(".folded") || lower.ends_with(".collapsed") {
            Format::Folded
        } else if lower.ends_with(".txt") {
            Format::Top
        } else {
            return Err(ProfileError::Format(path.to_string()));
        })
    }
}

#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// Line numbers in frame names (`func (file.py:12)`), else `func (file.py)`.
    pub lines: bool,
    /// `rank;thread;` (or `pid;thread;`) before each folded stack.
    pub prefix: bool,
    /// Rows of the top table.
    pub top: usize,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            lines: true,
            prefix: true,
            top: 20,
        }
    }
}

pub(crate) fn process_label(p: &Profile) -> String {
    match p.rank {
        Some(rank) => format!("rank {rank}"),
        None => format!("pid {}", p.pid),
    }
}

pub(crate) fn thread_label(p: &Profile, thread: usize) -> String {
    let t = &p.threads[thread];
    if t.name.is_empty() {
        format!("thread {}", t.id)
    } else {
        format!("{} ({})", t.name, t.id)
    }
}

/// A stack's frame labels, outermost first, the innermost marked when idle.
pub(crate) fn labels(p: &Profile, key: &StackKey, lines: bool) -> Vec<String> {
    let mut out: Vec<String> = p.stacks[key.stack]
        .iter()
        .map(|&f| clean(&p.frames[f].label(lines)))
        .collect();
    if key.idle {
        match out.last_mut() {
            Some(last) => last.push_str(IDLE),
            None => out.push(IDLE.trim().to_string()),
        }
    }
    out
}

pub fn folded(p: &Profile, options: &WriteOptions) -> String {
    // Stacks apart in the profile (lines, threads, the GIL) may print the
    // same without lines or the prefix: one line each, their counts summed.
    let mut summed: HashMap<String, u64> = HashMap::new();
    for (key, count) in &p.counts {
        let mut parts = Vec::new();
        if options.prefix {
            parts.push(process_label(p));
            parts.push(clean(&thread_label(p, key.thread)));
        }
        parts.extend(labels(p, key, options.lines));
        if !parts.is_empty() {
            *summed.entry(parts.join(";")).or_default() += count;
        }
    }
    let mut lines: Vec<(String, u64)> = summed.into_iter().collect();
    lines.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    lines
        .into_iter()
        .map(|(stack, count)| format!("{stack} {count}\n"))
        .collect()
}

pub fn svg(p: &Profile, options: &WriteOptions) -> Result<Vec<u8>, ProfileError> {
    let title = format!(
        "{}: {} samples, {:.1} s at {} Hz",
        process_label(p),
        p.total(),
        p.duration_s,
        p.rate_hz
    );
    flame_graph(&folded(p, options), title, None)
}

/// An SVG flame graph of folded lines (`stack count`, or `stack before
/// after` for a differential one).
pub(crate) fn flame_graph(
    folded: &str,
    title: String,
    subtitle: Option<String>,
) -> Result<Vec<u8>, ProfileError> {
    if folded.trim().is_empty() {
        // inferno draws no graph of nothing; the other formats write an
        // empty profile, and so does this one: a page that says so.
        return Ok(no_samples_svg(&title, subtitle.as_deref()));
    }
    let mut flame = inferno::flamegraph::Options::default();
    flame.title = title;
    flame.subtitle = subtitle;
    flame.count_name = "samples".into();
    let mut out = Vec::new();
    let folded = folded.replace(IDLE, IDLE_SVG);
    inferno::flamegraph::from_lines(&mut flame, folded.lines(), &mut out)
        .map_err(|e| ProfileError::FlameGraph(e.to_string()))?;
    Ok(out)
}

fn no_samples_svg(title: &str, subtitle: Option<&str>) -> Vec<u8> {
    let escape = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;")
    };
    let line = |y: u32, size: u32, text: &str| {
        format!(
            "<text x=\"600\" y=\"{y}\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"{size}\">{}</text>",
            escape(text)
        )
    };
    format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n<svg version=\"1.1\" width=\"1200\" height=\"90\" xmlns=\"http://www.w3.org/2000/svg\">{}{}{}</svg>\n",
        line(24, 17, title),
        subtitle.map(|s| line(46, 12, s)).unwrap_or_default(),
        line(70, 12, "no samples to draw")
    )
    .into_bytes()
}

/// speedscope's file format: one sampled profile per thread, then one
/// that merges them all, weighted in seconds.
pub fn speedscope(p: &Profile, options: &WriteOptions) -> Value {
    speedscope_of(&[p], &process_label(p), options)
}

/// The same for several processes (a job's ranks): a profile per process
/// and thread, then one that merges every process and thread.
pub(crate) fn speedscope_of(ps: &[&Profile], name: &str, options: &WriteOptions) -> Value {
    let mut frames: Vec<Value> = Vec::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    let mut frame_of = |label: String, file: &str, line: i64| -> usize {
        *ids.entry(label.clone()).or_insert_with(|| {
            frames.push(json!({"name": label, "file": file, "line": line}));
            frames.len() - 1
        })
    };
    let mut per_thread: BTreeMap<(usize, usize), (Vec<Value>, Vec<f64>)> = BTreeMap::new();
    let mut merged: (Vec<Value>, Vec<f64>) = (Vec::new(), Vec::new());
    for (at, p) in ps.iter().enumerate() {
        let interval = 1.0 / p.rate_hz.max(0.001);
        for (key, count) in p.sorted_counts() {
            let names = labels(p, &key, options.lines);
            let stack: Vec<usize> = names
                .into_iter()
                .enumerate()
                .map(|(i, name)| {
                    let frame = p.stacks[key.stack].get(i).map(|&f| &p.frames[f]);
                    frame_of(
                        name,
                        frame.map(|f| f.file.as_str()).unwrap_or(""),
                        frame.map(|f| f.line).unwrap_or(0),
                    )
                })
                .collect();
            let weight = count as f64 * interval;
            let entry = per_thread.entry((at, key.thread)).or_default();
            entry.0.push(json!(stack));
            entry.1.push(weight);
            merged.0.push(json!(stack));
            merged.1.push(weight);
        }
    }
    let profile = |name: String, (samples, weights): (Vec<Value>, Vec<f64>)| {
        let end: f64 = weights.iter().sum();
        json!({"type": "sampled", "name": name, "unit": "seconds", "startValue": 0.0, "endValue": end, "samples": samples, "weights": weights})
    };
    let mut profiles: Vec<Value> = per_thread
        .into_iter()
        .map(|((at, thread), data)| {
            let p = ps[at];
            profile(
                format!("{} · {}", process_label(p), thread_label(p, thread)),
                data,
            )
        })
        .collect();
    let everything = if ps.len() > 1 {
        format!("{name} · all ranks and threads")
    } else {
        format!("{name} · all threads")
    };
    profiles.push(profile(everything, merged));
    json!({
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": profiles,
        "name": format!("rankscope profile of {name}"),
        "activeProfileIndex": 0,
        "exporter": concat!("rankscope ", env!("CARGO_PKG_VERSION")),
    })
}

/// Chrome's trace event format (Perfetto opens it): a process named after
/// the rank or pid, a lane per thread, and a complete event ("X") per frame
/// for each run of samples in which that frame stayed on the stack.
pub fn chrome(p: &Profile, options: &WriteOptions) -> Value {
    chrome_of(&[p], options)
}

/// The same for several processes (a job's ranks): a process each, on one
/// wall clock.
pub(crate) fn chrome_of(ps: &[&Profile], options: &WriteOptions) -> Value {
    let mut events = Vec::new();
    for p in ps {
        chrome_events(p, options, &mut events);
    }
    let pids: Vec<u32> = ps.iter().map(|p| p.pid).collect();
    let rate = ps.first().map(|p| p.rate_hz).unwrap_or(0.0);
    json!({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"exporter": "rankscope", "pids": pids, "rate_hz": rate}})
}

/// The Chrome trace's lane for the torch steps: a thread id no thread has
/// (Linux thread ids stay below 2^22).
const STEPS_LANE: u64 = u32::MAX as u64;

fn chrome_events(p: &Profile, options: &WriteOptions, events: &mut Vec<Value>) {
    let pid = p.pid;
    events.push(
        json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": match p.rank {
            Some(rank) => format!("rank {rank} (pid {pid})"),
            None => format!("pid {pid}"),
        }}}),
    );
    if let Some(rank) = p.rank {
        // Perfetto and chrome://tracing order processes by this.
        events.push(json!({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": rank}}));
    }
    for (i, t) in p.threads.iter().enumerate() {
        events.push(json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": t.id, "args": {"name": thread_label(p, i)}}));
    }
    // Every time as whole microseconds since the epoch, each end rounded
    // the same way wherever it falls: at 1.8e15 us an f64 steps by 0.25 us,
    // so a slice's `ts + dur` in floats could pass the `ts` of the slice
    // after it, an overlap without nesting that the format forbids.
    let origin_us = p.started_at * 1e6;
    let us = |at_s: f64| (origin_us + at_s * 1e6).round() as i64;
    if !p.step_spans.is_empty() {
        // The torch steps as a lane of their own above the threads, so a
        // slow step lines up with what the threads did in it.
        events.push(json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": STEPS_LANE, "args": {"name": "torch steps"}}));
        events.push(json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": STEPS_LANE, "args": {"sort_index": -1}}));
        for &(step, start, end) in &p.step_spans {
            events.push(json!({"ph": "X", "name": format!("step {step}"), "cat": "torch", "pid": pid, "tid": STEPS_LANE,
                "ts": us(start), "dur": (us(end) - us(start)).max(0), "args": {"step": step}}));
        }
    }
    let gap = 1.5 / p.rate_hz.max(0.001);
    let mut by_thread: BTreeMap<usize, Vec<&crate::profile::Slice>> = BTreeMap::new();
    for s in &p.slices {
        by_thread.entry(s.key().thread).or_default().push(s);
    }
    for (thread, mut slices) in by_thread {
        slices.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        let tid = p.threads[thread].id;
        // (label, start in seconds) of the frames open now, outermost first.
        let mut open: Vec<(String, f64)> = Vec::new();
        // (start, duration, depth, label) of the frames closed.
        let mut done: Vec<(i64, i64, usize, String)> = Vec::new();
        let mut last_end = 0.0;
        let close = |open: &mut Vec<(String, f64)>,
                     keep: usize,
                     at: f64,
                     done: &mut Vec<(i64, i64, usize, String)>| {
            while open.len() > keep {
                let (name, start) = open.pop().expect("non-empty");
                done.push((us(start), (us(at) - us(start)).max(0), open.len(), name));
            }
        };
        for s in slices {
            if s.start_s - last_end > gap {
                close(&mut open, 0, last_end, &mut done);
            }
            let key = s.key();
            let names = labels(p, &key, options.lines);
            let common = open
                .iter()
                .zip(&names)
                .take_while(|((a, _), b)| a == *b)
                .count();
            close(&mut open, common, s.start_s, &mut done);
            for name in names.into_iter().skip(common) {
                open.push((name, s.start_s));
            }
            last_end = s.end_s;
        }
        close(&mut open, 0, last_end, &mut done);
        // Viewers nest slices that start together by their order in the
        // file: the longer first, and of equal ones the outer, or a frame
        // that spans the profile is drawn under its own callees.
        done.sort_by_key(|&(ts, dur, depth, _)| (ts, std::cmp::Reverse(dur), depth));
        for (ts, dur, _, name) in done {
            events.push(
                json!({"ph": "X", "name": name, "cat": "python", "pid": pid, "tid": tid,
                "ts": ts, "dur": dur}),
            );
        }
    }
}

/// Per function: the samples in which it was running itself (`own`, its
/// idle samples under the name marked `[idle]`) and those in which it was
/// on the stack at all (`inside`).
#[derive(Default)]
pub(crate) struct Tally {
    pub own: HashMap<String, u64>,
    pub inside: HashMap<String, u64>,
}

impl Tally {
    /// (function, self count) for the table: by self count, then total;
    /// functions that only call others (self 0) come after the rest, by
    /// their total (a caller's share of the time is what a table of
    /// callees hides).
    pub fn rows(&self) -> Vec<(String, u64)> {
        let mut rows: Vec<(String, u64)> = self.own.iter().map(|(n, c)| (n.clone(), *c)).collect();
        // A function that ran only idle has its row already (marked): a
        // second row of self 0 beside it said nothing.
        rows.extend(
            self.inside
                .keys()
                .filter(|name| {
                    !self.own.contains_key(*name)
                        && !self.own.contains_key(&format!("{name}{IDLE}"))
                })
                .map(|name| (name.clone(), 0)),
        );
        let total = |name: &str| {
            self.inside
                .get(name.strip_suffix(IDLE).unwrap_or(name))
                .copied()
                .unwrap_or(0)
        };
        rows.sort_by(|a, b| {
            b.1.cmp(&a.1)
                .then(total(&b.0).cmp(&total(&a.0)))
                .then(a.0.cmp(&b.0))
        });
        rows
    }

    /// Adds `p`'s samples; `on_stack` is told each name counted, on the
    /// stack or running itself (idle, with its mark).
    pub fn add(&mut self, p: &Profile, mut on_stack: impl FnMut(&str)) {
        for (key, count) in &p.counts {
            let stack = &p.stacks[key.stack];
            let mut seen = HashSet::new();
            for &f in stack {
                // One line a row in the table, as in the folded lines.
                let name = clean(&p.frames[f].label(false));
                if seen.insert(name.clone()) {
                    on_stack(&name);
                    *self.inside.entry(name).or_default() += count;
                }
            }
            if let Some(&last) = stack.last() {
                let mut name = clean(&p.frames[last].label(false));
                if key.idle {
                    name.push_str(IDLE);
                    on_stack(&name);
                }
                *self.own.entry(name).or_default() += count;
            }
        }
    }
}

/// The terminal's view: per function, the share of samples in which it was
/// running itself (self) and on the stack at all (total).
pub fn top(p: &Profile, options: &WriteOptions) -> String {
    let total = p.total();
    let idle: u64 = p
        .counts
        .iter()
        .filter(|(k, _)| k.idle)
        .map(|(_, c)| c)
        .sum();
    let mut tally = Tally::default();
    tally.add(p, |_| {});
    let rows = tally.rows();
    let inside = tally.inside;
    let pct = |n: u64| {
        if total == 0 {
            0.0
        } else {
            n as f64 * 100.0 / total as f64
        }
    };
    let mut out = format!(
        "{}: {total} samples of {} thread{} over {:.1} s at {} Hz ({} idle{}{})\n",
        process_label(p),
        p.threads.len(),
        if p.threads.len() == 1 { "" } else { "s" },
        p.duration_s,
        p.rate_hz,
        idle,
        if p.missed > 0 {
            format!(", {} ticks missed", p.missed)
        } else {
            String::new()
        },
        if p.errors > 0 {
            format!(", {} failed reads", p.errors)
        } else {
            String::new()
        },
    );
    out += &format!("{:>7} {:>7}  function\n", "self%", "total%");
    for (name, count) in rows.into_iter().take(options.top) {
        let base = name.strip_suffix(IDLE).unwrap_or(&name);
        let total_count = inside.get(base).copied().unwrap_or(count);
        out += &format!("{:>6.1}% {:>6.1}%  {name}\n", pct(count), pct(total_count));
    }
    out
}

/// Writes `p` to `path` in the format its name says.
pub fn write(p: &Profile, path: &str, options: &WriteOptions) -> Result<Format, ProfileError> {
    let format = Format::of(path)?;
    let bytes = match format {
        Format::Svg => svg(p, options)?,
        Format::Speedscope => serde_json::to_vec(&speedscope(p, options)).expect("JSON"),
        Format::Chrome => serde_json::to_vec(&chrome(p, options)).expect("JSON"),
        Format::Folded => folded(p, options).into_bytes(),
        Format::Top => top(p, options).into_bytes(),
    };
    write_bytes(path, &bytes)?;
    Ok(format)
}

pub(crate) fn write_bytes(path: &str, bytes: &[u8]) -> Result<(), ProfileError> {
    let fail = |error| ProfileError::Write {
        path: path.to_string(),
        error,
    };
    let mut file = std::fs::File::create(path).map_err(fail)?;
    file.write_all(bytes).map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::FrameKey;

    /// A frame of /job/train.py.
    fn f(p: &mut Profile, func: &str, line: i64) -> usize {
        p.frame(FrameKey {
            func: func.into(),
            file: "/job/train.py".into(),
            line,
        })
    }

    fn sample_profile() -> Profile {
        let mut p = Profile::new(42, 100.0, 1000.0);
        let t = p.thread(42, "MainThread");
        let w = p.thread(43, "worker");
        let (main, hot, nap) = (
            f(&mut p, "main", 10),
            f(&mut p, "hot", 3),
            f(&mut p, "sleep", 0),
        );
        for i in 0..8 {
            p.add(t, vec![main, hot], false, true, i as f64 * 0.01);
            p.add(w, vec![nap], true, false, i as f64 * 0.01);
        }
        p.add(t, vec![main], false, true, 0.08);
        p.finish(0.09);
        p
    }

    #[test]
    fn folded_lines_carry_the_prefix_and_the_idle_mark() {
        let text = folded(&sample_profile(), &WriteOptions::default());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "pid 42;MainThread (42);main (train.py:10);hot (train.py:3) 8"
        );
        assert!(
            lines.contains(&"pid 42;worker (43);sleep (train.py) [idle] 8"),
            "{lines:?}"
        );
        let bare = folded(
            &sample_profile(),
            &WriteOptions {
                prefix: false,
                ..WriteOptions::default()
            },
        );
        assert!(
            bare.starts_with("main (train.py:10);hot (train.py:3) 8\n"),
            "{bare}"
        );
        // Without lines, two lines of one function are one stack.
        let mut p = sample_profile();
        let t = p.thread(42, "MainThread");
        let other = f(&mut p, "hot", 4);
        let main = p.stacks[0][0];
        p.add(t, vec![main, other], false, true, 0.09);
        let no_lines = folded(
            &p,
            &WriteOptions {
                lines: false,
                ..WriteOptions::default()
            },
        );
        assert!(
            no_lines.starts_with("pid 42;MainThread (42);main (train.py);hot (train.py) 9\n"),
            "{no_lines}"
        );
        assert_eq!(no_lines.matches("hot (train.py)").count(), 1, "{no_lines}");
    }

    #[test]
    fn an_idle_mark_does_not_split_its_frame_in_the_flame_graph() {
        let mut p = Profile::new(42, 100.0, 1000.0);
        let t = p.thread(42, "Main\nThread;x");
        let (main, work, compute) = (
            f(&mut p, "main", 1),
            f(&mut p, "work", 2),
            f(&mut p, "compute", 3),
        );
        for i in 0..30 {
            let (stack, idle) = match i % 3 {
                0 => (vec![main, work], false),
                1 => (vec![main, work], true),
                _ => (vec![main, work, compute], false),
            };
            p.add(t, stack, idle, true, i as f64 * 0.01);
        }
        p.finish(0.3);
        let svg = String::from_utf8(svg(&p, &WriteOptions::default()).unwrap()).unwrap();
        // One box for `work`, its own busy samples and its callee's, beside
        // its idle ones (a frame of its own, as in the folded lines).
        let boxes: Vec<&str> = svg
            .match_indices("<title>work (train.py:2) (")
            .map(|(at, _)| &svg[at..at + 60])
            .collect();
        assert_eq!(boxes.len(), 1, "{boxes:?}");
        assert!(boxes[0].contains("(20 samples"), "{boxes:?}");
        assert!(svg.contains("work (train.py:2)\u{a0}[idle] (10 samples"));
        // A line break or `;` in a thread's name stays inside its frame.
        let text = folded(&p, &WriteOptions::default());
        assert!(
            text.lines()
                .all(|l| l.starts_with("pid 42;Main Thread:x (42);main")),
            "{text}"
        );
    }

    #[test]
    fn a_steps_span_ends_where_the_next_begins_though_a_tick_came_early() {
        let mut p = Profile::new(42, 100.0, 1000.0);
        for (step, at) in [(1, 0.0), (1, 0.01), (2, 0.015), (2, 0.03), (3, 0.031)] {
            p.set_step(Some(step), at);
        }
        let spans = &p.step_spans;
        assert_eq!(spans.len(), 3, "{spans:?}");
        assert!(spans.windows(2).all(|w| w[0].2 <= w[1].1), "{spans:?}");
        assert_eq!(spans[2], (3, 0.031, 0.041));
    }

    #[test]
    fn a_profile_with_no_samples_is_an_svg_that_says_so_and_names_stay_on_one_line() {
        let empty = Profile::new(42, 100.0, 1000.0);
        let svg = String::from_utf8(svg(&empty, &WriteOptions::default()).unwrap()).unwrap();
        assert!(
            svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"),
            "{svg}"
        );
        assert!(svg.contains("no samples to draw"), "{svg}");

        let mut p = Profile::new(42, 100.0, 1000.0);
        let t = p.thread(1, "MainThread");
        let odd = f(&mut p, "gen\nerated", 3);
        p.add(t, vec![odd], false, true, 0.0);
        let text = top(&p, &WriteOptions::default());
        assert!(text.contains("gen erated"), "{text}");
        assert_eq!(text.lines().count(), 3, "{text}");
    }

    #[test]
    fn top_counts_self_and_total() {
        let text = top(&sample_profile(), &WriteOptions::default());
        // `sleep` ran idle only: its one row is the marked one.
        assert_eq!(text.matches("sleep (train.py)").count(), 1, "{text}");
        assert!(text.contains("  47.1%   47.1%  hot (train.py)"), "{text}");
        assert!(
            text.contains("  47.1%   47.1%  sleep (train.py) [idle]"),
            "{text}"
        );
        assert!(text.contains("   5.9%   52.9%  main (train.py)"), "{text}");
    }

    /// At epoch microseconds an f64 steps by 0.25 us: every slice must
    /// still end at or before the next one on its thread starts, and hold
    /// or stay apart from the others, the outer first.
    #[test]
    fn chrome_slices_nest_at_epoch_times() {
        let mut p = Profile::new(7, 1000.0, 1_795_791_486.072_149);
        let t = p.thread(7, "MainThread");
        let (main, a, b) = (
            f(&mut p, "main", 1),
            f(&mut p, "hot", 11),
            f(&mut p, "hot", 12),
        );
        for i in 0..3000 {
            let leaf = if (i / 3) % 2 == 0 { a } else { b };
            p.add(
                t,
                vec![main, leaf],
                false,
                true,
                i as f64 * 0.001 + (i % 7) as f64 * 1.3e-7,
            );
        }
        p.finish(3.0);
        let trace = chrome(&p, &WriteOptions::default());
        let slices: Vec<(i64, i64)> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .map(|e| (e["ts"].as_i64().unwrap(), e["dur"].as_i64().unwrap()))
            .collect();
        assert!(slices.len() > 1000, "{}", slices.len());
        let mut open: Vec<(i64, i64)> = Vec::new();
        for &(ts, dur) in &slices {
            while open.last().is_some_and(|&(t, d)| t + d <= ts) {
                open.pop();
            }
            if let Some(&(t, d)) = open.last() {
                assert!(
                    t <= ts && ts + dur <= t + d,
                    "({ts}, {dur}) overlaps ({t}, {d})"
                );
            }
            open.push((ts, dur));
        }
        // `main` spans them all and comes first.
        assert_eq!(slices[0].1, slices.iter().map(|s| s.1).max().unwrap());
    }

    #[test]
    fn chrome_nests_frames_and_speedscope_has_a_merged_profile() {
        let p = sample_profile();
        let trace = chrome(&p, &WriteOptions::default());
        let events = trace["traceEvents"].as_array().unwrap();
        let main = events
            .iter()
            .find(|e| e["name"] == "main (train.py:10)")
            .unwrap();
        let hot = events
            .iter()
            .find(|e| e["name"] == "hot (train.py:3)")
            .unwrap();
        assert!(
            (main["dur"].as_f64().unwrap() - 90_000.0).abs() < 1.0,
            "{main}"
        );
        assert!(
            (hot["dur"].as_f64().unwrap() - 80_000.0).abs() < 1.0,
            "{hot}"
        );
        assert_eq!(main["ts"], hot["ts"]);
        let scope = speedscope(&p, &WriteOptions::default());
        assert_eq!(scope["profiles"].as_array().unwrap().len(), 3);
        assert_eq!(scope["profiles"][2]["samples"].as_array().unwrap().len(), 3);
        assert!(svg(&p, &WriteOptions::default())
            .unwrap()
            .starts_with(b"<?xml"));
    }
}
