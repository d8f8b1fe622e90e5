//! Progress of a long benchmark on stderr: runs done / total and elapsed time. On a terminal one
//! line is rewritten in place; otherwise (logs, CI) one plain line per finished run.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Erases the current terminal line and returns to its start.
const ERASE: &str = "\r\x1b[K";

/// Runs done out of a known total.
pub struct Progress {
    total: usize,
    done: usize,
    start: Instant,
    tty: bool,
    label: String,
    shown: bool,
}

impl Progress {
    /// `total` runs; `label` prefixes every line (e.g. the caller's own progress); in place when
    /// stderr is a terminal.
    pub fn new(total: usize, label: Option<&str>) -> Self {
        Self::with_terminal(total, label, std::io::stderr().is_terminal())
    }

    /// As [`Progress::new`] with the terminal decision given.
    pub fn with_terminal(total: usize, label: Option<&str>, tty: bool) -> Self {
        Progress {
            total,
            done: 0,
            start: Instant::now(),
            tty,
            label: label.map_or(String::new(), |l| format!("{l} | ")),
            shown: false,
        }
    }

    /// Runs finished so far.
    pub fn done(&self) -> usize {
        self.done
    }

    /// Whether lines are rewritten in place.
    pub fn in_place(&self) -> bool {
        self.tty
    }

    /// The text shown after `elapsed`, with `what` (the current or last run) appended.
    pub fn render(&self, elapsed: Duration, what: &str) -> String {
        format!(
            "{}kvroute-bench: {}/{} runs done, {:.0} s elapsed{}{what}",
            self.label,
            self.done,
            self.total,
            elapsed.as_secs_f64(),
            if what.is_empty() { "" } else { "; " },
        )
    }

    fn write(&mut self, text: &str) {
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(text.as_bytes());
        let _ = err.flush();
    }

    /// A run starts (`what` names it): shown in place on a terminal, nothing otherwise.
    pub fn start(&mut self, what: &str) {
        if self.tty {
            let line = format!("{ERASE}{}", self.render(self.start.elapsed(), what));
            self.write(&line);
            self.shown = true;
        }
    }

    /// A run ended (`what` names it).
    pub fn finish(&mut self, what: &str) {
        self.done += 1;
        let line = self.render(self.start.elapsed(), what);
        if self.tty {
            self.write(&format!("{ERASE}{line}"));
            self.shown = true;
        } else {
            self.write(&format!("{line}\n"));
        }
    }

    /// Erases the in-place line so other output starts on a clean line (no-op off a terminal).
    pub fn clear(&mut self) {
        if self.tty && self.shown {
            self.write(ERASE);
            self.shown = false;
        }
    }

    /// Ends the in-place line with a newline, leaving the last state visible.
    pub fn end(&mut self) {
        if self.tty && self.shown {
            self.write("\n");
            self.shown = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_counts_and_labels() {
        let mut p = Progress::with_terminal(3, Some("placement 2/18"), false);
        p.finish("multi-turn / oracle, 2 endpoints");
        assert_eq!(
            p.render(Duration::from_secs(12), "x"),
            "placement 2/18 | kvroute-bench: 1/3 runs done, 12 s elapsed; x"
        );
        let q = Progress::with_terminal(5, None, true);
        assert!(q.in_place());
        assert_eq!(
            q.render(Duration::ZERO, ""),
            "kvroute-bench: 0/5 runs done, 0 s elapsed"
        );
    }
}
