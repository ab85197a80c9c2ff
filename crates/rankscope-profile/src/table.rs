//! `python.profile`: a profile kept in the process's run store, one row per
//! (thread, stack, idle, GIL) with its samples, so that SQL reads it live
//! (`rankscope PID query`) and after the process is gone (`query --run`),
//! and DuckDB or pandas open the same Arrow files.

use std::path::{Path, PathBuf};

use rankscope_core::tables::PROFILE;
use rankscope_store::{Cell, Store, StoreConfig};

use crate::{Profile, StackKey};

/// The profile's rows, in `python.profile`'s column order after ts (the
/// profile's start, the same for all its rows).
pub fn rows(profile: &Profile) -> Vec<(f64, Vec<Cell>)> {
    // Per stack: a row per step it was seen in, and one without a step for
    // the samples taken while no step was known.
    let mut by_step: Vec<(StackKey, Option<i64>, u64)> = Vec::new();
    let mut stepped: rustc_hash::FxHashMap<StackKey, u64> = Default::default();
    for (&(key, step), &n) in &profile.steps {
        by_step.push((key, Some(step), n));
        *stepped.entry(key).or_default() += n;
    }
    for (&key, &n) in &profile.counts {
        let rest = n.saturating_sub(stepped.get(&key).copied().unwrap_or(0));
        if rest > 0 {
            by_step.push((key, None, rest));
        }
    }
    by_step.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    by_step
        .into_iter()
        .map(|(key, step, samples)| {
            let thread = &profile.threads[key.thread];
            let frames = &profile.stacks[key.stack];
            let leaf = frames.last().map(|&f| &profile.frames[f]);
            let stack = frames
                .iter()
                .map(|&f| profile.frames[f].label(true))
                .collect::<Vec<_>>()
                .join(";");
            let cells = vec![
                Cell::Str(thread.name.clone()),
                Cell::Int(thread.id as i64),
                leaf.map_or(Cell::Null, |f| Cell::Str(f.func.clone())),
                leaf.map_or(Cell::Null, |f| Cell::Str(f.file.clone())),
                leaf.map_or(Cell::Null, |f| Cell::Int(f.line)),
                Cell::Int(frames.len() as i64),
                Cell::Str(stack),
                Cell::Int(samples as i64),
                Cell::Bool(key.idle),
                Cell::Bool(key.gil),
                step.map_or(Cell::Null, Cell::Int),
                Cell::Float(profile.rate_hz),
                Cell::Float(profile.duration_s),
            ];
            debug_assert_eq!(cells.len(), PROFILE.columns.len());
            (profile.started_at, cells)
        })
        .collect()
}

/// Appends the profile to `run_dir`'s store as the sampled process's rows
/// (its pid, its rank where known), written before this returns. The
/// file: `<run_dir>/tables/profile/<host>-<pid>-<n>.arrows`.
pub fn keep(profile: &Profile, run_dir: &Path, host: &str) -> Result<PathBuf, String> {
    let rows = rows(profile);
    let mut config = StoreConfig::new(profile.pid, host.to_string(), Some(run_dir.to_path_buf()));
    // All of it in one batch: nothing may be dropped as the oldest.
    config.ring_rows = rows.len().max(1);
    config.flush_rows = usize::MAX;
    let store = Store::new(config);
    store.set_rank(profile.rank);
    store
        .append_rows(PROFILE.name, rows)
        .map_err(|e| e.to_string())?;
    store.close();
    match store.describe()["spill"]["error"].as_str() {
        Some(error) => Err(error.to_string()),
        None => Ok(run_dir.join("tables").join(PROFILE.name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FrameRef;
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;

    fn frame<'a>(func: &'a str, line: i64) -> FrameRef<'a> {
        FrameRef {
            func,
            file: "/job/train.py",
            line,
        }
    }

    #[test]
    fn a_profile_is_kept_as_rows_of_its_process_and_read_back_by_pid() {
        let mut profile = Profile::new(4242, 100.0, 1_700_000_000.0);
        profile.rank = Some(3);
        let main = profile.thread(7, "MainThread");
        for i in 0..3 {
            // The first sample before the step was known, the others in step 11.
            profile.set_step((i > 0).then_some(11), i as f64 * 0.01);
            profile.add_sample(
                main,
                &[frame("<module>", 9), frame("step", 4)],
                false,
                true,
                i as f64 * 0.01,
            );
        }
        profile.set_step(None, 0.03);
        profile.add_sample(main, &[frame("<module>", 9)], true, false, 0.03);
        profile.finish(0.04);
        assert_eq!(
            profile.step_spans,
            [(11, 0.01, 0.03)],
            "step 11 from its first tick to its last"
        );

        let rows = rows(&profile);
        assert_eq!(rows.len(), 3, "one row per stack, thread and step");
        let (ts, top) = &rows[0];
        assert_eq!(*ts, 1_700_000_000.0);
        assert_eq!(top[2], Cell::Str("step".into()), "the innermost frame");
        assert_eq!(top[5], Cell::Int(2));
        assert_eq!(
            top[6],
            Cell::Str("<module> (train.py:9);step (train.py:4)".into())
        );
        assert_eq!(
            (&top[7], &top[10]),
            (&Cell::Int(2), &Cell::Int(11)),
            "two samples in step 11"
        );
        let unstepped: Vec<_> = rows
            .iter()
            .filter(|(_, r)| r[10] == Cell::Null)
            .map(|(_, r)| (r[7].clone(), r[8].clone()))
            .collect();
        assert_eq!(
            unstepped,
            [
                (Cell::Int(1), Cell::Bool(false)),
                (Cell::Int(1), Cell::Bool(true))
            ]
        );

        let dir = tempfile::tempdir().unwrap();
        keep(&profile, dir.path(), "node-1").unwrap();
        let mut other = Profile::new(42, 100.0, 0.0);
        let t = other.thread(1, "MainThread");
        other.add_sample(t, &[frame("other", 1)], false, true, 0.0);
        other.finish(0.01);
        // Host `node-1-42`, pid 42, wrote `node-1-42-42-0`: not pid 42 of `node-1`.
        keep(&other, dir.path(), "node-1-42").unwrap();
        let dirs = [dir.path().to_path_buf()];
        let mine =
            rankscope_store::read_table_of(&dirs, &PROFILE, None, Some(("node-1", 4242))).unwrap();
        let samples: i64 = mine
            .iter()
            .map(|b| {
                b.column_by_name("samples")
                    .unwrap()
                    .as_primitive::<Int64Type>()
                    .iter()
                    .flatten()
                    .sum::<i64>()
            })
            .sum();
        assert_eq!(samples, 4);
        let ranks: Vec<i64> = mine
            .iter()
            .flat_map(|b| {
                b.column_by_name("rank")
                    .unwrap()
                    .as_primitive::<Int64Type>()
                    .iter()
                    .flatten()
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(ranks, [3, 3, 3]);
        let all = rankscope_store::read_table(&dirs, &PROFILE, None).unwrap();
        assert_eq!(all.iter().map(|b| b.num_rows()).sum::<usize>(), 4);
        let none =
            rankscope_store::read_table_of(&dirs, &PROFILE, None, Some(("node-1", 42))).unwrap();
        assert!(
            none.is_empty(),
            "a host whose name ends in -42 is not pid 42's"
        );
    }
}
