//! Standard output as a Unix tool writes it: a closed pipe ends the program quietly, any other
//! write error is an `error:` line and exit status 2.
//!
//! Rust ignores SIGPIPE, so a write to a closed pipe returns `BrokenPipe`, on which `println!`
//! panics (exit 101). Every command prints through [`outln!`] and [`out!`] instead.

use std::io::Write;

/// Exit status of a failed command, as `main` returns it.
pub const FAILURE: i32 = 2;

/// Writes `args` to standard output and flushes it, so a full disk or device is noticed at the
/// line that hit it rather than lost in a final flush. A closed pipe (`protrain ... | head`)
/// exits 0 at once without a word: the reader has what it wanted. Any other error is reported
/// as `error: cannot write standard output: ...` and exits with status 2.
pub fn write_fmt(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        fail(&e);
    }
}

/// Writes `bytes` to standard output with [`write_fmt`]'s handling of errors.
pub fn write_all(bytes: &[u8]) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(bytes).and_then(|()| out.flush()) {
        fail(&e);
    }
}

/// Ends the program for a failed write to standard output.
fn fail(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    // Standard error may be closed too; there is nobody left to tell then.
    let _ = writeln!(
        std::io::stderr(),
        "error: cannot write standard output: {e}"
    );
    std::process::exit(FAILURE);
}

/// `println!` to standard output, with [`write_fmt`]'s handling of a closed pipe and errors.
macro_rules! outln {
    () => {
        $crate::out::write_fmt(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write_fmt(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` to standard output, with [`write_fmt`]'s handling of a closed pipe and errors.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write_fmt(format_args!($($arg)*))
    };
}
