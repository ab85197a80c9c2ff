//! A job's profile: one [`Profile`] per rank, each folded where it was
//! taken, and the views no single-process profiler gives: a flame graph of
//! every rank merged in which each frame says on which ranks it was seen,
//! and one rank against the median of the others.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rankscope_core::ranks::compress;
use serde_json::Value;

use crate::formats::{self, Format, Tally, WriteOptions, IDLE};
use crate::profile::Profile;
use crate::ProfileError;

/// Every rank's profile, in rank order.
#[derive(Debug, Default)]
pub struct JobProfile {
    pub profiles: Vec<Profile>,
}

/// A stack as the merged views name it: the thread's name (its id differs
/// from rank to rank), then the frames, the innermost marked when idle.
fn merged_path(p: &Profile, key: &crate::StackKey, options: &WriteOptions) -> Vec<String> {
    let mut path = Vec::with_capacity(p.stacks[key.stack].len() + 1);
    if options.prefix {
        let name = &p.threads[key.thread].name;
        path.push(if name.is_empty() {
            "(unnamed thread)".to_string()
        } else {
            formats::clean(name)
        });
    }
    path.extend(formats::labels(p, key, options.lines));
    path
}

/// A prefix tree of the merged stacks: each node is one frame at one place
/// in the tree, with the ranks it was seen on and its own (leaf) count.
#[derive(Default)]
struct Tree {
    labels: Vec<String>,
    parent: Vec<usize>,
    children: Vec<HashMap<String, usize>>,
    ranks: Vec<BTreeSet<i64>>,
    own: Vec<u64>,
}

impl Tree {
    fn new() -> Tree {
        let mut tree = Tree::default();
        tree.push(String::new(), 0);
        tree
    }

    fn push(&mut self, label: String, parent: usize) -> usize {
        self.labels.push(label);
        self.parent.push(parent);
        self.children.push(HashMap::new());
        self.ranks.push(BTreeSet::new());
        self.own.push(0);
        self.labels.len() - 1
    }

    fn add(&mut self, path: &[String], rank: i64, count: u64) {
        let mut node = 0;
        for label in path {
            node = match self.children[node].get(label) {
                Some(&child) => child,
                None => {
                    let child = self.push(label.clone(), node);
                    self.children[node].insert(label.clone(), child);
                    child
                }
            };
            self.ranks[node].insert(rank);
        }
        self.own[node] += count;
    }
}

impl JobProfile {
    pub fn ranks(&self) -> BTreeSet<i64> {
        self.profiles.iter().filter_map(|p| p.rank).collect()
    }

    pub fn total(&self) -> u64 {
        self.profiles.iter().map(Profile::total).sum()
    }

    /// Folded stacks: with the prefix, each rank's lines under
    /// `rank N;thread (id);`; without it, every rank's samples summed by
    /// stack.
    pub fn folded(&self, options: &WriteOptions) -> String {
        if options.prefix {
            return self
                .profiles
                .iter()
                .map(|p| formats::folded(p, options))
                .collect();
        }
        let mut summed: BTreeMap<String, u64> = BTreeMap::new();
        for p in &self.profiles {
            for (key, count) in &p.counts {
                let path = merged_path(p, key, options);
                if !path.is_empty() {
                    *summed.entry(path.join(";")).or_default() += count;
                }
            }
        }
        let mut lines: Vec<(String, u64)> = summed.into_iter().collect();
        lines.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        lines
            .into_iter()
            .map(|(stack, count)| format!("{stack} {count}\n"))
            .collect()
    }

    /// Every rank merged, each frame named with the ranks it was seen on:
    /// ` [4/4 ranks]`, or ` [1/4 ranks: 3]` where only some had it. The
    /// mark depends only on the frame's place in the tree, so equal places
    /// still merge in the flame graph.
    pub fn merged_folded(&self, options: &WriteOptions) -> String {
        let all = self.ranks();
        let mut tree = Tree::new();
        for p in &self.profiles {
            let rank = p.rank.unwrap_or(-1);
            for (key, count) in &p.counts {
                let path = merged_path(p, key, options);
                if !path.is_empty() {
                    tree.add(&path, rank, *count);
                }
            }
        }
        let mark = |ranks: &BTreeSet<i64>| {
            if ranks.len() == all.len() {
                format!(" [{}/{} ranks]", ranks.len(), all.len())
            } else {
                format!(
                    " [{}/{} ranks: {}]",
                    ranks.len(),
                    all.len(),
                    compress(ranks.iter().copied())
                )
            }
        };
        let mut lines = Vec::new();
        for node in 1..tree.labels.len() {
            if tree.own[node] == 0 {
                continue;
            }
            let mut path = Vec::new();
            let mut at = node;
            while at != 0 {
                path.push(format!("{}{}", tree.labels[at], mark(&tree.ranks[at])));
                at = tree.parent[at];
            }
            path.reverse();
            lines.push((path.join(";"), tree.own[node]));
        }
        lines.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        lines
            .into_iter()
            .map(|(stack, count)| format!("{stack} {count}\n"))
            .collect()
    }

