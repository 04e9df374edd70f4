//! stdout and stderr as the agent writes to them: a stream whose reader went away (a closed
//! pipe: `felhom-agent guests | true`, `journal | head -1`, a terminal closed under a running
//! provision) stops the output, never the work. Rust ignores SIGPIPE, so such a write fails
//! with EPIPE; `println!`/`eprintln!` would panic on it (exit 101, a transaction left where the
//! panic hit it). Every byte the agent prints goes through here instead: a write that fails
//! with EPIPE marks its stream gone and later writes to it are dropped; any other write error
//! is dropped too. The command runs to its end and exits with its own status.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Which stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// stdout: results.
    Out,
    /// stderr: errors, warnings, logs and the progress view.
    Err,
}

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

fn gone_flag(stream: Stream) -> &'static AtomicBool {
    match stream {
        Stream::Out => &STDOUT_GONE,
        Stream::Err => &STDERR_GONE,
    }
}

/// Whether a write to `stream` found its reader gone.
pub fn gone(stream: Stream) -> bool {
    gone_flag(stream).load(Ordering::Relaxed)
}

/// Write `bytes` to `stream` and flush; a closed pipe marks the stream gone (nothing more is
/// written to it), any other error is dropped. Never panics.
pub fn write(stream: Stream, bytes: &[u8]) {
    if gone(stream) {
        return;
    }
    let ended = match stream {
        Stream::Out => {
            let mut out = io::stdout().lock();
            out.write_all(bytes).and_then(|()| out.flush())
        }
        Stream::Err => {
            let mut err = io::stderr().lock();
            err.write_all(bytes).and_then(|()| err.flush())
        }
    };
    if let Err(e) = ended {
        if e.kind() == io::ErrorKind::BrokenPipe {
            gone_flag(stream).store(true, Ordering::Relaxed);
        }
    }
}

/// `text` and a newline on stdout.
pub fn out_line(text: &str) {
    write(Stream::Out, format!("{text}\n").as_bytes());
}

/// `text` and a newline on stderr.
pub fn err_line(text: &str) {
    write(Stream::Err, format!("{text}\n").as_bytes());
}

/// stderr for the log lines (tracing's writer): every write reports success, so the logger
/// never complains about a closed stream (it would print the complaint with `eprintln!`,
/// which panics on that same stream).
#[derive(Debug, Clone, Copy, Default)]
pub struct LogStderr;

impl Write for LogStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        write(Stream::Err, buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogStderr {
    type Writer = LogStderr;

    fn make_writer(&'a self) -> Self::Writer {
        LogStderr
    }
}
