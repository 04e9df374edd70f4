//! PVE task ids (UPIDs): `UPID:node:PID:PSTART:STARTTIME:type:id:user:`.
//!
//! pid is 8 hex digits, pstart 8 or 9 (9 once the node's uptime passes about 497 days),
//! starttime 8; the user includes `!tokenid` for token tasks; the string ends with `:`.

use std::fmt;
use std::str::FromStr;

/// A parsed UPID. [`Upid::as_str`] gives back the exact string PVE sent.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Upid {
    raw: String,
    /// The node the task runs on (task endpoints must use this node).
    pub node: String,
    /// Worker process id.
    pub pid: u32,
    /// Worker process start time in clock ticks since boot.
    pub pstart: u64,
    /// Task start, Unix seconds.
    pub starttime: u64,
    /// Task type, e.g. `vzrestore`, `qmstart`.
    pub task_type: String,
    /// Task id, usually the vmid; may be empty.
    pub id: String,
    /// The authenticated id that started the task, with `!tokenid` for tokens.
    pub user: String,
}

/// Why a string is not a UPID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed task id {input:?}: {reason}")]
pub struct UpidError {
    /// The rejected input.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn valid_node(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
}

fn valid_field(s: &str, allow_empty: bool) -> bool {
    (allow_empty || !s.is_empty()) && !s.chars().any(|c| c == ':' || c == '/' || c.is_whitespace())
}

impl FromStr for Upid {
    type Err = UpidError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| UpidError {
            input: s.to_string(),
            reason,
        };
        let body = s
            .strip_prefix("UPID:")
            .ok_or_else(|| err("does not start with UPID:"))?;
        let body = body
            .strip_suffix(':')
            .ok_or_else(|| err("does not end with ':'"))?;
        let parts: Vec<&str> = body.split(':').collect();
        let [node, pid, pstart, starttime, task_type, id, user] = parts[..] else {
            return Err(err("does not have 7 fields"));
        };
        if !valid_node(node) {
            return Err(err("bad node name"));
        }
        if pid.len() != 8 || !is_hex(pid) {
            return Err(err("pid is not 8 hex digits"));
        }
        if !(pstart.len() == 8 || pstart.len() == 9) || !is_hex(pstart) {
            return Err(err("pstart is not 8 or 9 hex digits"));
        }
        if starttime.len() != 8 || !is_hex(starttime) {
            return Err(err("starttime is not 8 hex digits"));
        }
        if !valid_field(task_type, false) {
            return Err(err("bad task type"));
        }
        if !valid_field(id, true) {
            return Err(err("bad task id field"));
        }
        if !valid_field(user, false) {
            return Err(err("bad user field"));
        }
        let hex = |v: &str| u64::from_str_radix(v, 16).map_err(|_| err("bad hex number"));
        Ok(Upid {
            raw: s.to_string(),
            node: node.to_string(),
            pid: u32::try_from(hex(pid)?).map_err(|_| err("pid out of range"))?,
            pstart: hex(pstart)?,
            starttime: hex(starttime)?,
            task_type: task_type.to_string(),
            id: id.to_string(),
            user: user.to_string(),
        })
    }
}

impl Upid {
    /// The exact UPID string.
    pub fn as_str(&self) -> &str {
        &self.raw
    }
}

impl fmt::Display for Upid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

impl serde::Serialize for Upid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.raw)
    }
}

impl<'de> serde::Deserialize<'de> for Upid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_token_task() {
        let u: Upid = "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:123:agent@pve!prov:"
            .parse()
            .unwrap();
        assert_eq!(u.node, "pve1");
        assert_eq!(u.pid, 0x0003A2F1);
        assert_eq!(u.pstart, 0x01B7E4C0);
        assert_eq!(u.starttime, 0x6650C0DE);
        assert_eq!(u.task_type, "vzrestore");
        assert_eq!(u.id, "123");
        assert_eq!(u.user, "agent@pve!prov");
        assert_eq!(
            u.to_string(),
            "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:123:agent@pve!prov:"
        );
    }

    #[test]
    fn nine_digit_pstart_and_empty_id() {
        let u: Upid = "UPID:node-2:000003E8:1234ABCDE:6B0CA4FD:lxc::root@pam:"
            .parse()
            .unwrap();
        assert_eq!(u.pstart, 0x1234ABCDE);
        assert_eq!(u.id, "");
        assert_eq!(u.node, "node-2");
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:123:agent@pve!prov",
            "upid:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:123:root@pam:",
            "UPID:pve1:3A2F1:01B7E4C0:6650C0DE:vzrestore:123:root@pam:",
            "UPID:pve1:0003A2F1:1B7E4C0:6650C0DE:vzrestore:123:root@pam:",
            "UPID:pve1:0003A2F1:01B7E4C000:6650C0DE:vzrestore:123:root@pam:",
            "UPID:pve1:0003A2F1:01B7E4C0:6650C0D:vzrestore:123:root@pam:",
            "UPID:-pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:123:root@pam:",
            "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE::123:root@pam:",
            "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:123::",
            "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vz restore:123:root@pam:",
            "UPID:pve1:0003A2F1:01B7E4C0:6650C0DE:vzrestore:123:root@pam:extra:",
            "UPID:pve1:0003G2F1:01B7E4C0:6650C0DE:vzrestore:123:root@pam:",
        ] {
            assert!(bad.parse::<Upid>().is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn serde_round_trip() {
        let s = "\"UPID:pve1:000003E8:00001B58:6B0CA4FD:vzrestore:201:agent@pve!felhom:\"";
        let u: Upid = serde_json::from_str(s).unwrap();
        assert_eq!(serde_json::to_string(&u).unwrap(), s);
        assert!(serde_json::from_str::<Upid>("\"nope\"").is_err());
    }
}
