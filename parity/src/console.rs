//! Standard output and standard error: the one place `qwen35` writes to either, so that a write that fails (stdout
//! or stderr sent to a full disk, `> /dev/full`, a terminal that went away) is never a panic.
//!
//! A failed write is recorded, not raised: the run goes on (its files are still written, its checks still decide the
//! exit code), later writes to the same stream are skipped, and `main` ends with the run's own exit code (0 or 1),
//! saying on standard error, when it still works, that the report could not be printed ([`stdout_failure`]). An
//! error stays exit 2 whether or not its message could be printed. A closed pipe is not a failed write: `main`
//! restores SIGPIPE's default, so `qwen35 devices | head` ends quietly as any Unix tool does.
//!
//! Everything else in the crate prints through [`out!`](crate::out), [`outln!`](crate::outln) and
//! [`errln!`](crate::errln) (the crate denies `print!`, `println!`, `eprint!` and `eprintln!`), progress bars draw
//! through [`progress_target`], and clap's help, version and usage errors through [`clap_error`].
#![allow(clippy::print_stdout, clippy::print_stderr, clippy::disallowed_methods)]

use std::fmt;
use std::io::{IsTerminal, Write};
use std::sync::Mutex;

/// The first failed write to standard output, as text.
static STDOUT_FAILED: Mutex<Option<String>> = Mutex::new(None);
/// Whether a write to standard error failed (its later writes are skipped).
static STDERR_FAILED: Mutex<bool> = Mutex::new(false);

/// One of the two streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output: reports.
    Out,
    /// Standard error: errors, warnings, progress.
    Err,
}

impl Stream {
    /// Whether the stream is a terminal (colours and progress bars only then).
    pub fn is_terminal(self) -> bool {
        match self {
            Stream::Out => std::io::stdout().is_terminal(),
            Stream::Err => std::io::stderr().is_terminal(),
        }
    }

    /// Whether a write to the stream has failed.
    fn failed(self) -> bool {
        match self {
            Stream::Out => lock(&STDOUT_FAILED).is_some(),
            Stream::Err => *lock(&STDERR_FAILED),
        }
    }

    /// Records a failed write.
    fn fail(self, e: &std::io::Error) {
        match self {
            Stream::Out => {
                let mut f = lock(&STDOUT_FAILED);
                if f.is_none() {
                    *f = Some(e.to_string());
                }
            }
            Stream::Err => *lock(&STDERR_FAILED) = true,
        }
    }
}

/// A lock that a panic elsewhere cannot poison for the writer.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes `text` to `stream` and flushes it; a failure is recorded (see the module docs), never raised. Nothing is
/// written once the stream has failed.
pub fn write(stream: Stream, text: fmt::Arguments) {
    if stream.failed() {
        return;
    }
    let result = match stream {
        Stream::Out => {
            let mut s = std::io::stdout().lock();
            s.write_fmt(text).and_then(|()| s.flush())
        }
        Stream::Err => {
            let mut s = std::io::stderr().lock();
            s.write_fmt(text).and_then(|()| s.flush())
        }
    };
    if let Err(e) = result {
        stream.fail(&e);
    }
}

/// Why standard output could not take the report, when a write to it failed.
pub fn stdout_failure() -> Option<String> {
    lock(&STDOUT_FAILED).clone()
}

/// Prints to standard output without panicking (see [`crate::console`]).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::console::write($crate::console::Stream::Out, format_args!($($arg)*))
    };
}

/// Prints a line to standard output without panicking (see [`crate::console`]).
#[macro_export]
macro_rules! outln {
    () => {
        $crate::console::write($crate::console::Stream::Out, format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::console::write($crate::console::Stream::Out, format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Prints a line to standard error without panicking (see [`crate::console`]).
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::console::write($crate::console::Stream::Err, format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Prints clap's help, version or usage error (help and version on standard output, errors on standard error) and
/// returns its exit code (0 for help and version, 2 for a usage error).
pub fn clap_error(e: &clap::Error) -> u8 {
    let stream = if e.use_stderr() {
        Stream::Err
    } else {
        Stream::Out
    };
    let text = e.render();
    if stream.is_terminal() {
        write(stream, format_args!("{}", text.ansi()));
    } else {
        write(stream, format_args!("{text}"));
    }
    u8::try_from(e.exit_code()).unwrap_or(2)
}

/// Where progress bars draw: standard error through this writer when it is a terminal, nowhere otherwise (CI logs
/// stay quiet).
pub fn progress_target() -> indicatif::ProgressDrawTarget {
    if Stream::Err.is_terminal() {
        indicatif::ProgressDrawTarget::term_like(Box::new(ErrTerm))
    } else {
        indicatif::ProgressDrawTarget::hidden()
    }
}

/// Standard error as indicatif's terminal: every escape and line goes through [`write`].
#[derive(Debug)]
struct ErrTerm;

impl indicatif::TermLike for ErrTerm {
    fn width(&self) -> u16 {
        #[cfg(unix)]
        {
            // SAFETY: TIOCGWINSZ fills the `winsize` it is given and reads nothing else.
            let mut size: libc::winsize = unsafe { std::mem::zeroed() };
            if unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut size) } == 0
                && size.ws_col > 0
            {
                return size.ws_col;
            }
        }
        80
    }

    fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
        self.escape(n, 'A')
    }

    fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
        self.escape(n, 'B')
    }

    fn move_cursor_right(&self, n: usize) -> std::io::Result<()> {
        self.escape(n, 'C')
    }

    fn move_cursor_left(&self, n: usize) -> std::io::Result<()> {
        self.escape(n, 'D')
    }

    fn write_line(&self, s: &str) -> std::io::Result<()> {
        write(Stream::Err, format_args!("{s}\n"));
        Ok(())
    }

    fn write_str(&self, s: &str) -> std::io::Result<()> {
        write(Stream::Err, format_args!("{s}"));
        Ok(())
    }

    fn clear_line(&self) -> std::io::Result<()> {
        write(Stream::Err, format_args!("\r\x1b[2K"));
        Ok(())
    }

    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ErrTerm {
    /// The cursor moved `n` cells in the direction `code` (an ANSI escape).
    fn escape(&self, n: usize, code: char) -> std::io::Result<()> {
        if n > 0 {
            write(Stream::Err, format_args!("\x1b[{n}{code}"));
        }
        Ok(())
    }
}
