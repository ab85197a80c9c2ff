//! Which collective a hung job is stuck in, and which ranks never joined it:
//! the line `cluster bt` adds under the stacks.
//!
//! From `python.collectives` where the ranks record them: for each group,
//! the highest collective any rank has entered, the ranks still inside it
//! and since when, and the members that never entered it (with where their
//! main thread is instead). Where no rank records collectives, the same
//! sentence is made from the stacks alone: the ranks whose main thread is
//! inside a `torch.distributed` call, and the ones that are not.

use std::collections::{BTreeMap, BTreeSet};

use rankscope_core::protocol::{Frame, ProbeTableReply, StacksReply};
use serde_json::Value;

/// How long a collective must have waited before it reads as stuck: a
/// healthy job is inside collectives all the time, briefly.
pub const STUCK_AFTER_S: f64 = 1.0;

/// What `cluster bt` asks each rank for.
pub const COLUMNS: [&str; 7] = [
    "seq",
    "op",
    "process_group",
    "group_ranks",
    "state",
    "caller",
    "ts",
];

#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub seq: i64,
    pub op: String,
    pub group: String,
    pub members: Vec<i64>,
    pub in_flight: bool,
    pub started: f64,
}

/// A rank's `python.collectives` rows as `Record`s.
pub fn records(reply: &ProbeTableReply) -> Vec<Record> {
    let at = |name: &str| reply.columns.iter().position(|c| c == name);
    let (seq, op, group, members, state, ts) = (
        at("seq"),
        at("op"),
        at("process_group"),
        at("group_ranks"),
        at("state"),
        at("ts"),
    );
    let cell = |row: &Vec<Value>, i: Option<usize>| {
        i.and_then(|i| row.get(i)).cloned().unwrap_or(Value::Null)
    };
    reply
        .rows
        .iter()
        .filter_map(|row| {
            Some(Record {
                seq: cell(row, seq).as_i64()?,
                op: cell(row, op).as_str().unwrap_or("?").to_string(),
                group: cell(row, group).as_str().unwrap_or("?").to_string(),
                members: cell(row, members)
                    .as_str()
                    .map(|s| s.split(',').filter_map(|r| r.trim().parse().ok()).collect())
                    .unwrap_or_default(),
                in_flight: cell(row, state).as_str() == Some("in flight"),
                started: cell(row, ts).as_f64().unwrap_or(0.0),
            })
        })
        .collect()
}

/// A rank's recorded collectives with its Flight Recorder's: a collective
/// both saw (same group and number) is kept as recorded, which knows the
/// caller; Flight Recorder adds the ones issued from C++ (DDP's buckets).
pub fn merge(mut recorded: Vec<Record>, flight: Vec<Record>) -> Vec<Record> {
    let seen: BTreeSet<(String, i64)> = recorded.iter().map(|r| (r.group.clone(), r.seq)).collect();
    let members: BTreeMap<String, Vec<i64>> = recorded
        .iter()
        .filter(|r| !r.members.is_empty())
        .map(|r| (r.group.clone(), r.members.clone()))
        .collect();
    for mut record in flight
        .into_iter()
        .filter(|r| !seen.contains(&(r.group.clone(), r.seq)))
    {
        if record.members.is_empty() {
            record.members = members.get(&record.group).cloned().unwrap_or_default();
        }
        recorded.push(record);
    }
    recorded
}

/// Where a rank's main thread is, in the user's own code: `fetch_batch, hang.py:7`.
pub fn whereabouts(stacks: &StacksReply) -> Option<String> {
    let main = stacks
        .threads
        .iter()
        .find(|t| t.is_main)
        .or_else(|| stacks.threads.first())?;
    let frame = main
        .frames
        .iter()
        .find(|f| {
            !f.file.starts_with('<')
                && !f.is_native()
                && rankscope_core::crash::is_user_file(&f.file)
        })
        .or_else(|| main.frames.first())?;
    let file = frame.file.rsplit('/').next().unwrap_or(&frame.file);
    Some(format!("{}, {file}:{}", frame.func, frame.lineno))
}

const COLLECTIVE_NAMES: &[&str] = &[
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
];

/// The `torch.distributed` call a stack is inside, if any.
pub fn collective_in_stack(frames: &[Frame]) -> Option<String> {
    let inside: Vec<&Frame> = frames
        .iter()
        .filter(|f| f.file.contains("/torch/distributed/"))
        .collect();
    inside
        .iter()
        .rev()
        .find(|f| COLLECTIVE_NAMES.contains(&f.func.as_str()))
        .or_else(|| inside.last())
        .map(|f| f.func.clone())
}

fn clock(seconds: f64) -> String {
    let day = seconds.rem_euclid(86_400.0) as u64;
    format!("{:02}:{:02}:{:02} UTC", day / 3600, day / 60 % 60, day % 60)
}

