//! The terminal the CLI prints to, for tables that fit it.

use rankscope_query::table::Table;

/// The width tables are fitted to: on a TTY, `COLUMNS` when it holds a
/// number (as Python's `shutil.get_terminal_size` reads it), else the
/// terminal's own (`TIOCGWINSZ`). Not a TTY (a pipe, a file): None, and
/// nothing is cut.
pub fn width() -> Option<usize> {
    // SAFETY: isatty only inspects the descriptor.
    if unsafe { libc::isatty(libc::STDOUT_FILENO) } != 1 {
        return None;
    }
    if let Some(columns) = std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|&c| c > 0)
    {
        return Some(columns);
    }
    // SAFETY: TIOCGWINSZ writes one winsize into the struct we own.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) } == 0;
    (ok && size.ws_col > 0).then_some(size.ws_col as usize)
}

/// Prints `table` fitted to the terminal.
pub fn print(table: &Table) {
    print!("{}", table.render(width()));
}
