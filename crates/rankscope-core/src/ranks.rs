//! Sets of ranks as people write them.

/// `[0, 1, 3, 5, 6, 7]` -> `"0-1,3,5-7"`, in any order and with repeats.
pub fn compress(ranks: impl IntoIterator<Item = i64>) -> String {
    let mut sorted: Vec<i64> = ranks.into_iter().collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::compress;

    #[test]
    fn rank_lists_are_compressed_into_ranges() {
        assert_eq!(compress([0, 1, 3, 5, 6, 7]), "0-1,3,5-7");
        assert_eq!(compress([7, 2, 2]), "2,7");
        assert_eq!(compress([]), "");
    }
}