fn list(ranks: &[i64]) -> String {
    ranks
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// One rank as `cluster bt` saw it.
pub struct RankView<'a> {
    pub rank: i64,
    /// None: the rank's collectives could not be read (or it keeps none).
    pub records: Option<Vec<Record>>,
    pub stacks: Option<&'a StacksReply>,
}

fn where_is(view: Option<&RankView>) -> String {
    match view.and_then(|v| v.stacks).and_then(whereabouts) {
        Some(place) => format!(" (it is in {place})"),
        None => String::new(),
    }
}

/// One line per stuck group, in the words the user came for.
pub fn stuck_lines(views: &[RankView], now: f64) -> Vec<String> {
    let by_rank: BTreeMap<i64, &RankView> = views.iter().map(|v| (v.rank, v)).collect();
    let recorded: Vec<&RankView> = views
        .iter()
        .filter(|v| v.records.as_ref().is_some_and(|r| !r.is_empty()))
        .collect();
    if recorded.is_empty() {
        return from_stacks(views);
    }
    let groups: BTreeSet<&str> = recorded
        .iter()
        .flat_map(|v| v.records.iter().flatten().map(|r| r.group.as_str()))
        .collect();
    let mut lines = Vec::new();
    for group in groups {
        let rows = |v: &RankView| -> Vec<Record> {
            v.records
                .iter()
                .flatten()
                .filter(|r| r.group == group)
                .cloned()
                .collect()
        };
        let highest = recorded
            .iter()
            .flat_map(|v| rows(v))
            .map(|r| r.seq)
            .max()
            .unwrap_or(0);
        let inside: Vec<(i64, Record)> = recorded
            .iter()
            .flat_map(|v| {
                rows(v)
                    .into_iter()
                    .filter(|r| r.in_flight && r.seq == highest)
                    .map(move |r| (v.rank, r))
            })
            .collect();
        let Some(since) = inside.iter().map(|(_, r)| r.started).reduce(f64::min) else {
            continue;
        };
        if now - since < STUCK_AFTER_S {
            continue;
        }
        let op = inside[0].1.op.clone();
        let mut members: BTreeSet<i64> = inside
            .iter()
            .flat_map(|(_, r)| r.members.iter().copied())
            .collect();
        if members.is_empty() {
            members = recorded
                .iter()
                .filter(|v| !rows(v).is_empty())
                .map(|v| v.rank)
                .collect();
        }
        let waiting: Vec<i64> = inside
            .iter()
            .filter(|(_, r)| r.op == op)
            .map(|(rank, _)| *rank)
            .collect();
        let mut line = format!(
            "{op} #{highest} on group {group}: rank{} {} waiting since {} ({:.0} s)",
            if waiting.len() == 1 { "" } else { "s" },
            list(&waiting),
            clock(since),
            now - since
        );
        for (rank, record) in inside.iter().filter(|(_, r)| r.op != op) {
            line += &format!("; rank {rank} is in {} #{highest} instead", record.op);
        }
        for rank in members
            .iter()
            .filter(|m| !inside.iter().any(|(r, _)| r == *m))
        {
            let view = by_rank.get(rank).copied();
            let last = view
                .and_then(|v| v.records.as_ref())
                .map(|rs| rs.iter().filter(|r| r.group == group).map(|r| r.seq).max());
            line += &match last {
                Some(Some(seq)) => format!(
                    "; rank {rank} never joined (its last was #{seq}){}",
                    where_is(view)
                ),
                Some(None) => format!(
                    "; rank {rank} never joined (no collective on this group yet){}",
                    where_is(view)
                ),
                // Only a stack that was read can say where the rank is.
                None if view.is_some_and(|v| v.stacks.is_some()) => format!(
                    "; rank {rank} never joined, as far as its stack says{}",
                    where_is(view)
                ),
                None => format!("; rank {rank} did not answer"),
            };
        }
        lines.push(line);
    }
    lines
}

