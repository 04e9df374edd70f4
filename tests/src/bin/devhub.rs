//! `devhub`: the development hub as a program, for `tests/demo.sh` and for trying the agent by
//! hand. Loopback only.
//!
//! ```text
//! devhub [--listen 127.0.0.1:0] [--token-file PATH] [--heartbeat SECS] [--tls] [--no-ack]
//! ```
//!
//! The bearer token comes from `--token-file` or `$DEVHUB_TOKEN` (never from the command
//! line, where other users could read it). When the hub listens it prints one JSON line on
//! stdout: `{"url", "pid", "cert", "fingerprint"}` (`cert`/`fingerprint` with `--tls`). It logs
//! each frame it receives on stderr (type and id) and reads commands on stdin, one per line,
//! answering each with one JSON line on stdout:
//!
//! | command | effect |
//! |---|---|
//! | `inventory` | dispatch an `inventory_request` |
//! | `dispatch {"action": "provision", "vmid": 120, …}` | dispatch that action under a new transaction |
//! | `stop` / `start` | drop every connection and close the port / listen again on it |
//! | `stats` | sessions, frames, duplicates, results per transaction, inventories, … |
//! | `frames` | every frame received, as text |
//! | `quit` (or end of input) | exit |

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use felhom_tests::devhub::{DevHub, DevHubOptions, HubState};
use hub_protocol::DispatchAction;
use serde_json::{json, Value};

struct Args {
    listen: SocketAddr,
    token: String,
    heartbeat: u32,
    tls: bool,
    ack: bool,
}

const USAGE: &str =
    "usage: devhub [--listen 127.0.0.1:0] [--token-file PATH] [--heartbeat SECS] [--tls] [--no-ack]\n\
     the token comes from --token-file or $DEVHUB_TOKEN";

fn parse_args() -> Result<Args, String> {
    let mut listen: SocketAddr = "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?;
    let mut token_file = None;
    let mut heartbeat = 5;
    let mut tls = false;
    let mut ack = true;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--listen" => {
                listen = value("--listen")?
                    .parse()
                    .map_err(|e| format!("--listen: {e}"))?;
            }
            "--token-file" => token_file = Some(value("--token-file")?),
            "--heartbeat" => {
                heartbeat = value("--heartbeat")?
                    .parse()
                    .map_err(|e| format!("--heartbeat: {e}"))?;
            }
            "--tls" => tls = true,
            "--no-ack" => ack = false,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !listen.ip().is_loopback() {
        return Err(format!(
            "{listen} is not a loopback address; the dev hub stays on loopback"
        ));
    }
    let token = match token_file {
        Some(path) => std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {path}: {e}"))?
            .trim()
            .to_string(),
        None => std::env::var("DEVHUB_TOKEN").unwrap_or_default(),
    };
    if token.is_empty() {
        return Err("no token: pass --token-file or set DEVHUB_TOKEN".to_string());
    }
    Ok(Args {
        listen,
        token,
        heartbeat,
        tls,
        ack,
    })
}

fn stats(state: &HubState) -> Value {
    let results: serde_json::Map<String, Value> = state
        .results
        .iter()
        .map(|(txn, r)| {
            (
                txn.to_string(),
                json!({
                    "applied": r.len(),
                    "outcome": r.first().map(|(_, res)| serde_json::to_value(res.outcome).unwrap_or(Value::Null)),
                }),
            )
        })
        .collect();
    json!({
        "sessions": state.sessions,
        "connected": state.connected,
        "frames": state.frames.len(),
        "duplicates": state.duplicates,
        "heartbeats": state.heartbeats,
        "events": state.events.len(),
        "inventories": state.inventories.len(),
        "results": results,
        "protocol_errors": state.protocol_errors.len(),
        "refused_upgrades": state.refused.len(),
        "dispatches": state.dispatches.len(),
        "dispatches_unacked": state.dispatches.iter().filter(|d| !d.acked).count(),
    })
}

fn say(value: Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("devhub: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut hub = DevHub::start(DevHubOptions {
        host: args.listen.ip().to_string(),
        port: args.listen.port(),
        token: args.token,
        heartbeat_interval_secs: args.heartbeat,
        tls: args.tls,
        ack: args.ack,
        session_name: None,
        ..DevHubOptions::default()
    });
    say(json!({
        "url": hub.url(),
        "pid": std::process::id(),
        "cert": hub.cert_pem().map(|p| p.display().to_string()),
        "fingerprint": hub.fingerprint(),
    }));

    // Log what arrives, on stderr.
    let (lines_tx, lines_rx) = std::sync::mpsc::channel::<Option<String>>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            match line {
                Ok(l) => {
                    if lines_tx.send(Some(l)).is_err() {
                        return;
                    }
                }
                Err(_) => break,
            }
        }
        let _ = lines_tx.send(None);
    });
    let mut logged = 0usize;
    loop {
        let state = hub.snapshot();
        for f in &state.frames[logged.min(state.frames.len())..] {
            if f.type_name == Some("heartbeat") {
                continue;
            }
            eprintln!(
                "devhub <- session {} {} {}{}",
                f.session,
                f.type_name.unwrap_or("(undecodable)"),
                f.id.map(|i| i.to_string()).unwrap_or_default(),
                if f.duplicate { " (duplicate)" } else { "" }
            );
        }
        logged = state.frames.len();
        let line = match lines_rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(line)) => line,
            Ok(None) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
        };
        let (command, rest) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
        match command {
            "" => {}
            "inventory" => {
                let txn = hub.dispatch(DispatchAction::InventoryRequest);
                say(json!({"dispatched": txn.to_string(), "action": "inventory_request"}));
            }
            "dispatch" => match serde_json::from_str::<DispatchAction>(rest) {
                Ok(action) => {
                    let txn = hub.dispatch(action);
                    say(json!({"dispatched": txn.to_string()}));
                }
                Err(e) => say(json!({"error": format!("not a dispatch action: {e}")})),
            },
            "stop" => {
                if hub.is_running() {
                    hub.stop();
                }
                say(json!({"running": false}));
            }
            "start" => {
                if !hub.is_running() {
                    hub.restart();
                }
                say(json!({"running": true, "url": hub.url()}));
            }
            "stats" => say(stats(&hub.snapshot())),
            "frames" => say(json!(hub
                .snapshot()
                .frames
                .iter()
                .map(|f| f.text.clone())
                .collect::<Vec<_>>())),
            "quit" => break,
            other => say(json!({"error": format!("unknown command {other:?}")})),
        }
    }
    ExitCode::SUCCESS
}