    /// Each merged stack's share of every rank's samples.
    fn shares(&self, options: &WriteOptions) -> BTreeMap<String, BTreeMap<i64, f64>> {
        let mut out: BTreeMap<String, BTreeMap<i64, f64>> = BTreeMap::new();
        for p in &self.profiles {
            let (Some(rank), total) = (p.rank, p.total()) else {
                continue;
            };
            if total == 0 {
                continue;
            }
            for (key, count) in &p.counts {
                let path = merged_path(p, key, options);
                if !path.is_empty() {
                    *out.entry(path.join(";"))
                        .or_default()
                        .entry(rank)
                        .or_default() += *count as f64 / total as f64;
                }
            }
        }
        out
    }

    fn check_diff_rank(&self, rank: i64) -> Result<&Profile, ProfileError> {
        let profile = self
            .profiles
            .iter()
            .find(|p| p.rank == Some(rank))
            .ok_or_else(|| ProfileError::Diff(format!("rank {rank} was not profiled")))?;
        if self.profiles.len() < 2 {
            return Err(ProfileError::Diff(
                "a diff needs at least one other rank".into(),
            ));
        }
        if profile.total() == 0 {
            return Err(ProfileError::Diff(format!("rank {rank} has no samples")));
        }
        Ok(profile)
    }

    /// Differential folded stacks (`stack before after`, as inferno and
    /// Brendan Gregg's difffolded.pl write them): before is the median of
    /// the other ranks' shares, scaled to `rank`'s sample count; after is
    /// `rank`'s own count. The flame graph is `rank`'s, red where it spends
    /// more time than the median rank, blue where less.
    pub fn diff_folded(&self, rank: i64, options: &WriteOptions) -> Result<String, ProfileError> {
        let profile = self.check_diff_rank(rank)?;
        let total = profile.total() as f64;
        let others: Vec<i64> = self.ranks().into_iter().filter(|&r| r != rank).collect();
        let mut lines = Vec::new();
        for (stack, by_rank) in self.shares(options) {
            let theirs: Vec<f64> = others
                .iter()
                .map(|r| by_rank.get(r).copied().unwrap_or(0.0))
                .collect();
            let before = (median(theirs) * total).round() as u64;
            let after = (by_rank.get(&rank).copied().unwrap_or(0.0) * total).round() as u64;
            if before > 0 || after > 0 {
                lines.push(format!("{stack} {before} {after}\n"));
            }
        }
        Ok(lines.concat())
    }

    /// The terminal's diff: per function, the share of `rank`'s samples
    /// with it on the stack, against the median other rank's, the largest
    /// gains first. On the stack rather than running itself: the loop a
    /// rank is stuck in rarely is the leaf.
    pub fn diff_top(&self, rank: i64, options: &WriteOptions) -> Result<String, ProfileError> {
        self.check_diff_rank(rank)?;
        let mut by_function: BTreeMap<String, BTreeMap<i64, f64>> = BTreeMap::new();
        for (stack, by_rank) in self.shares(&WriteOptions {
            lines: false,
            prefix: false,
            ..options.clone()
        }) {
            let functions: BTreeSet<&str> = stack.split(';').collect();
            for function in functions {
                let entry = by_function.entry(function.to_string()).or_default();
                for (&r, share) in &by_rank {
                    *entry.entry(r).or_default() += share;
                }
            }
        }
        let others: Vec<i64> = self.ranks().into_iter().filter(|&r| r != rank).collect();
        let mut rows: Vec<(String, f64, f64)> = by_function
            .into_iter()
            .map(|(name, by_rank)| {
                let mine = by_rank.get(&rank).copied().unwrap_or(0.0);
                let theirs = median(
                    others
                        .iter()
                        .map(|r| by_rank.get(r).copied().unwrap_or(0.0))
                        .collect(),
                );
                (name, mine, theirs)
            })
            .collect();
        rows.sort_by(|a, b| (b.1 - b.2).total_cmp(&(a.1 - a.2)).then(a.0.cmp(&b.0)));
        let mut out = format!(
            "rank {rank} against the median of {} other rank{} (share of samples with the function on the stack)\n",
            others.len(),
            if others.len() == 1 { "" } else { "s" }
        );
        out += &format!(
            "{:>8} {:>8} {:>8}  function\n",
            format!("rank {rank}"),
            "median",
            "diff"
        );
        for (name, mine, theirs) in rows.into_iter().take(options.top) {
            out += &format!(
                "{:>7.1}% {:>7.1}% {:>+7.1}%  {name}\n",
                mine * 100.0,
                theirs * 100.0,
                (mine - theirs) * 100.0
            );
        }
        Ok(out)
    }