/// Without records: the ranks inside a torch.distributed call, and the others.
fn from_stacks(views: &[RankView]) -> Vec<String> {
    let mut inside: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut outside = Vec::new();
    for view in views {
        let Some(stacks) = view.stacks else { continue };
        let main = stacks
            .threads
            .iter()
            .find(|t| t.is_main)
            .or_else(|| stacks.threads.first());
        match main.and_then(|t| collective_in_stack(&t.frames)) {
            Some(op) => inside.entry(op).or_default().push(view.rank),
            None => outside.push(view.rank),
        }
    }
    if inside.is_empty() {
        return Vec::new();
    }
    let mut line = inside
        .iter()
        .map(|(op, ranks)| {
            format!(
                "{op}: rank{} {} inside it",
                if ranks.len() == 1 { "" } else { "s" },
                list(ranks)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    for rank in &outside {
        line += &format!(
            "; rank {rank} never joined{}",
            where_is(views.iter().find(|v| v.rank == *rank))
        );
    }
    line += " (from the stacks: no rank records its collectives; `cluster torch collectives on` adds sequence numbers)";
    vec![line]
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_core::protocol::ThreadStack;

    fn stacks(frames: &[(&str, &str, i64)]) -> StacksReply {
        StacksReply {
            taken_at: 0.0,
            counts: None,
            threads: vec![ThreadStack {
                thread_id: 1,
                native_id: None,
                name: "MainThread".into(),
                daemon: false,
                is_main: true,
                holds_gil: None,
                frames: frames
                    .iter()
                    .map(|(func, file, lineno)| Frame {
                        func: func.to_string(),
                        file: file.to_string(),
                        lineno: *lineno,
                        ..Frame::default()
                    })
                    .collect(),
            }],
        }
    }

    fn record(seq: i64, in_flight: bool, started: f64) -> Record {
        Record {
            seq,
            op: "all_reduce".into(),
            group: "0".into(),
            members: vec![0, 1, 2, 3],
            in_flight,
            started,
        }
    }

    #[test]
    fn the_rank_that_skipped_a_collective_is_named_with_where_it_is() {
        let waiting = stacks(&[
            (
                "all_reduce",
                "/v/site-packages/torch/distributed/distributed_c10d.py",
                2800,
            ),
            ("main", "/job/hang.py", 20),
        ]);
        let elsewhere = stacks(&[
            ("sleep", "<built-in>", 0),
            ("fetch_batch", "/job/hang.py", 7),
            ("main", "/job/hang.py", 18),
        ]);
        let mut views: Vec<RankView> = [0, 1, 3]
            .iter()
            .map(|&rank| RankView {
                rank,
                records: Some(vec![record(4, false, 90.0), record(5, true, 100.0)]),
                stacks: Some(&waiting),
            })
            .collect();
        views.push(RankView {
            rank: 2,
            records: Some(vec![record(4, false, 90.0)]),
            stacks: Some(&elsewhere),
        });
        let lines = stuck_lines(&views, 112.0);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with(
                "all_reduce #5 on group 0: ranks 0,1,3 waiting since 00:01:40 UTC (12 s)"
            ),
            "{}",
            lines[0]
        );
        assert!(
            lines[0].contains(
                "rank 2 never joined (its last was #4) (it is in fetch_batch, hang.py:7)"
            ),
            "{}",
            lines[0]
        );
        assert!(
            stuck_lines(&views, 100.5).is_empty(),
            "half a second inside a collective is not stuck"
        );
    }

    #[test]
    fn flight_recorder_adds_what_the_wrappers_missed() {
        let mut from_cpp = record(6, true, 120.0);
        from_cpp.members.clear();
        let merged = merge(
            vec![record(4, false, 90.0), record(5, false, 100.0)],
            vec![record(5, true, 100.0), from_cpp],
        );
        assert_eq!(merged.len(), 3);
        assert!(
            !merged[1].in_flight,
            "a collective both saw is kept as recorded"
        );
        assert_eq!((merged[2].seq, merged[2].in_flight), (6, true));
        assert_eq!(
            merged[2].members,
            vec![0, 1, 2, 3],
            "members come from the recorded rows of the group"
        );
        assert_eq!(merge(vec![], vec![record(7, true, 1.0)]).len(), 1);
    }

    #[test]
    fn without_records_the_stacks_tell_it() {
        let waiting = stacks(&[
            (
                "wrapper",
                "/v/site-packages/torch/distributed/c10d_logger.py",
                81,
            ),
            (
                "all_reduce",
                "/v/site-packages/torch/distributed/distributed_c10d.py",
                2800,
            ),
            (
                "wrapper",
                "/v/site-packages/torch/distributed/c10d_logger.py",
                81,
            ),
            ("main", "/job/hang.py", 20),
        ]);
        let elsewhere = stacks(&[("fetch_batch", "/job/hang.py", 7)]);
        let views = vec![
            RankView {
                rank: 0,
                records: None,
                stacks: Some(&waiting),
            },
            RankView {
                rank: 1,
                records: None,
                stacks: Some(&elsewhere),
            },
        ];
        let lines = stuck_lines(&views, 0.0);
        assert_eq!(lines.len(), 1);
        assert!(lines[0].starts_with("all_reduce: rank 0 inside it; rank 1 never joined (it is in fetch_batch, hang.py:7)"), "{}", lines[0]);
        let calm = vec![RankView {
            rank: 1,
            records: None,
            stacks: Some(&elsewhere),
        }];
        assert!(stuck_lines(&calm, 0.0).is_empty());
    }

    #[test]
    fn a_rank_with_neither_records_nor_a_stack_is_not_said_to_have_never_joined() {
        let waiting = stacks(&[("main", "/job/hang.py", 20)]);
        let views = vec![
            RankView {
                rank: 0,
                records: Some(vec![Record {
                    members: vec![0, 1],
                    ..record(5, true, 100.0)
                }]),
                stacks: Some(&waiting),
            },
            RankView {
                rank: 1,
                records: None,
                stacks: None,
            },
        ];
        let lines = stuck_lines(&views, 112.0);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].ends_with("; rank 1 did not answer"),
            "{}",
            lines[0]
        );
    }
}
