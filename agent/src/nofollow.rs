//! Opening one name below a folder already held open, never through a link: what lies under a
//! path the agent's user or a guest could write is taken for what it is, not for what a link
//! there points to. Root's code (the exec helper, the metrics publisher) opens that way.

use std::os::fd::{AsFd, OwnedFd};

use nix::fcntl::{openat, OFlag};
use nix::sys::stat::Mode;
use nix::NixPath;

/// A folder, opened to look into: no link, closed on exec.
pub const FOLDER: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// A file, opened to be read: no link, no wait for a FIFO's writer, never the opener's
/// controlling terminal, closed on exec.
pub const FILE: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_NONBLOCK)
    .union(OFlag::O_CLOEXEC)
    .union(OFlag::O_NOCTTY);

/// The folder `name` in `dir` ([`FOLDER`]).
pub fn folder<Fd: AsFd, P: ?Sized + NixPath>(dir: Fd, name: &P) -> nix::Result<OwnedFd> {
    openat(dir, name, FOLDER, Mode::empty())
}

/// The file `name` in `dir`, to read ([`FILE`]).
pub fn file<Fd: AsFd, P: ?Sized + NixPath>(dir: Fd, name: &P) -> nix::Result<OwnedFd> {
    openat(dir, name, FILE, Mode::empty())
}
