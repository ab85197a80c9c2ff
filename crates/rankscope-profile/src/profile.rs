//! The fold: stacks interned once, counted per thread.

use std::collections::HashMap;

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
    pub counts: HashMap<StackKey, u64>,
    pub slices: Vec<Slice>,
    /// Samples taken (one per tick, all threads), ticks missed because a
    /// read took longer than the interval, reads that failed.
    pub ticks: u64,
    pub missed: u64,
    pub errors: u64,
    pub rate_hz: f64,
    pub started_at: f64,
    pub duration_s: f64,
    frame_ids: HashMap<FrameKey, usize>,
    stack_ids: HashMap<Vec<usize>, usize>,
    thread_ids: HashMap<u64, usize>,
    open: HashMap<usize, Slice>,
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

    /// One thread's sample at `at_s` seconds since the start; `frames` are
    /// frame indices, outermost first.
    pub fn add(&mut self, thread: usize, frames: Vec<usize>, idle: bool, gil: bool, at_s: f64) {
        let stack = match self.stack_ids.get(&frames) {
            Some(&id) => id,
            None => {
                self.stacks.push(frames.clone());
                self.stack_ids.insert(frames, self.stacks.len() - 1);
                self.stacks.len() - 1
            }
        };
        *self
            .counts
            .entry(StackKey {
                thread,
                stack,
                idle,
                gil,
            })
            .or_default() += 1;
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
        open.sort_by(|a, b| a.thread.cmp(&b.thread));
        self.slices.extend(open);
    }

    /// Only the samples `keep` says yes to (`--idle`, `--gil`, `--no-idle`).
    pub fn retain(&mut self, keep: impl Fn(&StackKey) -> bool) {
        self.counts.retain(|k, _| keep(k));
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
}
