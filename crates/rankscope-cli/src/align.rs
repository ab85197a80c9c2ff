//! Steps numbered alike on every rank (`cluster torch ... on`).
//!
//! Each rank's step clock counts from where it started unless its
//! optimizer keeps a count, so ranks whose clocks started a step apart
//! sample different steps. While asked, each rank records at every step
//! boundary its step number and its default process group's collective
//! count, which every rank shares at the end of the same step (the
//! probe's `align.py`). Here a count that every rank recorded is found,
//! and each rank is given how far to move its number so that all agree
//! there.

use std::collections::{BTreeMap, BTreeSet};

/// Where the ranks met, and how far each moves its step number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meeting {
    /// The collective count at the boundary the ranks were matched on.
    pub count: i64,
    /// The step that boundary began, as every rank numbers it now.
    pub step: i64,
    /// Rank -> what to add to its step number (never below 0, so that no
    /// rank numbers a step again).
    pub shifts: BTreeMap<i64, i64>,
}

/// The latest boundary every rank recorded, and the moves that make their
/// numbers agree there; None until there is one.
///
/// `anchors` is each rank's (step, collective count) in the order its
/// boundaries came. A count names one boundary only where the counts
/// around it differ from it: a step that issued no collective leaves the
/// count as it was, and two boundaries with one count could be any two
/// steps. So the boundary chosen is one whose count some rank saw rise
/// into it and out of it.
pub fn meet(anchors: &[(i64, Vec<(i64, i64)>)]) -> Option<Meeting> {
    if anchors.len() < 2 || anchors.iter().any(|(_, list)| list.is_empty()) {
        return None;
    }
    let mut common: Option<BTreeSet<i64>> = None;
    let mut named = BTreeSet::new();
    for (_, list) in anchors {
        let mut seen = BTreeMap::<i64, usize>::new();
        for (_, count) in list {
            *seen.entry(*count).or_default() += 1;
        }
        let once: BTreeSet<i64> = seen
            .iter()
            .filter(|(_, &n)| n == 1)
            .map(|(&c, _)| c)
            .collect();
        common = Some(match common {
            None => once,
            Some(c) => c.intersection(&once).copied().collect(),
        });
        for window in list.windows(3) {
            let (before, at, after) = (window[0].1, window[1].1, window[2].1);
            if before < at && at < after {
                named.insert(at);
            }
        }
    }
    let count = common?.intersection(&named).copied().max()?;
    let at: Vec<(i64, i64)> = anchors
        .iter()
        .map(|(rank, list)| {
            let step = list.iter().find(|(_, c)| *c == count).map(|(s, _)| *s);
            (*rank, step.expect("in every list"))
        })
        .collect();
    let step = at.iter().map(|(_, s)| *s).max()?;
    Some(Meeting {
        count,
        step,
        shifts: at.into_iter().map(|(rank, s)| (rank, step - s)).collect(),
    })
}

/// Whether waiting longer can still find a meeting: false once every rank
/// has recorded this many boundaries and no count has risen at any of
/// them (the steps issue no collective on the default group).
pub fn hopeless(anchors: &[(i64, Vec<(i64, i64)>)], enough: usize) -> bool {
    anchors.iter().all(|(_, list)| list.len() >= enough)
        && anchors
            .iter()
            .all(|(_, list)| list.windows(2).all(|w| w[0].1 == w[1].1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_a_step_apart_are_moved_to_the_later_number() {
        // Rank 1's clock started a step later: it calls the step rank 0
        // calls 6 its 5 (2 collectives a step).
        let anchors = vec![
            (0, vec![(4, 100), (5, 102), (6, 104), (7, 106)]),
            (1, vec![(4, 104), (5, 106)]),
        ];
        let met = meet(&anchors).expect("a shared count");
        assert_eq!(met.count, 104);
        assert_eq!(met.step, 6);
        assert_eq!(met.shifts, BTreeMap::from([(0, 0), (1, 2)]));
    }

    #[test]
    fn a_count_that_did_not_rise_names_no_boundary() {
        // 104 is seen twice by rank 0 (a step without a collective): it is
        // not used, and nothing else is shared and named.
        let anchors = vec![(0, vec![(1, 102), (2, 104), (3, 104)]), (1, vec![(7, 104)])];
        assert_eq!(meet(&anchors), None);
        // Rank 1's single anchor is named by rank 0's rise around it.
        let anchors = vec![(0, vec![(1, 102), (2, 104), (3, 106)]), (1, vec![(7, 104)])];
        assert_eq!(
            meet(&anchors).map(|m| m.shifts),
            Some(BTreeMap::from([(0, 5), (1, 0)]))
        );
    }

    #[test]
    fn nothing_is_met_until_every_rank_has_a_boundary() {
        assert_eq!(
            meet(&[(0, vec![(1, 2), (2, 3), (3, 4)]), (1, vec![])]),
            None
        );
        assert_eq!(meet(&[(0, vec![(1, 2), (2, 3), (3, 4)])]), None);
    }

    #[test]
    fn steps_without_collectives_are_given_up_on() {
        let flat = vec![
            (0, vec![(1, 9), (2, 9), (3, 9)]),
            (1, vec![(1, 9), (2, 9), (3, 9)]),
        ];
        assert!(hopeless(&flat, 3));
        assert!(!hopeless(&flat, 4));
        let rising = vec![
            (0, vec![(1, 9), (2, 10), (3, 11)]),
            (1, vec![(1, 9), (2, 9), (3, 9)]),
        ];
        assert!(!hopeless(&rising, 3));
    }
}
