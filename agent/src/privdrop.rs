//! Switching a command-line run started as root to the agent's system user (`[agent] user`).
//!
//! The switch happens after the config and the secrets are read (they are root's) and before
//! anything else: every file the run writes afterwards (journal, outbox, locks, metrics)
//! belongs to the user, and guest exec goes through the root exec helper like the daemon's.
//! It is for good: real, effective and saved ids all change, the supplementary groups become
//! the user's (`initgroups`; the package's user is in no pmxcfs group: the exec helper hands it
//! the cluster files it reads), and the
//! switch is verified by trying to get root back, which must fail.

use crate::error::Failure;
use hub_protocol::ErrorCode;
use nix::unistd::{Gid, Uid, User};
use std::ffi::CString;

/// What [`drop_to`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// Not root: nothing to switch (the systemd units start the agent as its user already).
    NotRoot,
    /// Now running as this user for good.
    To {
        /// The user's name.
        user: String,
        /// Its uid.
        uid: u32,
        /// Its primary gid.
        gid: u32,
    },
}

fn refused(user: &str, what: String) -> Failure {
    Failure::new(
        ErrorCode::ConfigInvalid,
        format!("cannot switch to [agent] user {user:?}: {what}"),
    )
}

/// Switch the whole process to `user` for good when it runs as root; nothing otherwise.
///
/// Call it before the process starts threads of its own: the ids are changed for every
/// thread (glibc signals each one), but a thread that is inside a system call meanwhile would
/// finish it with the old ids.
pub fn drop_to(user: &str) -> Result<Dropped, Failure> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(Dropped::NotRoot);
    }
    let entry = User::from_name(user)
        .map_err(|e| refused(user, format!("the user database cannot be read ({e})")))?
        .ok_or_else(|| {
            refused(
                user,
                "no such user on this node; install the package (it creates the system user felhom-agent) or `adduser --system --group felhom-agent`, or fix [agent] user in the config".to_string(),
            )
        })?;
    if entry.uid.is_root() {
        return Err(refused(
            user,
            "it is root; name the unprivileged system user (felhom-agent) or remove [agent] user"
                .to_string(),
        ));
    }
    let name = CString::new(user).map_err(|_| refused(user, "the name holds a NUL".to_string()))?;
    let (uid, gid) = (entry.uid, entry.gid);
    nix::unistd::initgroups(&name, gid)
        .map_err(|e| refused(user, format!("setting its groups failed ({e})")))?;
    nix::unistd::setresgid(gid, gid, gid)
        .map_err(|e| refused(user, format!("setresgid({gid}) failed ({e})")))?;
    nix::unistd::setresuid(uid, uid, uid)
        .map_err(|e| refused(user, format!("setresuid({uid}) failed ({e})")))?;
    verify(user, uid, gid)?;
    // A change of the effective uid resets the dumpable flag to the system's suid_dumpable
    // setting; the process holds the secrets, so no core dump and no ptrace by the user.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        return Err(refused(
            user,
            format!("cannot mark the process non-dumpable after the switch ({e}); not going on"),
        ));
    }
    tracing::info!(
        user,
        uid = uid.as_raw(),
        gid = gid.as_raw(),
        "switched to the agent's user"
    );
    Ok(Dropped::To {
        user: user.to_string(),
        uid: uid.as_raw(),
        gid: gid.as_raw(),
    })
}

/// Check that the switch holds: every id is the user's, no capability is left, and root
/// cannot be regained.
fn verify(user: &str, uid: Uid, gid: Gid) -> Result<(), Failure> {
    let ids =
        nix::unistd::getresuid().map_err(|e| refused(user, format!("getresuid failed ({e})")))?;
    let gids =
        nix::unistd::getresgid().map_err(|e| refused(user, format!("getresgid failed ({e})")))?;
    if [ids.real, ids.effective, ids.saved] != [uid; 3]
        || [gids.real, gids.effective, gids.saved] != [gid; 3]
    {
        return Err(refused(
            user,
            format!("the ids did not all change (uid {ids:?}, gid {gids:?}); not going on"),
        ));
    }
    if nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).is_ok()
        || nix::unistd::setuid(Uid::from_raw(0)).is_ok()
    {
        return Err(refused(
            user,
            "root could be regained after the switch; not going on".to_string(),
        ));
    }
    match held_capabilities() {
        Some(0) => Ok(()),
        Some(caps) => Err(refused(
            user,
            format!("capabilities {caps:#x} are still held after the switch; not going on"),
        )),
        None => Err(refused(
            user,
            "/proc/self/status cannot be read to check the capabilities".to_string(),
        )),
    }
}

/// The permitted and effective capability sets of this process, OR-ed, from
/// `/proc/self/status`.
fn held_capabilities() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let mut held = 0u64;
    let mut seen = 0;
    for line in status.lines() {
        for key in ["CapPrm:", "CapEff:"] {
            if let Some(v) = line.strip_prefix(key) {
                held |= u64::from_str_radix(v.trim(), 16).ok()?;
                seen += 1;
            }
        }
    }
    (seen == 2).then_some(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_user_is_a_coded_refusal_naming_it() {
        if !nix::unistd::geteuid().is_root() {
            assert_eq!(
                drop_to("no-such-user-x").expect("not root"),
                Dropped::NotRoot
            );
            return;
        }
        let err = drop_to("no-such-user-x").expect_err("unknown user");
        assert_eq!(err.code, ErrorCode::ConfigInvalid);
        assert!(
            err.message.contains("\"no-such-user-x\""),
            "{}",
            err.message
        );
        assert!(err.message.contains("adduser --system"), "{}", err.message);
        // Still root: a refusal changes nothing.
        assert!(nix::unistd::geteuid().is_root());
    }

    #[test]
    fn root_is_no_user_to_switch_to() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let err = drop_to("root").expect_err("root");
        assert_eq!(err.code, ErrorCode::ConfigInvalid);
        assert!(err.message.contains("it is root"), "{}", err.message);
    }

    #[test]
    fn this_process_has_readable_capabilities() {
        assert!(held_capabilities().is_some());
    }
}