    /// The terminal's view of a job: per function, self and total share of
    /// every rank's samples, and the ranks it was on the stack of.
    pub fn top(&self, options: &WriteOptions) -> String {
        let all = self.ranks();
        let total = self.total();
        let mut tally = Tally::default();
        let mut seen_on: HashMap<String, BTreeSet<i64>> = HashMap::new();
        for p in &self.profiles {
            let rank = p.rank.unwrap_or(-1);
            tally.add(p, |name| {
                seen_on.entry(name.to_string()).or_default().insert(rank);
            });
        }
        let rows = tally.rows();
        let inside = tally.inside;
        let pct = |n: u64| {
            if total == 0 {
                0.0
            } else {
                n as f64 * 100.0 / total as f64
            }
        };
        let missed: u64 = self.profiles.iter().map(|p| p.missed).sum();
        let mut out = format!(
            "{} ranks: {total} samples{}\n",
            all.len(),
            if missed > 0 {
                format!(", {missed} ticks missed")
            } else {
                String::new()
            }
        );
        out += &format!("{:>7} {:>7}  {:<10} function\n", "self%", "total%", "ranks");
        for (name, count) in rows.into_iter().take(options.top) {
            let base = name.strip_suffix(IDLE).unwrap_or(&name);
            let total_count = inside.get(base).copied().unwrap_or(count);
            let ranks = seen_on.get(&name).cloned().unwrap_or_default();
            let ranks = if ranks.len() == all.len() {
                "all".to_string()
            } else {
                compress(ranks)
            };
            out += &format!(
                "{:>6.1}% {:>6.1}%  {ranks:<10} {name}\n",
                pct(count),
                pct(total_count)
            );
        }
        out
    }

    fn title(&self) -> String {
        let rate = self.profiles.first().map(|p| p.rate_hz).unwrap_or(0.0);
        let duration = self
            .profiles
            .iter()
            .map(|p| p.duration_s)
            .fold(0.0, f64::max);
        format!(
            "{} ranks: {} samples, {duration:.1} s at {rate} Hz",
            self.ranks().len(),
            self.total()
        )
    }

