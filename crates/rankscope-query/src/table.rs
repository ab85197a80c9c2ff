//! Tables for people: aligned columns that fit the terminal they are shown on.
//!
//! Every table the CLI prints goes through [`Table`], so they all behave the
//! same: given a width (the terminal's, on a TTY), the widest columns give up
//! room first and their long cells end in `…`; given none (a pipe, a file),
//! nothing is cut. Full values are always one `--format json` away.

/// Where a column's cells sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// How the table is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Columns two spaces apart, headers as given, no borders (`rankscope crashes`, `list`).
    Plain,
    /// `+---+` borders around each cell, as SQL shells draw results (`query`).
    Boxed,
}

/// What marks a cut cell.
pub const ELLIPSIS: char = '…';

/// A column never shrinks below this many characters (or its header's
/// length, when that is longer) while any wider column can still give room.
const MIN_COLUMN: usize = 3;

#[derive(Debug, Clone)]
pub struct Table {
    style: Style,
    headers: Vec<String>,
    aligns: Vec<Align>,
    /// Columns never cut while others can give room (ids, times, PIDs).
    whole: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(style: Style) -> Table {
        Table {
            style,
            headers: Vec::new(),
            aligns: Vec::new(),
            whole: Vec::new(),
            rows: Vec::new(),
        }
    }

    pub fn column(mut self, header: impl Into<String>, align: Align) -> Table {
        self.headers.push(header.into());
        self.aligns.push(align);
        self.whole.push(false);
        self
    }

    /// A column that keeps its cells whole (ids, times, PIDs): the others
    /// give up their room first.
    pub fn whole_column(mut self, header: impl Into<String>, align: Align) -> Table {
        self = self.column(header, align);
        *self.whole.last_mut().expect("just pushed") = true;
        self
    }

