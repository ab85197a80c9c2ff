//! The ids the adapter hands the editor, and what each stands for.
//!
//! The adapter owns every id the editor sees: probe thread ids are
//! `threading.get_ident()` values (~2^47) and a `--job` session has several
//! probes whose own ids collide, so each is given a small integer of its own.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

/// DAP id <-> key, allocated on first sight, from 1.
#[derive(Debug)]
pub(crate) struct Ids<K> {
    to_dap: HashMap<K, i64>,
    from_dap: HashMap<i64, K>,
    last: i64,
}

impl<K> Default for Ids<K> {
    fn default() -> Self {
        Ids {
            to_dap: HashMap::new(),
            from_dap: HashMap::new(),
            last: 0,
        }
    }
}

impl<K: Hash + Eq + Clone> Ids<K> {
    pub fn id(&mut self, key: K) -> i64 {
        if let Some(&id) = self.to_dap.get(&key) {
            return id;
        }
        self.last += 1;
        self.to_dap.insert(key.clone(), self.last);
        self.from_dap.insert(self.last, key);
        self.last
    }

    pub fn key(&self, id: i64) -> Option<&K> {
        self.from_dap.get(&id)
    }

    pub fn keys(&self) -> impl Iterator<Item = (i64, &K)> {
        self.from_dap.iter().map(|(&id, k)| (id, k))
    }

    pub fn remove(&mut self, id: i64) {
        if let Some(key) = self.from_dap.remove(&id) {
            self.to_dap.remove(&key);
        }
    }
}

/// Frames and variable references: (target, probe id) pairs that live only
/// while their thread stays stopped (the probe reuses its small ids after a
/// resume), so each remembers the DAP thread it belongs to.
#[derive(Debug, Default)]
pub(crate) struct Handles {
    ids: Ids<(usize, i64)>,
    owner: HashMap<i64, Option<i64>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Handle {
    pub target: usize,
    pub probe: i64,
    /// The DAP thread whose stop makes it valid; `None` for a reference
    /// from an evaluation outside any frame.
    pub thread: Option<i64>,
}

impl Handles {
    pub fn id(&mut self, target: usize, probe: i64, thread: Option<i64>) -> i64 {
        let id = self.ids.id((target, probe));
        self.owner.insert(id, thread);
        id
    }

    pub fn get(&self, id: i64) -> Option<Handle> {
        let &(target, probe) = self.ids.key(id)?;
        Some(Handle {
            target,
            probe,
            thread: self.owner.get(&id).copied().flatten(),
        })
    }

    /// The thread resumed: its frames and references mean nothing now.
    pub fn forget_thread(&mut self, thread: i64) {
        let stale: Vec<i64> = self
            .owner
            .iter()
            .filter(|(_, owner)| **owner == Some(thread))
            .map(|(&id, _)| id)
            .collect();
        for id in stale {
            self.owner.remove(&id);
            self.ids.remove(id);
        }
    }

