//! What a VM's guest agent says it allows, before anything is run in it: qemu-ga's
//! `guest-info` as PVE's `GET agent/info` returns it, and the words of an `agent/exec` that
//! qemu-ga refused (tests/data/guest-exec-facts.md §3.6).
//!
//! RHEL, Rocky and Alma ship qemu-guest-agent with `guest-exec` and `guest-exec-status`
//! blocked (`/etc/sysconfig/qemu-ga`): such a guest answers `guest-ping` and `guest-info`, and
//! lists both commands with `"enabled": false`. The answer comes from the guest, so it is
//! read as hostile: at most [`MAX_COMMANDS`] entries, names compared exactly, and anything
//! that is not the documented shape says nothing (the exec is then tried, as before).

use serde_json::Value;

/// The guest-agent commands every command in a VM goes through (`agent/exec`,
/// `agent/exec-status`).
pub const EXEC_COMMANDS: [&str; 2] = ["guest-exec", "guest-exec-status"];

/// How many entries of `supported_commands` are read (qemu-ga 7.2 lists 45, 9.x about 50).
pub const MAX_COMMANDS: usize = 512;

/// What a guest agent's `guest-info` says of the exec commands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecOffer {
    /// Both are listed and enabled.
    Offered,
    /// One or both are disabled or missing; the names of those, in [`EXEC_COMMANDS`] order.
    Refused {
        /// Each refused command with how: `guest-exec disabled`, `guest-exec-status missing`.
        refused: Vec<String>,
        /// The guest agent's version as it reported it (clipped, escaped), if any.
        version: Option<String>,
    },
    /// The answer is not a `guest-info` (an error object, another shape): nothing is known.
    Unknown(String),
}

/// Read PVE's `agent/info` data (`{"result": <guest-info's return or an error object>}`).
pub fn exec_offer(data: &Value) -> ExecOffer {
    let Some(result) = data.get("result") else {
        return ExecOffer::Unknown("no `result` in the answer".to_string());
    };
    if let Some(err) = result.get("error") {
        let desc = err
            .get("desc")
            .and_then(Value::as_str)
            .unwrap_or("(no description)");
        return ExecOffer::Unknown(format!(
            "guest-info answered an error: {}",
            crate::error::outside_text(desc)
        ));
    }
    let Some(list) = result.get("supported_commands").and_then(Value::as_array) else {
        return ExecOffer::Unknown("no `supported_commands` list".to_string());
    };
    let version = result
        .get("version")
        .and_then(Value::as_str)
        .map(|v| crate::error::outside_text_max(v, 64));
    let mut refused = Vec::new();
    for name in EXEC_COMMANDS {
        let entry = list
            .iter()
            .take(MAX_COMMANDS)
            .find(|c| c.get("name").and_then(Value::as_str) == Some(name));
        match entry.map(|c| c.get("enabled")) {
            None => refused.push(format!("{name} missing")),
            Some(Some(Value::Bool(true))) => {}
            Some(Some(Value::Bool(false))) => refused.push(format!("{name} disabled")),
            // PVE's JSON encoder writes qemu-ga's booleans as true/false; anything else is
            // not an answer about this command.
            Some(other) => {
                return ExecOffer::Unknown(format!(
                    "{name}'s `enabled` is {}",
                    crate::error::outside_text_max(
                        &other.map_or("absent".to_string(), Value::to_string),
                        64
                    )
                ))
            }
        }
    }
    if refused.is_empty() {
        ExecOffer::Offered
    } else {
        ExecOffer::Refused { refused, version }
    }
}

/// Whether PVE's message for a refused `agent/exec` (qemu-server `QemuServer/Agent.pm`
/// `check_agent_error`: "Agent error: <qemu-ga's desc>") says qemu-ga has the command
/// disabled. qemu-ga's wording changed with its version ("Command guest-exec has been
/// disabled", "…disabled: <reason>" in qemu-ga 7.2; "The command guest-exec has been disabled
/// for this instance" in older ones): only a fallback for a guest whose `guest-info` said
/// nothing.
pub fn exec_refused_message(message: &str) -> bool {
    // PVE's words, after the HTTP status the exec error puts before them ("500 Agent error: …").
    let line = message.lines().next().unwrap_or("").trim();
    let line = line
        .split_once(' ')
        .filter(|(status, _)| status.len() == 3 && status.bytes().all(|b| b.is_ascii_digit()))
        .map_or(line, |(_, rest)| rest);
    let Some(desc) = line.strip_prefix("Agent error: ") else {
        return false;
    };
    (desc.starts_with("Command guest-exec ") || desc.starts_with("The command guest-exec "))
        && desc.contains(" has been disabled")
}

