//! Progress of long runs: a bar on a terminal, nothing when standard error is not one (CI logs stay quiet).

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar over a number of steps.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `steps` steps, drawn on standard error (through [`crate::console`]) when it is a terminal.
    pub fn new(steps: usize) -> Self {
        let bar =
            ProgressBar::with_draw_target(Some(steps as u64), crate::console::progress_target());
        if let Ok(style) = ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} {msg}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        Progress { bar }
    }

    /// Starts the next step, described by `message`.
    pub fn step(&self, message: &str) {
        self.bar.set_message(message.to_string());
        self.bar.inc(1);
    }

    /// Describes what runs now without advancing.
    pub fn message(&self, message: &str) {
        self.bar.set_message(message.to_string());
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
