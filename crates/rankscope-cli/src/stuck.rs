//! Which collective a hung job is stuck in, and which ranks never joined it:
//! the line `cluster bt` adds under the stacks.
//!
//! From `python.collectives` where the ranks record them: for each group,
//! the highest collective any rank has entered, the ranks still inside it
//! and since when, and the members that never entered it (with where their
//! main thread is instead). Where no rank records collectives, the same
//! sentence is made from the stacks alone: the ranks whose main thread is
//! inside a `torch.distributed` call, and the ones that are not.
//!
//! Point-to-point calls are paired by number: a rank's k-th receive from a
//! peer waits for that peer's k-th send to it (collective.rs numbers them
//! so). A receive, or a send, left waiting whose other half the peer never
//! made gets a line that names the peer and where it is instead.

use std::collections::{BTreeMap, BTreeSet};

use rankscope_core::protocol::{Frame, ProbeTableReply, StacksReply};
use serde_json::Value;

/// How long a collective must have waited before it reads as stuck: a
/// healthy job is inside collectives all the time, briefly.
pub const STUCK_AFTER_S: f64 = 1.0;

/// What `cluster bt` asks each rank for.
pub const COLUMNS: [&str; 9] = [
    "seq",
    "op",
    "process_group",
    "group_ranks",
    "state",
    "caller",
    "ts",
    "peer",
    "tag",
];

#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub seq: i64,
    pub op: String,
    pub group: String,
    pub members: Vec<i64>,
    pub in_flight: bool,
    /// An async call whose end the backend does not tell (gloo's `isend`).
    pub issued: bool,
    pub started: f64,
    /// A point-to-point call's peer (None: a receive from any rank).
    pub peer: Option<i64>,
    pub tag: i64,
}

impl Record {
    fn is_p2p(&self) -> bool {
        matches!(self.op.as_str(), "send" | "recv" | "isend" | "irecv")
    }

    fn sends(&self) -> bool {
        self.op.ends_with("send")
    }

    /// A send's or receive's tag as its lines say it ("" for the default 0).
    fn tag_text(&self) -> String {
        match self.tag {
            0 => String::new(),
            tag => format!(" (tag {tag})"),
        }
    }

    /// The call in words: "all_reduce #4 on group 0", "send #2 (tag 7) to
    /// rank 1 on group 0", "irecv #1 from any rank on group 0".
    fn call(&self) -> String {
        if !self.is_p2p() {
            return format!("{} #{} on group {}", self.op, self.seq, self.group);
        }
        let peer = self
            .peer
            .map_or_else(|| "any rank".to_string(), |p| format!("rank {p}"));
        let way = if self.sends() { "to" } else { "from" };
        format!(
            "{} #{}{} {way} {peer} on group {}",
            self.op,
            self.seq,
            self.tag_text(),
            self.group
        )
    }
}