/// What the operator reads when a VM's guest agent refuses exec: what could not be judged,
/// and how to allow it in the guest.
pub fn exec_blocked_message(vmid: u32, node: &str, seen: &str) -> String {
    format!(
        "VM {vmid} on node {node} booted and its QEMU guest agent answers, but it refuses guest-exec ({seen}), through which every command in a VM runs: its boot, bootstrap and checks could not be judged. RHEL, Rocky and Alma ship qemu-guest-agent so; to allow it, in the production guest take guest-exec and guest-exec-status out of the blocked RPCs (or add them to the allowed ones, --allow-rpcs) in /etc/sysconfig/qemu-ga and run `systemctl restart qemu-guest-agent`; its next backup can then be judged"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn info(cmds: Value) -> Value {
        json!({"result": {"version": "7.2.15", "supported_commands": cmds}})
    }

    #[test]
    fn both_enabled_is_offered() {
        let v = info(json!([
            {"name": "guest-ping", "enabled": true, "success-response": true},
            {"name": "guest-exec-status", "enabled": true, "success-response": true},
            {"name": "guest-exec", "enabled": true, "success-response": true},
        ]));
        assert_eq!(exec_offer(&v), ExecOffer::Offered);
    }

    #[test]
    fn el_block_list_is_refused_naming_both() {
        let v = info(json!([
            {"name": "guest-ping", "enabled": true},
            {"name": "guest-exec", "enabled": false},
            {"name": "guest-exec-status", "enabled": false},
        ]));
        assert_eq!(
            exec_offer(&v),
            ExecOffer::Refused {
                refused: vec![
                    "guest-exec disabled".to_string(),
                    "guest-exec-status disabled".to_string()
                ],
                version: Some("7.2.15".to_string()),
            }
        );
    }

    #[test]
    fn only_the_status_blocked_is_refused_too() {
        let v = info(json!([
            {"name": "guest-exec", "enabled": true},
            {"name": "guest-exec-status", "enabled": false},
        ]));
        assert!(
            matches!(exec_offer(&v), ExecOffer::Refused { refused, .. } if refused == ["guest-exec-status disabled"])
        );
    }

    #[test]
    fn a_command_not_listed_is_missing() {
        let v = info(json!([{"name": "guest-ping", "enabled": true}]));
        assert!(
            matches!(exec_offer(&v), ExecOffer::Refused { refused, .. } if refused == ["guest-exec missing", "guest-exec-status missing"])
        );
    }

    #[test]
    fn odd_answers_say_nothing() {
        for v in [
            json!(null),
            json!({}),
            json!({"result": {"error": {"class": "GenericError", "desc": "no\nway"}}}),
            json!({"result": {"supported_commands": "guest-exec"}}),
            info(json!([{"name": "guest-exec", "enabled": "false"},
                         {"name": "guest-exec-status", "enabled": true}])),
            info(json!([{"name": "guest-exec", "enabled": 0},
                         {"name": "guest-exec-status", "enabled": true}])),
            info(json!([{"name": "guest-exec"}, {"name": "guest-exec-status", "enabled": true}])),
        ] {
            assert!(matches!(exec_offer(&v), ExecOffer::Unknown(_)), "{v}");
        }
        // A guest's error text is escaped before it reaches a message.
        let v = json!({"result": {"error": {"desc": "a\nb"}}});
        assert!(matches!(exec_offer(&v), ExecOffer::Unknown(m) if !m.contains('\n')));
    }

    #[test]
    fn entries_past_the_bound_are_not_read() {
        let mut cmds: Vec<Value> = (0..MAX_COMMANDS)
            .map(|i| json!({"name": format!("x-{i}"), "enabled": true}))
            .collect();
        cmds.push(json!({"name": "guest-exec", "enabled": true}));
        cmds.push(json!({"name": "guest-exec-status", "enabled": true}));
        assert!(matches!(
            exec_offer(&info(Value::Array(cmds))),
            ExecOffer::Refused { .. }
        ));
    }

    #[test]
    fn refused_exec_wording_of_each_qemu_ga() {
        for m in [
            // The bed's real qemu-ga 7.2 with --block-rpcs, through the fake's agent/exec and
            // the exec error's display.
            "500 Agent error: Command guest-exec has been disabled",
            "Agent error: Command guest-exec has been disabled",
            "Agent error: Command guest-exec has been disabled: blocked by policy",
            "Agent error: The command guest-exec has been disabled for this instance",
        ] {
            assert!(exec_refused_message(m), "{m}");
        }
        for m in [
            "Agent error: Guest agent command failed, error was 'Failed to execute child process \"/bin/sh\" (No such file or directory)'",
            "QEMU guest agent is not running",
            "Command guest-exec has been disabled",
            "500 Command guest-exec has been disabled",
            "guest call failed: Agent error: Command guest-exec has been disabled",
            "Agent error: Command guest-file-open has been disabled",
        ] {
            assert!(!exec_refused_message(m), "{m}");
        }
    }

    #[test]
    fn the_message_names_the_vm_and_the_fix() {
        let m = exec_blocked_message(990001, "pve1", "guest-info: guest-exec disabled");
        for part in [
            "VM 990001",
            "node pve1",
            "guest-exec disabled",
            "/etc/sysconfig/qemu-ga",
            "systemctl restart qemu-guest-agent",
        ] {
            assert!(m.contains(part), "{part}: {m}");
        }
    }
}