    /// A target is gone: nothing of it can be asked for again.
    pub fn forget_target(&mut self, target: usize) {
        let stale: Vec<i64> = self
            .ids
            .keys()
            .filter(|(_, (t, _))| *t == target)
            .map(|(id, _)| id)
            .collect();
        for id in stale {
            self.owner.remove(&id);
            self.ids.remove(id);
        }
    }
}

/// One DAP breakpoint stands for a probe breakpoint on each target (a
/// `--job` session sets every breakpoint on every rank). Breakpoints come in
/// groups that the editor replaces whole (one file's line breakpoints, the
/// function breakpoints, the data breakpoints).
#[derive(Debug, Default)]
pub(crate) struct Breakpoints {
    last: i64,
    parts: HashMap<i64, Vec<(usize, i64)>>,
    by_part: HashMap<(usize, i64), i64>,
    groups: HashMap<String, Vec<i64>>,
}

impl Breakpoints {
    /// The group's breakpoints are now `entries` (each: the probe
    /// breakpoints it is made of; empty when no target set it). A probe
    /// breakpoint that was already there keeps its DAP id, so the editor
    /// does not see a breakpoint it kept vanish and come back.
    pub fn replace(&mut self, group: &str, entries: Vec<Vec<(usize, i64)>>) -> Vec<Option<i64>> {
        let old = self.groups.remove(group).unwrap_or_default();
        let mut used = HashSet::new();
        let mut assigned = Vec::with_capacity(entries.len());
        for entry in &entries {
            if entry.is_empty() {
                assigned.push(None);
                continue;
            }
            let kept = entry
                .iter()
                .filter_map(|part| self.by_part.get(part).copied())
                .find(|id| old.contains(id) && !used.contains(id));
            let id = kept.unwrap_or_else(|| {
                self.last += 1;
                self.last
            });
            used.insert(id);
            assigned.push(Some(id));
        }
        for id in &old {
            for part in self.parts.remove(id).unwrap_or_default() {
                self.by_part.remove(&part);
            }
        }
        for (entry, id) in entries.into_iter().zip(&assigned) {
            if let Some(id) = *id {
                for &part in &entry {
                    self.by_part.insert(part, id);
                }
                self.parts.insert(id, entry);
            }
        }
        self.groups.insert(
            group.to_string(),
            assigned.iter().flatten().copied().collect(),
        );
        assigned
    }

    pub fn dap_id(&self, target: usize, probe: i64) -> Option<i64> {
        self.by_part.get(&(target, probe)).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_small_stable_and_reversible() {
        let mut ids = Ids::default();
        let big: i64 = 140_234_567_890_123;
        assert_eq!(ids.id((0, big)), 1);
        assert_eq!(ids.id((0, 7)), 2);
        assert_eq!(ids.id((0, big)), 1);
        assert_eq!(ids.id((1, big)), 3, "the same probe id on another target");
        assert_eq!(ids.key(1), Some(&(0, big)));
        assert_eq!(ids.key(9), None);
    }

    #[test]
    fn a_resumed_threads_handles_are_forgotten() {
        let mut h = Handles::default();
        let a = h.id(0, 1, Some(1));
        let b = h.id(0, 2, Some(2));
        let free = h.id(0, 3, None);
        h.forget_thread(1);
        assert_eq!(h.get(a), None);
        assert_eq!(
            h.get(b),
            Some(Handle {
                target: 0,
                probe: 2,
                thread: Some(2)
            })
        );
        assert!(h.get(free).is_some());
        // The probe hands out its id 1 again after the resume: a new DAP id.
        let again = h.id(0, 1, Some(1));
        assert_ne!(again, a);
        h.forget_target(0);
        assert_eq!(h.get(b), None);
    }

    #[test]
    fn breakpoints_keep_their_ids_across_a_replace() {
        let mut bps = Breakpoints::default();
        let first = bps.replace("line:/a.py", vec![vec![(0, 10)], vec![(0, 11)], vec![]]);
        assert_eq!(first, vec![Some(1), Some(2), None]);
        let other = bps.replace("line:/b.py", vec![vec![(0, 12)]]);
        assert_eq!(other, vec![Some(3)]);
        // The probe kept breakpoint 11 and made a new one.
        let second = bps.replace("line:/a.py", vec![vec![(0, 11)], vec![(0, 13)]]);
        assert_eq!(second, vec![Some(2), Some(4)]);
        assert_eq!(bps.dap_id(0, 10), None, "removed with its group");
        assert_eq!(bps.dap_id(0, 13), Some(4));
        assert_eq!(bps.dap_id(0, 12), Some(3), "another group is untouched");
        // One DAP breakpoint over two ranks.
        let job = bps.replace("function", vec![vec![(0, 20), (1, 5)]]);
        assert_eq!(bps.dap_id(1, 5), job[0]);
        assert_eq!(bps.dap_id(0, 20), job[0]);
        bps.replace("function", vec![]);
        assert_eq!(bps.dap_id(1, 5), None);
    }
}
