//! The fold: stacks interned once, counted per thread.

pub mod wire;

use std::hash::{Hash, Hasher};

use rustc_hash::{FxHashMap, FxHasher};

/// A Python (or native) frame as profiles show it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FrameKey {
    pub func: String,
    pub file: String,
    pub line: i64,
}

impl FrameKey {
    /// `func (file.py:12)`, the file's last path component only.
    pub fn label(&self, lines: bool) -> String {
        let short = self.file.rsplit('/').next().unwrap_or(&self.file);
        if lines && self.line > 0 {
            format!("{} ({short}:{})", self.func, self.line)
        } else if short.is_empty() {
            self.func.clone()
        } else {
            format!("{} ({short})", self.func)
        }
    }
}

/// A frame as a sampler reads it, borrowed: a sample whose stack was seen
/// before is counted without copying or allocating anything.
#[derive(Debug, Clone, Copy)]
pub struct FrameRef<'a> {
    pub func: &'a str,
    pub file: &'a str,
    pub line: i64,
}

impl FrameRef<'_> {
    fn is(&self, key: &FrameKey) -> bool {
        self.line == key.line && self.func == key.func && self.file == key.file
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadInfo {
    pub id: u64,
    pub name: String,
}

/// Which thread, which stack, and how the thread was when sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackKey {
    pub thread: usize,
    pub stack: usize,
    pub idle: bool,
    pub gil: bool,
}

/// A run of consecutive samples of one thread with the same stack.
#[derive(Debug, Clone, PartialEq)]
pub struct Slice {
    pub thread: usize,
    pub stack: usize,
    pub idle: bool,
    pub gil: bool,
    pub start_s: f64,
    pub end_s: f64,
}

#[derive(Debug, Default, Clone)]
pub struct Profile {
    pub pid: u32,
    pub rank: Option<i64>,
    /// Interned frames; a stack holds their indices, outermost first.
    pub frames: Vec<FrameKey>,
    pub stacks: Vec<Vec<usize>>,
    pub threads: Vec<ThreadInfo>,
    pub counts: FxHashMap<StackKey, u64>,
    pub slices: Vec<Slice>,
    /// Samples taken (one per tick, all threads), ticks missed because a
    /// read took longer than the interval, reads that failed.
    pub ticks: u64,
    pub missed: u64,
    pub errors: u64,
    pub rate_hz: f64,
    pub started_at: f64,
    pub duration_s: f64,
    /// Samples by stack and torch step, for those taken while the target's
    /// probe knew the step (`set_step`); `counts` has every sample.
    pub steps: FxHashMap<(StackKey, i64), u64>,
    /// The steps as they went: (step, first seen, last seen + a tick), in
    /// seconds since the start; the Chrome trace draws them as a lane.
    pub step_spans: Vec<(i64, f64, f64)>,
    step: Option<i64>,
    frame_ids: FxHashMap<FrameKey, usize>,
    stack_ids: FxHashMap<Vec<usize>, usize>,
    /// Stacks by a hash of their borrowed frames (several where hashes
    /// collide): the fold's fast path.
    by_hash: FxHashMap<u64, Vec<usize>>,
    thread_ids: FxHashMap<u64, usize>,
    open: FxHashMap<usize, Slice>,
}

impl Profile {
    pub fn new(pid: u32, rate_hz: f64, started_at: f64) -> Profile {
        Profile {
            pid,
            rate_hz,
            started_at,
            ..Profile::default()
        }
    }

    pub fn frame(&mut self, key: FrameKey) -> usize {
        if let Some(&id) = self.frame_ids.get(&key) {
            return id;
        }
        self.frames.push(key.clone());
        self.frame_ids.insert(key, self.frames.len() - 1);
        self.frames.len() - 1
    }

    pub fn thread(&mut self, id: u64, name: &str) -> usize {
        if let Some(&at) = self.thread_ids.get(&id) {
            if self.threads[at].name.is_empty() && !name.is_empty() {
                self.threads[at].name = name.to_string();
            }
            return at;
        }
        self.threads.push(ThreadInfo {
            id,
            name: name.to_string(),
        });
        self.thread_ids.insert(id, self.threads.len() - 1);
        self.threads.len() - 1
    }