    /// One row; missing cells are empty, extra ones are dropped.
    pub fn row(&mut self, cells: Vec<String>) {
        let mut cells = cells;
        cells.resize(self.headers.len(), String::new());
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text, every line at most `width` characters when a width
    /// is given and the columns' smallest widths allow it.
    pub fn render(&self, width: Option<usize>) -> String {
        let columns = self.headers.len();
        if columns == 0 {
            return String::new();
        }
        // A multi-line cell (a Boxed query cell) takes as many lines as it has.
        let split = |cell: &str| -> Vec<String> {
            cell.split('\n').map(|l| l.replace('\t', " ")).collect()
        };
        let header_lines: Vec<Vec<String>> = self.headers.iter().map(|h| split(h)).collect();
        let row_lines: Vec<Vec<Vec<String>>> = self
            .rows
            .iter()
            .map(|r| r.iter().map(|c| split(c)).collect())
            .collect();
        let mut natural = vec![0usize; columns];
        for cells in std::iter::once(&header_lines).chain(&row_lines) {
            for (i, lines) in cells.iter().enumerate() {
                for line in lines {
                    natural[i] = natural[i].max(chars(line));
                }
            }
        }
        let overhead = match self.style {
            Style::Plain => 2 * (columns - 1),
            Style::Boxed => 3 * columns + 1,
        };
        let widths = match width {
            Some(total) => fit(
                &natural,
                &self.header_floors(&natural),
                total.saturating_sub(overhead),
            ),
            None => natural.clone(),
        };
        let mut out = String::new();
        let border = || {
            let mut line = String::from("+");
            for w in &widths {
                line.push_str(&"-".repeat(w + 2));
                line.push('+');
            }
            line.push('\n');
            line
        };
        if self.style == Style::Boxed {
            out.push_str(&border());
        }
        self.push_row(&mut out, &header_lines, &widths, true);
        if self.style == Style::Boxed {
            out.push_str(&border());
        }
        for cells in &row_lines {
            self.push_row(&mut out, cells, &widths, false);
        }
        if self.style == Style::Boxed && !row_lines.is_empty() {
            out.push_str(&border());
        }
        out
    }

    /// Below these widths a column gives no more room: its header stays
    /// whole (up to a point), so the table still reads.
    fn header_floors(&self, natural: &[usize]) -> Vec<usize> {
        self.headers
            .iter()
            .zip(natural)
            .zip(&self.whole)
            .map(|((h, &n), &whole)| {
                if whole {
                    n
                } else {
                    n.min(
                        h.lines()
                            .map(chars)
                            .max()
                            .unwrap_or(0)
                            .clamp(MIN_COLUMN, 12),
                    )
                }
            })
            .collect()
    }

    fn push_row(&self, out: &mut String, cells: &[Vec<String>], widths: &[usize], header: bool) {
        let height = cells.iter().map(Vec::len).max().unwrap_or(1);
        for line_no in 0..height {
            let mut line = String::new();
            if self.style == Style::Boxed {
                line.push('|');
            }
            for (i, lines) in cells.iter().enumerate() {
                let text = cut(
                    lines.get(line_no).map(String::as_str).unwrap_or(""),
                    widths[i],
                );
                let pad = " ".repeat(widths[i] - chars(&text));
                // Headers and boxed cells sit left, as SQL shells print them.
                let right = !header && self.style == Style::Plain && self.aligns[i] == Align::Right;
                match self.style {
                    Style::Plain => {
                        if i > 0 {
                            line.push_str("  ");
                        }
                        if right {
                            line.push_str(&pad);
                            line.push_str(&text);
                        } else {
                            line.push_str(&text);
                            line.push_str(&pad);
                        }
                    }
                    Style::Boxed => {
                        line.push(' ');
                        line.push_str(&text);
                        line.push_str(&pad);
                        line.push_str(" |");
                    }
                }
            }
            out.push_str(line.trim_end_matches(' '));
            out.push('\n');
        }
    }
}

fn chars(text: &str) -> usize {
    text.chars().count()
}

/// `text` in at most `width` characters: cut ones end in `…`.
pub fn cut(text: &str, width: usize) -> String {
    if chars(text) <= width {
        return text.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut kept: String = text.chars().take(width - 1).collect();
    kept.push(ELLIPSIS);
    kept
}

/// Column widths whose sum is at most `budget`: the widest columns are
/// capped first, none below its floor. When the floors alone do not fit,
/// columns shrink below them (down to one character).
fn fit(natural: &[usize], floors: &[usize], budget: usize) -> Vec<usize> {
    if natural.iter().sum::<usize>() <= budget {
        return natural.to_vec();
    }
    let floors: Vec<usize> = if floors.iter().sum::<usize>() <= budget {
        floors.to_vec()
    } else {
        natural.iter().map(|&n| n.min(1)).collect()
    };
    let at_cap = |cap: usize| -> Vec<usize> {
        natural
            .iter()
            .zip(&floors)
            .map(|(&n, &f)| n.min(cap).max(f))
            .collect()
    };
    // The largest cap that fits; the room left under it goes, a character
    // each, to the columns it cut, leftmost first.
    let (mut lo, mut hi) = (0, natural.iter().copied().max().unwrap_or(0));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if at_cap(mid).iter().sum::<usize>() <= budget {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut widths = at_cap(lo);
    let mut left = budget.saturating_sub(widths.iter().sum());
    for (w, &n) in widths.iter_mut().zip(natural) {
        if left == 0 {
            break;
        }
        if *w < n {
            *w += 1;
            left -= 1;
        }
    }
    widths
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Table {
        let mut table = Table::new(Style::Plain)
            .whole_column("ID", Align::Right)
            .column("EXCEPTION", Align::Left)
            .column("LOCATION", Align::Left);
        table.row(vec![
            "1".into(),
            "KeyError: 'a very long key that goes on and on'".into(),
            "/home/user/project/train.py:88".into(),
        ]);
        table.row(vec!["12".into(), "ValueError".into(), "t.py:3".into()]);
        table
    }

    #[test]
    fn without_a_width_nothing_is_cut() {
        let text = sample().render(None);
        assert!(
            text.contains(
                "KeyError: 'a very long key that goes on and on'  /home/user/project/train.py:88\n"
            ),
            "{text}"
        );
        assert!(!text.contains(ELLIPSIS));
        assert!(text.starts_with("ID  EXCEPTION"), "{text}");
        assert!(text.contains("\n12  ValueError"), "{text}");
    }

    #[test]
    fn every_line_fits_the_width_and_cut_cells_end_in_an_ellipsis() {
        for width in [40, 50, 60, 70] {
            let text = sample().render(Some(width));
            for line in text.lines() {
                assert!(line.chars().count() <= width, "{width}: {line:?}");
            }
            assert!(text.contains(ELLIPSIS), "{text}");
            assert!(text.contains(" 1  KeyError"), "{text}");
        }
        // Wide enough: the same as uncut.
        assert_eq!(sample().render(Some(200)), sample().render(None));
    }

    #[test]
    fn boxed_tables_fit_too_and_keep_their_borders() {
        let mut table = Table::new(Style::Boxed)
            .column("func", Align::Left)
            .column("message", Align::Left);
        table.row(vec!["load".into(), "x".repeat(100)]);
        table.row(vec!["two\nlines".into(), "y".into()]);
        let text = table.render(Some(40));
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.iter().all(|l| l.chars().count() <= 40), "{text}");
        assert!(
            lines
                .iter()
                .all(|l| l.chars().count() == lines[0].chars().count()),
            "{text}"
        );
        assert_eq!(lines[0], format!("+-------+{}+", "-".repeat(30)));
        assert!(
            text.contains(&format!("| load  | {}… |", "x".repeat(27))),
            "{text}"
        );
        assert!(text.contains("| two   | y"), "{text}");
        assert!(text.contains("| lines |"), "{text}");
    }

    #[test]
    fn cutting_keeps_the_head_of_the_text() {
        assert_eq!(cut("abcdef", 4), "abc…");
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("abc", 0), "");
        assert_eq!(fit(&[10, 50, 30], &[3, 3, 3], 60), vec![10, 25, 25]);
    }
}