    /// Writes the job to `path` in the format its name says; with `diff`,
    /// that rank against the median of the others (flame graph, folded or
    /// table).
    pub fn write(
        &self,
        path: &str,
        options: &WriteOptions,
        diff: Option<i64>,
    ) -> Result<Format, ProfileError> {
        let format = Format::of(path)?;
        let json = |v: Value| serde_json::to_vec(&v).expect("JSON");
        let ps: Vec<&Profile> = self.profiles.iter().collect();
        let bytes = match (format, diff) {
            (Format::Svg, Some(rank)) => {
                let title = format!("rank {rank} against the median rank");
                let subtitle = "red: more time than the median rank, blue: less".to_string();
                formats::flame_graph(&self.diff_folded(rank, options)?, title, Some(subtitle))?
            }
            (Format::Folded, Some(rank)) => self.diff_folded(rank, options)?.into_bytes(),
            (Format::Top, Some(rank)) => self.diff_top(rank, options)?.into_bytes(),
            (Format::Speedscope | Format::Chrome, Some(_)) => {
                return Err(ProfileError::Diff(
                    "--diff writes .svg, .folded or .txt".into(),
                ))
            }
            (Format::Svg, None) => {
                formats::flame_graph(&self.merged_folded(options), self.title(), None)?
            }
            (Format::Speedscope, None) => json(formats::speedscope_of(&ps, "the job", options)),
            (Format::Chrome, None) => json(formats::chrome_of(&ps, options)),
            (Format::Folded, None) => self.folded(options).into_bytes(),
            (Format::Top, None) => self.top(options).into_bytes(),
        };
        formats::write_bytes(path, &bytes)?;
        Ok(format)
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::FrameKey;

    /// A rank whose main thread spends `hot` samples in `work` and the rest
    /// in `slow` (the odd rank) or `wait` (idle).
    fn rank(rank: i64, work: u64, odd: u64, wait: u64) -> Profile {
        let mut p = Profile::new(1000 + rank as u32, 100.0, 0.0);
        p.rank = Some(rank);
        let t = p.thread(1000 + rank as u64, "MainThread");
        let f = |p: &mut Profile, n: &str| {
            p.frame(FrameKey {
                func: n.into(),
                file: "/job/train.py".into(),
                line: 0,
            })
        };
        let (main, w, s, c) = (
            f(&mut p, "main"),
            f(&mut p, "work"),
            f(&mut p, "slow"),
            f(&mut p, "allreduce"),
        );
        let mut at = 0.0;
        for (frames, n, idle) in [
            (vec![main, w], work, false),
            (vec![main, s], odd, false),
            (vec![main, c], wait, true),
        ] {
            for _ in 0..n {
                p.add(t, frames.clone(), idle, !idle, at);
                at += 0.01;
            }
        }
        p.finish(at);
        p
    }

    fn job() -> JobProfile {
        JobProfile {
            profiles: vec![
                rank(0, 60, 0, 40),
                rank(1, 60, 0, 40),
                rank(2, 60, 0, 40),
                rank(3, 30, 70, 0),
            ],
        }
    }

    #[test]
    fn the_table_names_the_ranks_a_function_was_on_the_stack_of() {
        let text = job().top(&WriteOptions::default());
        // `main` runs no sample itself, and is on every rank's stacks.
        let ranks = |function: &str| {
            text.lines()
                .find(|l| l.ends_with(function))
                .and_then(|l| l.split_whitespace().nth(2).map(str::to_string))
        };
        assert_eq!(ranks(" main (train.py)").as_deref(), Some("all"), "{text}");
        assert_eq!(ranks(" slow (train.py)").as_deref(), Some("3"), "{text}");
        assert!(
            text.contains("   0.0%  100.0%  all        main (train.py)"),
            "{text}"
        );
    }

    #[test]
    fn merged_frames_say_which_ranks_they_were_seen_on() {
        let text = job().merged_folded(&WriteOptions::default());
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines.contains(&"MainThread [4/4 ranks];main (train.py) [4/4 ranks];work (train.py) [4/4 ranks] 210"),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"MainThread [4/4 ranks];main (train.py) [4/4 ranks];slow (train.py) [1/4 ranks: 3] 70"),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"MainThread [4/4 ranks];main (train.py) [4/4 ranks];allreduce (train.py) [idle] [3/4 ranks: 0-2] 120"),
            "{lines:?}"
        );
    }

    #[test]
    fn the_diff_is_the_rank_against_the_median_of_the_others() {
        let j = job();
        let text = j
            .diff_folded(
                3,
                &WriteOptions {
                    lines: false,
                    ..WriteOptions::default()
                },
            )
            .unwrap();
        let lines: Vec<&str> = text.lines().collect();
        // The others spend 60 % in work: 60 of rank 3's 100 samples.
        assert!(
            lines.contains(&"MainThread;main (train.py);work (train.py) 60 30"),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"MainThread;main (train.py);slow (train.py) 0 70"),
            "{lines:?}"
        );
        let table = j.diff_top(3, &WriteOptions::default()).unwrap();
        let first = table.lines().nth(2).unwrap();
        assert!(
            first.contains("slow (train.py)") && first.contains("+70.0%"),
            "{table}"
        );
        let last = table.lines().last().unwrap();
        assert!(
            last.contains("allreduce (train.py) [idle]") && last.contains("-40.0%"),
            "{table}"
        );
        assert!(j.diff_folded(9, &WriteOptions::default()).is_err());
        assert!(j
            .write("/tmp/x.json", &WriteOptions::default(), Some(3))
            .is_err());
    }

    #[test]
    fn folded_with_the_prefix_keeps_ranks_apart_and_without_sums_them() {
        let j = job();
        let with = j.folded(&WriteOptions::default());
        assert!(
            with.lines()
                .any(|l| l == "rank 3;MainThread (1003);main (train.py);slow (train.py) 70"),
            "{with}"
        );
        let without = j.folded(&WriteOptions {
            prefix: false,
            ..WriteOptions::default()
        });
        assert!(
            without.lines().next() == Some("main (train.py);work (train.py) 210"),
            "{without}"
        );
        let top = j.top(&WriteOptions::default());
        assert!(
            top.lines()
                .any(|l| l.contains("slow (train.py)") && l.contains(" 3 ")),
            "{top}"
        );
    }

    #[test]
    fn speedscope_and_chrome_have_every_rank() {
        let j = job();
        let ps: Vec<&Profile> = j.profiles.iter().collect();
        let scope = formats::speedscope_of(&ps, "the job", &WriteOptions::default());
        let names: Vec<&str> = scope["profiles"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(names.len(), 5, "{names:?}");
        assert_eq!(names[4], "the job · all ranks and threads");
        let trace = formats::chrome_of(&ps, &WriteOptions::default());
        let processes: Vec<&Value> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "process_name")
            .collect();
        assert_eq!(processes.len(), 4);
        assert_eq!(processes[3]["args"]["name"], "rank 3 (pid 1003)");
    }
}