/// A rank's `python.collectives` rows as `Record`s.
pub fn records(reply: &ProbeTableReply) -> Vec<Record> {
    let at = |name: &str| reply.columns.iter().position(|c| c == name);
    let (seq, op, group, members, state, ts, peer, tag) = (
        at("seq"),
        at("op"),
        at("process_group"),
        at("group_ranks"),
        at("state"),
        at("ts"),
        at("peer"),
        at("tag"),
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
                issued: cell(row, state).as_str() == Some("issued"),
                started: cell(row, ts).as_f64().unwrap_or(0.0),
                peer: cell(row, peer).as_i64(),
                tag: cell(row, tag).as_i64().unwrap_or(0),
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
    "gather_object",
    "scatter_object_list",
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

/// Calls that make a process group: a rank waits in them for the others,
/// with no collective of the group to number yet.
const GROUP_MAKERS: &[&str] = &["init_process_group", "new_group", "new_subgroups"];

/// The `torch.distributed` call a stack is inside, if any. The launcher's
/// code (torchrun's agent, elastic's decorators) is not such a call, nor is
/// c10d's logging decorator a name to give it.
pub fn collective_in_stack(frames: &[Frame]) -> Option<String> {
    let inside: Vec<&Frame> = frames
        .iter()
        .filter(|f| {
            f.file.contains("/torch/distributed/")
                && !f.file.contains("/torch/distributed/elastic/")
                && !f.file.contains("/torch/distributed/launcher/")
                && !f.file.ends_with("/torch/distributed/run.py")
                && !f.file.ends_with("/c10d_logger.py")
        })
        .collect();
    inside
        .iter()
        .rev()
        .find(|f| {
            COLLECTIVE_NAMES.contains(&f.func.as_str()) || GROUP_MAKERS.contains(&f.func.as_str())
        })
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
    // A rank held up elsewhere may be waiting in a collective of another
    // group (or a send): which one says more than its line does.
    let waiting = view
        .and_then(|v| v.records.as_ref())
        .and_then(|rs| {
            rs.iter()
                .filter(|r| r.in_flight)
                .max_by(|a, b| a.started.total_cmp(&b.started))
        })
        // (With a send's tag, where a mismatch of tags may be why nothing pairs.)
        .map(Record::call);
    let place = view.and_then(|v| v.stacks).and_then(whereabouts);
    match (waiting, place) {
        (Some(call), Some(place)) => format!(" (it is in {call}, at {place})"),
        (Some(call), None) => format!(" (it is in {call})"),
        (None, Some(place)) => format!(" (it is in {place})"),
        (None, None) => String::new(),
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
    // Collectives, group by group; point-to-point calls are numbered apart.
    let groups: BTreeSet<&str> = recorded
        .iter()
        .flat_map(|v| {
            v.records
                .iter()
                .flatten()
                .filter(|r| !r.is_p2p())
                .map(|r| r.group.as_str())
        })
        .collect();
    let mut lines = Vec::new();
    for group in groups {
        let rows = |v: &RankView| -> Vec<Record> {
            v.records
                .iter()
                .flatten()
                .filter(|r| r.group == group && !r.is_p2p())
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
            let last = view.and_then(|v| v.records.as_ref()).map(|rs| {
                rs.iter()
                    .filter(|r| r.group == group && !r.is_p2p())
                    .map(|r| r.seq)
                    .max()
            });
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
    lines.extend(p2p_lines(views, &by_rank, now));
    lines
}

/// A point-to-point call left waiting (or issued without an end to wait
/// on) for a second or more, and what its peer did of the other half.
fn p2p_lines(views: &[RankView], by_rank: &BTreeMap<i64, &RankView>, now: f64) -> Vec<String> {
    let mut lines = Vec::new();
    for view in views {
        let mut open: Vec<&Record> = view
            .records
            .iter()
            .flatten()
            .filter(|r| r.is_p2p() && (r.in_flight || r.issued) && now - r.started >= STUCK_AFTER_S)
            .collect();
        open.sort_by(|a, b| a.started.total_cmp(&b.started));
        for record in open {
            let (op, rank, group) = (&record.op, view.rank, &record.group);
            let tag = record.tag_text();
            let since = if record.in_flight {
                format!(
                    "waiting since {} ({:.0} s)",
                    clock(record.started),
                    now - record.started
                )
            } else {
                format!(
                    "issued at {} ({:.0} s ago)",
                    clock(record.started),
                    now - record.started
                )
            };
            let Some(peer) = record.peer else {
                if record.in_flight {
                    lines.push(format!(
                        "{op}{tag} from any rank on group {group}: rank {rank} {since}"
                    ));
                }
                continue;
            };
            let (other, done) = if record.sends() {
                ("recv", "received")
            } else {
                ("send", "sent")
            };
            let back = if record.sends() { "from" } else { "to" };
            let head = format!("{}: rank {rank} {since}", record.call());
            let partner = by_rank.get(&peer).copied();
            let halves: Option<Vec<&Record>> = partner.and_then(|p| p.records.as_ref()).map(|rs| {
                rs.iter()
                    .filter(|r| {
                        r.is_p2p()
                            && r.group == *group
                            && r.sends() != record.sends()
                            && r.peer == Some(rank)
                            && r.tag == record.tag
                    })
                    .collect()
            });
            let tail = match halves {
                Some(halves) => match halves.iter().find(|r| r.seq == record.seq) {
                    // Made by the peer: an issued call has nothing more to say.
                    Some(_) if !record.in_flight => continue,
                    Some(half) if half.in_flight => {
                        format!("; rank {peer} is in {} #{} {back} rank {rank} too", half.op, half.seq)
                    }
                    Some(half) => format!("; rank {peer} {done} it ({} #{})", half.op, half.seq),
                    None => match halves.iter().map(|r| r.seq).max() {
                        Some(last) => format!(
                            "; rank {peer} never {done} it (its last {other} {back} rank {rank} was #{last}){}",
                            where_is(partner)
                        ),
                        None => format!(
                            "; rank {peer} never {done} it (no {other} {back} rank {rank} yet){}",
                            where_is(partner)
                        ),
                    },
                },
                None if partner.is_some_and(|p| p.stacks.is_some()) => format!(
                    "; rank {peer} keeps no record of its calls{}",
                    where_is(partner)
                ),
                None => format!("; rank {peer} did not answer"),
            };
            lines.push(head + &tail);
        }
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
    if inside.keys().all(|op| GROUP_MAKERS.contains(&op.as_str())) {
        // Nothing to number yet: the ranks meet to make the group.
        line += " (from the stacks: the process group is being made)";
    } else {
        line += " (from the stacks: no rank records its collectives; `cluster torch collectives on` adds sequence numbers)";
    }
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

    /// Ranks 0, 1, ... with these stacks and no records.
    fn from_stacks_alone<'a>(stacks: &[&'a StacksReply]) -> Vec<RankView<'a>> {
        stacks
            .iter()
            .enumerate()
            .map(|(rank, stacks)| RankView {
                rank: rank as i64,
                records: None,
                stacks: Some(stacks),
            })
            .collect()
    }

    fn record(seq: i64, in_flight: bool, started: f64) -> Record {
        Record {
            seq,
            op: "all_reduce".into(),
            group: "0".into(),
            members: vec![0, 1, 2, 3],
            in_flight,
            issued: false,
            started,
            peer: None,
            tag: 0,
        }
    }

    fn p2p(op: &str, seq: i64, peer: Option<i64>, state: &str, started: f64) -> Record {
        Record {
            seq,
            op: op.into(),
            group: "0".into(),
            members: vec![0, 1, 2, 3],
            in_flight: state == "in flight",
            issued: state == "issued",
            started,
            peer,
            tag: 0,
        }
    }

    #[test]
    fn a_receive_whose_send_never_came_names_the_peer_and_where_it_is() {
        let elsewhere = stacks(&[("fetch_batch", "/job/pp.py", 7)]);
        let waiting = stacks(&[("main", "/job/pp.py", 20)]);
        // Gloo counted the point-to-point calls in the group's number: the
        // collectives' numbers are the ones every rank agrees on, and the
        // receive and send pair by their own numbers.
        let views = vec![
            RankView {
                rank: 0,
                records: Some(vec![
                    record(1, false, 50.0),
                    p2p("send", 1, Some(1), "done", 60.0),
                    p2p("send", 2, Some(1), "done", 70.0),
                    // Sent, and received: nothing to say of it.
                    p2p("isend", 1, Some(3), "issued", 70.0),
                ]),
                stacks: Some(&elsewhere),
            },
            RankView {
                rank: 1,
                records: Some(vec![
                    record(1, false, 50.0),
                    p2p("recv", 1, Some(0), "done", 60.0),
                    p2p("recv", 2, Some(0), "done", 70.0),
                    p2p("recv", 3, Some(0), "in flight", 100.0),
                    // From any rank: none is named.
                ]),
                stacks: Some(&waiting),
            },
            RankView {
                rank: 2,
                records: Some(vec![
                    record(1, false, 50.0),
                    p2p("irecv", 1, None, "in flight", 101.0),
                ]),
                stacks: Some(&waiting),
            },
            RankView {
                rank: 3,
                records: Some(vec![
                    record(1, false, 50.0),
                    p2p("irecv", 1, Some(0), "issued", 70.0),
                    // A send the peer never received, and one to a rank that did not answer.
                    p2p("send", 1, Some(1), "in flight", 105.0),
                    p2p("send", 1, Some(7), "in flight", 106.0),
                ]),
                stacks: Some(&waiting),
            },
        ];
        let lines = stuck_lines(&views, 112.0);
        assert_eq!(
            lines,
            vec![
                "recv #3 from rank 0 on group 0: rank 1 waiting since 00:01:40 UTC (12 s); rank 0 never sent it (its last send to rank 1 was #2) (it is in fetch_batch, pp.py:7)",
                "irecv from any rank on group 0: rank 2 waiting since 00:01:41 UTC (11 s)",
                "send #1 to rank 1 on group 0: rank 3 waiting since 00:01:45 UTC (7 s); rank 1 never received it (no recv from rank 3 yet) (it is in recv #3 from rank 0 on group 0, at main, pp.py:20)",
                "send #1 to rank 7 on group 0: rank 3 waiting since 00:01:46 UTC (6 s); rank 7 did not answer",
            ],
        );
        // The other half made: said so; half a second is not stuck.
        let both = vec![
            RankView {
                rank: 0,
                records: Some(vec![p2p("send", 1, Some(1), "in flight", 100.0)]),
                stacks: None,
            },
            RankView {
                rank: 1,
                records: Some(vec![p2p("recv", 1, Some(0), "in flight", 111.8)]),
                stacks: None,
            },
        ];
        assert_eq!(
            stuck_lines(&both, 112.0),
            vec!["send #1 to rank 1 on group 0: rank 0 waiting since 00:01:40 UTC (12 s); rank 1 is in recv #1 from rank 0 too"]
        );
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
        let lines = stuck_lines(&from_stacks_alone(&[&waiting, &elsewhere]), 0.0);
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
    fn a_rank_held_in_another_groups_collective_is_said_to_be_in_it() {
        // Rank 1 of group 0 never joins its all_reduce #4: it waits in
        // group 1's broadcast #2, which rank 3 of that group never joined.
        let here = stacks(&[("<module>", "/job/two.py", 9)]);
        let in_group = |group: &str, op: &str, seq, members: Vec<i64>, in_flight, started| Record {
            group: group.into(),
            op: op.into(),
            members,
            ..record(seq, in_flight, started)
        };
        let views: Vec<RankView> = [
            vec![
                in_group("0", "all_reduce", 3, vec![0, 1], false, 10.0),
                in_group("0", "all_reduce", 4, vec![0, 1], true, 100.0),
            ],
            vec![
                in_group("0", "all_reduce", 3, vec![0, 1], false, 10.0),
                in_group("1", "broadcast", 2, vec![1, 3], true, 99.0),
            ],
        ]
        .into_iter()
        .enumerate()
        .map(|(rank, records)| RankView {
            rank: rank as i64,
            records: Some(records),
            stacks: Some(&here),
        })
        .collect();
        let lines = stuck_lines(&views, 112.0);
        assert!(
            lines[0].ends_with("rank 1 never joined (its last was #3) (it is in broadcast #2 on group 1, at <module>, two.py:9)"),
            "{lines:?}"
        );
    }

    #[test]
    fn a_rank_making_its_group_or_a_launcher_is_named_as_it_is() {
        let c10d = "/v/site-packages/torch/distributed/distributed_c10d.py";
        let logger = "/v/site-packages/torch/distributed/c10d_logger.py";
        let making = stacks(&[
            ("_store_based_barrier", c10d, 4000),
            ("init_process_group", c10d, 1600),
            ("wrapper", logger, 83),
            ("<module>", "/job/train.py", 3),
        ]);
        assert_eq!(
            collective_in_stack(&making.threads[0].frames).as_deref(),
            Some("init_process_group")
        );
        let launcher = stacks(&[
            (
                "_poll",
                "/v/site-packages/torch/distributed/elastic/agent/server/api.py",
                900,
            ),
            (
                "run",
                "/v/site-packages/torch/distributed/elastic/agent/server/api.py",
                700,
            ),
            (
                "wrapper",
                "/v/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py",
                355,
            ),
            ("main", "/v/site-packages/torch/distributed/run.py", 900),
        ]);
        assert_eq!(collective_in_stack(&launcher.threads[0].frames), None);
        let later = stacks(&[("<module>", "/job/train.py", 2)]);
        let lines = stuck_lines(&from_stacks_alone(&[&making, &later]), 0.0);
        assert_eq!(
            lines,
            vec!["init_process_group: rank 0 inside it; rank 1 never joined (it is in <module>, train.py:2) (from the stacks: the process group is being made)"]
        );
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