    /// One thread's sample at `at_s` seconds since the start; `frames`,
    /// outermost first, as the sampler read them. A stack seen before costs
    /// a hash of its frames and one comparison.
    pub fn add_sample(
        &mut self,
        thread: usize,
        frames: &[FrameRef<'_>],
        idle: bool,
        gil: bool,
        at_s: f64,
    ) {
        let mut hasher = FxHasher::default();
        for f in frames {
            f.func.hash(&mut hasher);
            f.file.hash(&mut hasher);
            f.line.hash(&mut hasher);
        }
        let hash = hasher.finish();
        let known = self.by_hash.get(&hash).and_then(|candidates| {
            candidates.iter().copied().find(|&stack| {
                let ids = &self.stacks[stack];
                ids.len() == frames.len()
                    && ids
                        .iter()
                        .zip(frames)
                        .all(|(&id, f)| f.is(&self.frames[id]))
            })
        });
        let stack = match known {
            Some(stack) => stack,
            None => {
                let ids: Vec<usize> = frames
                    .iter()
                    .map(|f| {
                        self.frame(FrameKey {
                            func: f.func.to_string(),
                            file: f.file.to_string(),
                            line: f.line,
                        })
                    })
                    .collect();
                let stack = self.stack(ids);
                self.by_hash.entry(hash).or_default().push(stack);
                stack
            }
        };
        self.count(thread, stack, idle, gil, at_s);
    }

    /// The same with `frames` already interned (frame indices).
    pub fn add(&mut self, thread: usize, frames: Vec<usize>, idle: bool, gil: bool, at_s: f64) {
        let stack = self.stack(frames);
        self.count(thread, stack, idle, gil, at_s);
    }

    fn stack(&mut self, frames: Vec<usize>) -> usize {
        match self.stack_ids.get(&frames) {
            Some(&id) => id,
            None => {
                self.stacks.push(frames.clone());
                self.stack_ids.insert(frames, self.stacks.len() - 1);
                self.stacks.len() - 1
            }
        }
    }

    /// The torch step the samples of the tick at `at_s` were taken in
    /// (None: not known).
    pub fn set_step(&mut self, step: Option<i64>, at_s: f64) {
        self.step = step;
        let Some(step) = step else { return };
        let tick = if self.rate_hz > 0.0 {
            1.0 / self.rate_hz
        } else {
            0.0
        };
        match self.step_spans.last_mut() {
            Some(last) if last.0 == step => last.2 = at_s + tick,
            _ => self.step_spans.push((step, at_s, at_s + tick)),
        }
    }

    fn count(&mut self, thread: usize, stack: usize, idle: bool, gil: bool, at_s: f64) {
        let key = StackKey {
            thread,
            stack,
            idle,
            gil,
        };
        *self.counts.entry(key).or_default() += 1;
        if let Some(step) = self.step {
            *self.steps.entry((key, step)).or_default() += 1;
        }
        let interval = if self.rate_hz > 0.0 {
            1.0 / self.rate_hz
        } else {
            0.0
        };
        match self.open.get_mut(&thread) {
            Some(run) if run.stack == stack && run.idle == idle && run.gil == gil => {
                run.end_s = at_s + interval
            }
            _ => {
                let run = Slice {
                    thread,
                    stack,
                    idle,
                    gil,
                    start_s: at_s,
                    end_s: at_s + interval,
                };
                if let Some(done) = self.open.insert(thread, run) {
                    self.slices.push(done);
                }
            }
        }
    }

    /// Closes the open runs; call once sampling has ended.
    pub fn finish(&mut self, duration_s: f64) {
        self.duration_s = duration_s;
        let mut open: Vec<Slice> = self.open.drain().map(|(_, s)| s).collect();
        open.sort_by_key(|s| s.thread);
        self.slices.extend(open);
    }

    /// Only the samples `keep` says yes to (`--idle`, `--gil`, `--no-idle`).
    pub fn retain(&mut self, keep: impl Fn(&StackKey) -> bool) {
        self.counts.retain(|k, _| keep(k));
        self.steps.retain(|(k, _), _| keep(k));
        self.slices.retain(|s| {
            keep(&StackKey {
                thread: s.thread,
                stack: s.stack,
                idle: s.idle,
                gil: s.gil,
            })
        });
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// (key, count), the most frequent first, ties in stack order: outputs
    /// are the same for the same samples.
    pub fn sorted_counts(&self) -> Vec<(StackKey, u64)> {
        let mut all: Vec<(StackKey, u64)> = self.counts.iter().map(|(k, v)| (*k, *v)).collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(p: &mut Profile, name: &str) -> usize {
        p.frame(FrameKey {
            func: name.into(),
            file: "/x/a.py".into(),
            line: 1,
        })
    }

    #[test]
    fn equal_stacks_fold_and_runs_become_slices() {
        let mut p = Profile::new(1, 100.0, 0.0);
        let t = p.thread(7, "MainThread");
        let (main, hot, cold) = (
            frame(&mut p, "main"),
            frame(&mut p, "hot"),
            frame(&mut p, "cold"),
        );
        for i in 0..3 {
            p.add(t, vec![main, hot], false, true, i as f64 * 0.01);
        }
        p.add(t, vec![main, cold], true, false, 0.03);
        p.finish(0.04);
        assert_eq!(p.stacks.len(), 2);
        assert_eq!(p.total(), 4);
        assert_eq!(p.sorted_counts()[0].1, 3);
        assert_eq!(p.slices.len(), 2);
        assert!((p.slices[0].end_s - 0.03).abs() < 1e-9, "{:?}", p.slices[0]);
        assert!(p.slices[1].idle);
    }

    #[test]
    fn borrowed_samples_fold_by_their_frames() {
        let mut p = Profile::new(1, 100.0, 0.0);
        let t = p.thread(7, "MainThread");
        let at = |line| {
            [
                FrameRef {
                    func: "main",
                    file: "/x/a.py",
                    line: 1,
                },
                FrameRef {
                    func: "hot",
                    file: "/x/a.py",
                    line,
                },
            ]
        };
        p.add_sample(t, &at(5), false, true, 0.0);
        p.add_sample(t, &at(5), false, true, 0.01);
        p.add_sample(t, &at(6), false, true, 0.02);
        assert_eq!(p.stacks.len(), 2);
        assert_eq!(p.frames.len(), 3);
        assert_eq!(p.sorted_counts()[0].1, 2);
        // The same stack through the interned road lands on the same id.
        let (main, hot) = (p.stacks[0][0], p.stacks[0][1]);
        p.add(t, vec![main, hot], false, true, 0.03);
        assert_eq!(p.stacks.len(), 2);
        assert_eq!(p.sorted_counts()[0].1, 3);
    }
}
