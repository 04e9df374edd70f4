//! The root exec helper (`felhom-agent exec-helper`), the real binary on a real Unix socket:
//! it runs a command or a push only for a caller of root or the agent's user, only in an LXC
//! container that a transaction of this agent holds an armed claim on (the journal a kept
//! `--selftest=provision` wrote in the fakepve guest bed), that is in the node's guest list and
//! in the pool's `user.cfg` line (the fake writes both live, as pmxcfs does). Every `pct` the
//! helper starts is counted by a wrapper in front of the bed's `pct` stand-in.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use felhom_agent::exec_helper::proto::Response;
use felhom_tests::agent::agent_command;
use felhom_tests::fakepve::toml_string;
use felhom_tests::world::World;
use serde_json::{json, Value};

/// A transaction id no journal holds.
const STRANGER_TXN: &str = "01JD00000000000000000000ZZ";

/// A running helper; killed on drop.
struct Helper {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    calls: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Helper {
    /// Start `exec-helper --socket` for world `w`, with `user_cfg_path` on the fake's live
    /// `user.cfg` and `extra` appended to the agent's config; `pct` is a wrapper that logs each
    /// call to `calls` and runs the bed's `pct`.
    fn start(w: &World, extra: &str) -> Helper {
        Self::launch(w, extra, false)
    }

    /// Like [`Helper::start`], but the socket is bound by `systemd-socket-activate`, which
    /// starts the helper on the first connection with the socket as fd 3 (`LISTEN_FDS`).
    fn activated(w: &World, extra: &str) -> Helper {
        Self::launch(w, extra, true)
    }

    fn launch(w: &World, extra: &str, activated: bool) -> Helper {
        Self::launch_env(w, extra, activated, &[])
    }

    /// Like [`Helper::start`], but the helper's config names `vmlist` as `vmlist_path`.
    fn reading(w: &World, extra: &str, vmlist: &Path) -> Helper {
        Self::launch_full(w, extra, false, &[], Some(vmlist), None)
    }

    /// Like [`Helper::start`], but the helper's config names `user_cfg` as `user_cfg_path`.
    fn with_user_cfg(w: &World, extra: &str, user_cfg: &Path) -> Helper {
        Self::launch_full(w, extra, false, &[], None, Some(user_cfg))
    }

    fn launch_env(w: &World, extra: &str, activated: bool, env: &[(&str, &str)]) -> Helper {
        Self::launch_full(w, extra, activated, env, None, None)
    }

    fn launch_full(
        w: &World,
        extra: &str,
        activated: bool,
        env: &[(&str, &str)],
        vmlist: Option<&Path>,
        user_cfg: Option<&Path>,
    ) -> Helper {
        // A folder others may enter, so a caller of another uid can reach the socket (its own
        // mode and group decide who may connect).
        let dir = tempfile::Builder::new()
            .prefix("felhom-exec-")
            .tempdir()
            .expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let calls = dir.path().join("pct-calls.log");
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).expect("bin");
        let wrapper = bin.join("pct");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\necho \"$*\" >> '{}'\nexec '{}' \"$@\"\n",
                calls.display(),
                w.bed.pct().display()
            ),
        )
        .expect("wrapper");
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let config = w.files.dir().join("helper.toml");
        // The world's config has its `[exec]` table (the fake's nodes folder, the bed's
        // lxcpath).
        let mut text = w.files.config_text();
        if let Some(vmlist) = vmlist {
            text = with_vmlist(&text, vmlist);
        }
        std::fs::write(
            &config,
            format!(
                "user_cfg_path = {}\n{text}\n{extra}\n",
                toml_string(
                    &user_cfg
                        .map_or_else(|| w.pve.dir().join("user.cfg"), Path::to_path_buf)
                        .display()
                        .to_string()
                ),
            ),
        )
        .expect("helper config");
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let socket = dir.path().join("exec.sock");
        let log = dir.path().join("helper.log");
        let mut cmd = if activated {
            // It hands the program only the variables given with -E (and LISTEN_*).
            let mut c = Command::new("systemd-socket-activate");
            c.arg("-l").arg(&socket);
            for (k, v) in env {
                c.arg("-E").arg(format!("{k}={v}"));
            }
            c.arg(felhom_tests::agent::agent_bin())
                .arg("--config")
                .arg(&config)
                .arg("exec-helper")
                .env_remove("FELHOM_AGENT_CONFIG");
            c
        } else {
            let mut c = agent_command(&config);
            c.args(["exec-helper", "--socket"]).arg(&socket);
            c
        };
        let child = cmd
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    bin.display(),
                    std::env::var("PATH").unwrap_or_default()
                ),
            )
            .env("FELHOM_AGENT_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start the helper");
        let mut helper = Helper {
            child,
            socket,
            log,
            calls,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&helper.socket).is_err() {
            if let Ok(Some(status)) = helper.child.try_wait() {
                panic!("the helper exited ({status}):\n{}", helper.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "the helper never listened:\n{}",
                helper.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        helper
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The `pct` command lines the helper ran.
    fn pct_calls(&self) -> Vec<String> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn pct_calls_for(&self, vmid: u32) -> usize {
        let word = vmid.to_string();
        self.pct_calls()
            .iter()
            .filter(|l| l.split_whitespace().nth(1) == Some(word.as_str()))
            .count()
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Send raw bytes; the response body, or `None` when the helper closed without one.
    fn raw(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        let mut s = UnixStream::connect(&self.socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        // The helper may answer and close before reading everything sent. The caller sends
        // nothing more and keeps its side open until the answer.
        let _ = s.write_all(bytes);
        let mut len = [0u8; 4];
        s.read_exact(&mut len).ok()?;
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).ok()?;
        Some(body)
    }

    /// One request (a JSON value), its response as JSON.
    fn call(&self, request: &Value) -> Value {
        let body = serde_json::to_vec(request).expect("json");
        let response = self.raw(&frame(&body)).expect("a response");
        serde_json::from_slice(&response).expect("response JSON")
    }
}

/// The demo world without the bed's own exec helper: these tests start and configure the
/// helper themselves.
fn world() -> World {
    World::with_options(
        felhom_tests::fakepve::demo_scenario(),
        &felhom_tests::fakepve::AgentOptions {
            exec_helper: false,
            ..felhom_tests::fakepve::AgentOptions::default()
        },
    )
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

fn b64(bytes: &[u8]) -> String {
    // Standard base64 with padding, written out here so the test does not share the agent's
    // encoder.
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn exec_request(vmid: u32, txn: &str, argv: &[&str]) -> Value {
    json!({"v": 1, "op": "exec", "vmid": vmid, "txn": txn, "argv": argv, "timeout_ms": 30000})
}

fn code(response: &Value) -> &str {
    response["error"]["code"].as_str().unwrap_or("")
}

/// A kept provision of `vmid`; its transaction id.
fn keep(w: &World, vmid: u32) -> String {
    let run = w.agent(&[
        "--selftest=provision",
        "-vmid",
        &vmid.to_string(),
        "--keep",
        "--json",
    ]);
    let doc = run.json();
    assert_eq!(run.code, Some(0), "{doc:#}\n{}", run.stderr);
    assert_eq!(doc["destroy_armed"], json!(true), "{doc:#}");
    doc["txn"].as_str().expect("txn").to_string()
}

/// Wait until the fake's live `user.cfg` satisfies `pred`.
fn wait_user_cfg(w: &World, pred: impl Fn(&str) -> bool) {
    let path = w.pve.dir().join("user.cfg");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if pred(&text) {
            return;
        }
        assert!(Instant::now() < deadline, "user.cfg never changed:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn rootfs_file(w: &World, vmid: u32, path: &str) -> Option<Vec<u8>> {
    std::fs::read(w.bed.guest_path(vmid, path)).ok()
}

/// A provision of `vmid` whose bootstrap waits (until `/root/release` exists in the guest):
/// the running agent and its transaction id, read from the journal once the bootstrap started.
fn provision_in_bootstrap(w: &World, vmid: u32) -> (Child, String) {
    let run = w.files.bootstrap_dir.join("default/run");
    std::fs::write(
        &run,
        "#!/bin/sh\n: > /root/bootstrap-started\nwhile [ ! -e /root/release ]; do sleep 1; done\n",
    )
    .expect("profile");
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let log = w.files.dir().join(format!("provision-{vmid}.log"));
    let mut provision = w
        .command()
        .args(["--selftest=provision", "-vmid", &vmid.to_string(), "--json"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("provision");
    // A real guest's restore extracts a Debian root filesystem, and its start boots systemd:
    // with other tests doing the same on two cores, that can take a minute or more.
    let deadline = Instant::now() + Duration::from_secs(180);
    while rootfs_file(w, vmid, "/root/bootstrap-started").is_none() {
        if let Ok(Some(status)) = provision.try_wait() {
            panic!(
                "the provision ended ({status}) before its bootstrap ran:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "the bootstrap never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let txn = std::fs::read_dir(w.state_dir().join("journal"))
        .expect("journal")
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".log"))
                .map(str::to_string)
        })
        .next()
        .expect("the provision's journal file");
    (provision, txn)
}

/// Set the fake's config of container `vmid` and wait until its live `.conf` shows `line`
/// (or, with `present` false, no longer shows it).
fn set_ct_config(w: &World, vmid: u32, config: &Value, line: &str, present: bool) {
    w.pve.guest_set(vmid, json!({ "config": config }));
    w.pve.call("write_vmlist", json!([]), json!({}));
    let path = w.pve.nodes_dir().join(format!("pve1/lxc/{vmid}.conf"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.lines().any(|l| l == line) == present {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} never changed:\n{text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn only_the_open_transaction_in_a_guest_step_runs_commands_in_its_unprivileged_pooled_container() {
    let w = world();
    let mut h = Helper::start(&w, "");
    let (mut provision, txn) = provision_in_bootstrap(&w, 160);
    // The fake keeps the container's config as pmxcfs does; the restore asked for an
    // unprivileged container.
    let conf =
        std::fs::read_to_string(w.pve.nodes_dir().join("pve1/lxc/160.conf")).expect("160.conf");
    assert!(conf.lines().any(|l| l == "unprivileged: 1"), "{conf}");
    // A container the agent did not create, in the pool, carrying (copied) the marker of the
    // open transaction: the helper must go by the journal, not by what the guest shows.
    let cfg = w.pve.guest(160).expect("160")["config"].clone();
    w.pve.call(
        "add_ct",
        json!([161, "copy"]),
        json!({"pool": "felhom", "status": "running", "config": {
            "hostname": "copy", "tags": cfg["tags"], "description": cfg["description"],
            "unprivileged": 1,
        }}),
    );
    w.pve.call("write_vmlist", json!([]), json!({}));
    w.bed.add_ct(161);
    wait_user_cfg(&w, |t| {
        t.lines()
            .any(|l| l.starts_with("pool:felhom:") && l.contains("160") && l.contains("161"))
    });

    // (4) The armed transaction, its container in the node's list and in the pool: the
    // command runs in the guest, with its env and stdin, and its output comes back.
    let secret = "s3cret-env-value-7f3a";
    let stdin = "stdin-bytes-91c2\n";
    let mut req = exec_request(
        160,
        &txn,
        &[
            "/bin/sh",
            "-c",
            "echo out; echo err >&2; cat; echo \"$HELPER_SECRET\" > /root/helper-env; exit 3",
        ],
    );
    req["env"] = json!([["HELPER_SECRET", secret]]);
    req["stdin"] = json!(b64(stdin.as_bytes()));
    let body = h
        .raw(&frame(&serde_json::to_vec(&req).expect("json")))
        .expect("a response");
    let response = Response::decode(&body).expect("a valid response");
    let Response::Exec(outcome) = response else {
        panic!("expected an outcome, got {response:?}\n{}", h.log_text());
    };
    let outcome = outcome.into_outcome(1 << 20).expect("outcome");
    assert_eq!(outcome.exit_code(), Some(3), "{outcome:?}");
    assert_eq!(outcome.stdout.text(), format!("out\n{stdin}"));
    assert_eq!(outcome.stderr.text(), "err\n");
    assert_eq!(
        rootfs_file(&w, 160, "/root/helper-env").as_deref(),
        Some(format!("{secret}\n").as_bytes()),
        "the env variable reached the command in the container"
    );
    assert!(h.pct_calls_for(160) >= 1, "{:?}", h.pct_calls());

    // A push: the bytes travel in the request, arrive in the container, and are verified.
    let data: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let r = h.call(&json!({
        "v": 1, "op": "push", "vmid": 160, "txn": txn,
        "path": "/root/pushed.bin", "mode": 0o640, "data": b64(&data),
    }));
    assert_eq!(r["push"]["size"], json!(70_000), "{r:#}");
    assert_eq!(r["push"]["mode"], json!(0o640), "{r:#}");
    assert_eq!(
        rootfs_file(&w, 160, "/root/pushed.bin").as_deref(),
        Some(&data[..])
    );
    let meta = std::fs::metadata(w.bed.guest_path(160, "/root/pushed.bin")).expect("pushed");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);

    // (1) The open transaction's id for the copy at 161, and an id no journal holds: refused,
    // and no `pct` ever ran for 161 (its root filesystem is untouched).
    for t in [txn.as_str(), STRANGER_TXN] {
        let r = h.call(&exec_request(161, t, &["/bin/sh", "-c", "touch /root/ran"]));
        assert_eq!(code(&r), "exec_not_owned", "{r:#}");
        assert!(
            r["error"]["message"].as_str().unwrap_or("").contains("161"),
            "{r:#}"
        );
        let r = h.call(&json!({
            "v": 1, "op": "push", "vmid": 161, "txn": t,
            "path": "/root/ran", "mode": 0o644, "data": b64(b"x"),
        }));
        assert_eq!(code(&r), "exec_not_owned", "{r:#}");
    }
    // A link in the journal that names the kept transaction's file under another id is not
    // followed.
    let journal = w.state_dir().join("journal");
    std::os::unix::fs::symlink(
        journal.join(format!("{txn}.log")),
        journal.join(format!("{STRANGER_TXN}.log")),
    )
    .expect("symlink");
    let r = h.call(&exec_request(
        160,
        STRANGER_TXN,
        &["/bin/sh", "-c", "touch /root/ran"],
    ));
    assert_eq!(code(&r), "exec_not_owned", "{r:#}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("symbolic link"),
        "{r:#}\n{:?}",
        std::fs::read_dir(&journal).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    std::fs::remove_file(journal.join(format!("{STRANGER_TXN}.log"))).expect("unlink");
    assert_eq!(h.pct_calls_for(161), 0, "{:?}", h.pct_calls());
    assert!(rootfs_file(&w, 161, "/root/ran").is_none());
    assert!(rootfs_file(&w, 160, "/root/ran").is_none());

    // The container's own config made privileged, given a raw lxc. key, a bind mount of a node
    // path or a device: refused with exec_guest_privileged before `pct` runs, each time.
    let mut changes: Vec<(Value, &str)> = Vec::new();
    let mut privileged = cfg.clone();
    privileged["unprivileged"] = json!(0);
    changes.push((privileged, "unprivileged: 0"));
    let mut raw = cfg.clone();
    raw["lxc.apparmor.profile"] = json!("unconfined");
    changes.push((raw, "lxc.apparmor.profile: unconfined"));
    let mut bind = cfg.clone();
    bind["mp0"] = json!("/srv,mp=/mnt/node");
    changes.push((bind, "mp0: /srv,mp=/mnt/node"));
    let mut dev = cfg.clone();
    dev["dev0"] = json!("/dev/null");
    changes.push((dev, "dev0: /dev/null"));
    for (config, line) in &changes {
        set_ct_config(&w, 160, config, line, true);
        let before = h.pct_calls_for(160);
        let r = h.call(&exec_request(
            160,
            &txn,
            &["/bin/sh", "-c", "touch /root/ran"],
        ));
        assert_eq!(code(&r), "exec_guest_privileged", "{line}: {r:#}");
        let r = h.call(&json!({
            "v": 1, "op": "push", "vmid": 160, "txn": txn,
            "path": "/root/ran", "mode": 0o644, "data": b64(b"x"),
        }));
        assert_eq!(code(&r), "exec_guest_privileged", "{line}: {r:#}");
        assert_eq!(h.pct_calls_for(160), before, "{line}: {:?}", h.pct_calls());
        assert!(rootfs_file(&w, 160, "/root/ran").is_none());
    }
    // Back as it was (the fake merges a config: the added keys set to null are left out):
    // runs again.
    let mut back = cfg.clone();
    for key in ["lxc.apparmor.profile", "mp0", "dev0"] {
        back[key] = Value::Null;
    }
    set_ct_config(&w, 160, &back, "dev0: /dev/null", false);
    let r = h.call(&exec_request(160, &txn, &["/bin/true"]));
    assert_eq!(r["exec"]["exit"], json!({"exited": 0}), "{r:#}");

    // (2) The armed container taken out of the pool (root, outside the agent): refused with
    // exec_not_in_pool, and `pct` does not run.
    let before = h.pct_calls_for(160);
    w.pve.guest_set(160, json!({"pool": null}));
    w.pve.call("write_vmlist", json!([]), json!({}));
    wait_user_cfg(&w, |t| {
        t.lines()
            .filter(|l| l.starts_with("pool:felhom:"))
            .all(|l| {
                !l.split(':')
                    .nth(3)
                    .unwrap_or("")
                    .split(',')
                    .any(|v| v == "160")
            })
    });
    let r = h.call(&exec_request(
        160,
        &txn,
        &["/bin/sh", "-c", "touch /root/ran"],
    ));
    assert_eq!(code(&r), "exec_not_in_pool", "{r:#}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("pool felhom"),
        "{r:#}"
    );
    assert_eq!(h.pct_calls_for(160), before, "{:?}", h.pct_calls());
    assert!(rootfs_file(&w, 160, "/root/ran").is_none());

    // Every request was logged with its vmid and transaction; env values and stdin never.
    assert!(h.alive(), "{}", h.log_text());
    let log = h.log_text();
    assert!(log.contains(&txn) && log.contains("160"), "{log}");
    assert!(log.contains("HELPER_SECRET"), "env keys are logged: {log}");
    assert!(!log.contains(secret), "an env value was logged: {log}");
    assert!(!log.contains("stdin-bytes-91c2"), "stdin was logged: {log}");
    // The push went through `pct exec`: nothing asked the bed's `pct` for a push.
    assert!(
        h.pct_calls().iter().all(|c| !c.starts_with("push ")),
        "{:?}",
        h.pct_calls()
    );
    let _ = provision.kill();
    let _ = provision.wait();
}

#[test]
fn a_kept_transaction_runs_nothing_in_its_container() {
    let w = world();
    let txn = keep(&w, 160);
    let h = Helper::start(&w, "");
    let r = h.call(&exec_request(
        160,
        &txn,
        &["/bin/sh", "-c", "touch /root/ran"],
    ));
    assert_eq!(code(&r), "exec_wrong_phase", "{r:#}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("keeps its guest"),
        "{r:#}"
    );
    let r = h.call(&json!({
        "v": 1, "op": "push", "vmid": 160, "txn": txn,
        "path": "/root/ran", "mode": 0o644, "data": b64(b"x"),
    }));
    assert_eq!(code(&r), "exec_wrong_phase", "{r:#}");
    assert_eq!(h.pct_calls_for(160), 0, "{:?}", h.pct_calls());
    assert!(rootfs_file(&w, 160, "/root/ran").is_none());
}

/// A client of uid `uid` and group `gid` (a small python3 program): sends `body` in one frame,
/// returns the response JSON. The helper answers a refused caller without reading its request
/// and closes, so the send may meet a closed socket; the answer is still there to read.
fn call_as(socket: &Path, uid: u32, gid: u32, body: &Value) -> Value {
    let script = "import socket,struct,sys\n\
        s=socket.socket(socket.AF_UNIX)\n\
        s.connect(sys.argv[1])\n\
        b=sys.stdin.buffer.read()\n\
        try:\n    s.sendall(struct.pack('>I',len(b))+b)\n\
        except BrokenPipeError:\n    pass\n\
        def rd(n):\n    d=b''\n    while len(d)<n:\n        c=s.recv(n-len(d))\n        \
        if not c: raise SystemExit('closed after %d bytes' % len(d))\n        d+=c\n    return d\n\
        n=struct.unpack('>I',rd(4))[0]\n\
        sys.stdout.buffer.write(rd(n))\n";
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(socket)
        .uid(uid)
        .gid(gid)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&serde_json::to_vec(body).expect("json"))
        .expect("write");
    let out = child.wait_with_output().expect("python3");
    assert!(
        out.status.success(),
        "client as uid {uid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("response JSON")
}

#[test]
fn callers_of_other_uids_and_malformed_frames_are_refused_and_the_helper_keeps_serving() {
    let w = world();
    // The agent runs as `daemon` (uid 1): the socket is root:daemon 0660.
    let mut h = Helper::start(&w, "[agent]\nuser = \"daemon\"\n");
    let meta = std::fs::metadata(&h.socket).expect("socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    {
        use std::os::unix::fs::MetadataExt;
        assert_eq!((meta.uid(), meta.gid()), (0, 1));
    }
    let req = exec_request(160, STRANGER_TXN, &["/bin/true"]);

    // (3) uid 65534 in the socket's group: it may connect, and is refused by its uid.
    let r = call_as(&h.socket, 65534, 1, &req);
    assert_eq!(code(&r), "exec_caller_refused", "{r:#}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("65534"),
        "{r:#}"
    );
    // The agent's uid passes the caller check and meets the authorization.
    let r = call_as(&h.socket, 1, 1, &req);
    assert_eq!(code(&r), "exec_not_owned", "{r:#}");

    // Malformed frames: each refused with a code, and the helper goes on serving.
    let huge = u32::MAX.to_be_bytes();
    let oversize = h.raw(&huge).expect("an answer to an oversize length");
    let oversize: Value = serde_json::from_slice(&oversize).expect("json");
    assert_eq!(code(&oversize), "exec_request_invalid", "{oversize:#}");
    assert!(
        oversize["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("larger than the limit"),
        "{oversize:#}"
    );
    let bad_json = h.raw(&frame(b"{\"v\":1,\"op\":")).expect("an answer");
    let bad_json: Value = serde_json::from_slice(&bad_json).expect("json");
    assert_eq!(code(&bad_json), "exec_request_invalid", "{bad_json:#}");
    let mut v2 = req.clone();
    v2["v"] = json!(2);
    let r = h.call(&v2);
    assert_eq!(code(&r), "exec_request_invalid", "{r:#}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("version 2"),
        "{r:#}"
    );
    let mut host_path = json!({"v": 1, "op": "push", "vmid": 160, "txn": STRANGER_TXN,
        "path": "/root/x", "mode": 420, "data": ""});
    host_path["source"] = json!("/etc/shadow");
    let r = h.call(&host_path);
    assert_eq!(code(&r), "exec_request_invalid", "{r:#}");
    // A frame cut short (the caller closes after a part): dropped without an answer.
    {
        let mut s = UnixStream::connect(&h.socket).expect("connect");
        s.write_all(&frame(b"{}")[..5]).expect("send");
        s.shutdown(std::net::Shutdown::Write).expect("shutdown");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty(), "{rest:?}");
    }

    assert!(h.alive(), "{}", h.log_text());
    let r = h.call(&req);
    assert_eq!(code(&r), "exec_not_owned", "{r:#}");
    assert!(h.pct_calls().is_empty(), "{:?}", h.pct_calls());
    let log = h.log_text();
    assert!(
        log.contains("exec_caller_refused") && log.contains("65534"),
        "{log}"
    );
}

#[test]
fn a_socket_activated_helper_serves_the_socket_systemd_passes_it() {
    let w = world();
    // Without --socket and without systemd's socket: nothing to serve, exit 6.
    let run = agent_command(&w.files.config_path)
        .arg("exec-helper")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_PID")
        .output()
        .expect("run the helper");
    assert_eq!(run.status.code(), Some(6), "{run:?}");
    assert!(
        String::from_utf8_lossy(&run.stderr).contains("felhom-agent-exec.socket"),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );

    // --socket on a path that holds something else than a socket: refused, left as it was.
    let dir = tempfile::tempdir().expect("tempdir");
    let not_a_socket = dir.path().join("exec.sock");
    std::fs::write(&not_a_socket, "precious\n").expect("write");
    let run = agent_command(&w.files.config_path)
        .arg("exec-helper")
        .arg("--socket")
        .arg(&not_a_socket)
        .output()
        .expect("run the helper");
    assert_eq!(run.status.code(), Some(6), "{run:?}");
    assert!(
        String::from_utf8_lossy(&run.stderr).contains("is not a socket"),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&not_a_socket).expect("still there"),
        "precious\n"
    );
    // A stale socket (a helper killed without cleaning up) is replaced.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let mut child = agent_command(&w.files.config_path)
        .arg("exec-helper")
        .arg("--socket")
        .arg(&stale)
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the helper");
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(&stale).is_err() {
        assert!(
            matches!(child.try_wait(), Ok(None)),
            "the helper did not replace the stale socket"
        );
        assert!(Instant::now() < deadline, "the helper never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();

    let mut h = Helper::activated(&w, "");
    let r = h.call(&exec_request(160, STRANGER_TXN, &["/bin/true"]));
    assert_eq!(code(&r), "exec_not_owned", "{r:#}\n{}", h.log_text());
    // The same process serves the next connection.
    let r = h.call(&json!({"v": 1}));
    assert_eq!(code(&r), "exec_request_invalid", "{r:#}");
    assert!(h.alive(), "{}", h.log_text());
    assert!(
        h.log_text().contains("exec helper ready"),
        "{}",
        h.log_text()
    );
    assert!(h.pct_calls().is_empty());
    drop(h);

    // Idle (the test build shortens the two minutes): it exits 0, for systemd to start it
    // again on the next connection. It does not exit while a connection is open.
    let mut h = Helper::launch_env(&w, "", true, &[("FELHOM_AGENT_EXEC_IDLE_MS", "1500")]);
    let started = Instant::now();
    let held = UnixStream::connect(&h.socket).expect("connect");
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        h.alive(),
        "exited with a connection open:\n{}",
        h.log_text()
    );
    drop(held);
    let status = loop {
        if let Ok(Some(status)) = h.child.try_wait() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the idle helper never exited:\n{}",
            h.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(0), "{}", h.log_text());
    assert!(
        h.log_text().contains("no connection for"),
        "{}",
        h.log_text()
    );
}

#[test]
fn an_open_provision_runs_commands_through_the_helper_during_its_bootstrap_and_not_after() {
    let w = world();
    // A bootstrap profile that says when it started, then takes a while.
    let run = w.files.bootstrap_dir.join("default/run");
    std::fs::write(&run, "#!/bin/sh\n: > /root/bootstrap-started\nsleep 8\n").expect("profile");
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let h = Helper::start(&w, "");
    let log = w.files.dir().join("provision.log");
    let mut provision = w
        .command()
        .args(["--selftest=provision", "-vmid", "162", "--json"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("provision");
    let deadline = Instant::now() + Duration::from_secs(60);
    while rootfs_file(&w, 162, "/root/bootstrap-started").is_none() {
        if let Ok(Some(status)) = provision.try_wait() {
            panic!(
                "the provision ended ({status}) before its bootstrap ran:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "the bootstrap never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let txn = std::fs::read_dir(w.state_dir().join("journal"))
        .expect("journal")
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".log"))
                .map(str::to_string)
        })
        .next()
        .expect("the provision's journal file");
    let r = h.call(&exec_request(
        162,
        &txn,
        &["/bin/sh", "-c", "echo during-bootstrap"],
    ));
    assert!(
        matches!(provision.try_wait(), Ok(None)),
        "the provision ended before the helper answered"
    );
    let stdout = r["exec"]["stdout"].as_str().unwrap_or("");
    assert_eq!(
        r["exec"]["exit"],
        json!({"exited": 0}),
        "{r:#}\n{}",
        h.log_text()
    );
    assert_eq!(stdout, b64(b"during-bootstrap\n"), "{r:#}");
    let step = w.journal_txn(&txn)["step"].clone();
    assert!(
        step == "bootstrap" || step == "prove_launch",
        "journaled step while the bootstrap ran: {step}"
    );

    // The provision ends, destroys its test guest: the claim is gone with it.
    let status = provision.wait().expect("wait");
    assert_eq!(
        status.code(),
        Some(0),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let before = h.pct_calls_for(162);
    let r = h.call(&exec_request(162, &txn, &["/bin/true"]));
    assert_eq!(code(&r), "exec_not_owned", "{r:#}");
    assert_eq!(h.pct_calls_for(162), before);
}

/// Wait until no process holds the name of `vmid`'s LXC command socket (panics after
/// `within`).
fn wait_until_name_is_free(lxc: &Path, vmid: u32, within: Duration) {
    use felhom_agent::guest::lxc_monitor::{check_monitor, Monitor};
    let deadline = Instant::now() + within;
    while check_monitor(lxc, vmid) != Monitor::Absent {
        assert!(
            Instant::now() < deadline,
            "the monitor of {vmid} never let go of its name"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How many times the bed's `pct exec` ran for `vmid`, whoever started it.
fn bed_execs(w: &World, vmid: u32) -> usize {
    let vmid = vmid.to_string();
    w.bed
        .pct_calls()
        .iter()
        .filter(|c| c.sub == "exec" && c.vmid == vmid)
        .count()
}

/// Uid 65534 binds the freed name of `vmid`'s command socket; the helper refuses an exec of
/// transaction `txn` into it (`exec_monitor_untrusted`, naming the vmid and the squatter's uid)
/// without starting `pct`. The squatter (it holds the name until dropped), and the bed's
/// `pct exec` count for `vmid` at the squat.
fn squat_and_see_the_helper_refuse(
    w: &World,
    h: &Helper,
    txn: &str,
    vmid: u32,
) -> (felhom_tests::guestbed::Squatter, usize) {
    let squatter = felhom_tests::guestbed::Squatter::bind(&w.bed.lxc_path(), vmid, 65534);
    let (helper_before, bed_before) = (h.pct_calls_for(vmid), bed_execs(w, vmid));
    let r = h.call(&exec_request(
        vmid,
        txn,
        &["/bin/sh", "-c", ": > /root/squatted"],
    ));
    assert_eq!(
        code(&r),
        "exec_monitor_untrusted",
        "{r:#}\n{}",
        h.log_text()
    );
    let msg = r["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(&vmid.to_string()) && msg.contains("uid 65534"),
        "{msg}"
    );
    assert_eq!(h.pct_calls_for(vmid), helper_before, "{:#?}", h.pct_calls());
    (squatter, bed_before)
}

/// The squatted provision of `vmid` ends (within 120 s) and fails, no `pct exec` ran for `vmid`
/// since the squat (`bed_before` of them before it), and the squatter's file is nowhere in the
/// container.
fn assert_the_provision_fails_without_pct_exec(
    w: &World,
    provision: &mut Child,
    vmid: u32,
    bed_before: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Ok(Some(status)) = provision.try_wait() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the provision of {vmid} never ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_ne!(
        status.code(),
        Some(0),
        "the provision of {vmid} passed with a squatted socket"
    );
    assert_eq!(
        bed_execs(w, vmid),
        bed_before,
        "pct exec ran for {vmid} after the squat: {:#?}",
        w.bed.pct_calls()
    );
    assert!(rootfs_file(w, vmid, "/root/squatted").is_none());
}

/// The squat against the helper: an open provision of 163 is in its bootstrap (the helper runs
/// its commands); then the container's LXC monitor ends while `pct` still takes the container
/// for running, and uid 65534 binds `@<lxcpath>/163/command` with the monitor's very command
/// line. The helper refuses (`exec_monitor_untrusted`) and no `pct` is started for 163 by
/// anyone from then on; the agent's own next `pct exec` (it runs as root here) is refused the
/// same way, so the provision fails instead of entering what the squatter names.
#[test]
fn a_command_socket_not_held_by_roots_lxc_monitor_makes_the_helper_refuse_and_pct_never_run() {
    use felhom_agent::guest::lxc_monitor::{check_monitor, Monitor};
    let w = world();
    let h = Helper::start(&w, "");
    let (mut provision, txn) = provision_in_bootstrap(&w, 163);
    let r = h.call(&exec_request(163, &txn, &["/bin/sh", "-c", "echo ok"]));
    assert_eq!(
        r["exec"]["exit"],
        json!({"exited": 0}),
        "{r:#}\n{}",
        h.log_text()
    );

    // The monitor (the fake's stand-in, root's) lets go of the name while the container's init
    // and the paused bootstrap in it live on (SIGUSR1; a monitor that ended would take the
    // container, and the bootstrap, with it): the name is free.
    let lxc = w.bed.lxc_path();
    let Monitor::Trusted(pid) = check_monitor(&lxc, 163) else {
        panic!("163 has no trusted monitor: {:?}", check_monitor(&lxc, 163));
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
        nix::sys::signal::Signal::SIGUSR1,
    )
    .expect("signal the monitor");
    wait_until_name_is_free(&lxc, 163, Duration::from_secs(10));
    let (_squatter, bed_before) = squat_and_see_the_helper_refuse(&w, &h, &txn, 163);

    // The bootstrap is released: the agent's next exec into 163 meets the squatter too.
    std::fs::write(w.bed.guest_path(163, "/root/release"), b"").expect("release");
    assert_the_provision_fails_without_pct_exec(&w, &mut provision, 163, bed_before);
}

/// The squat on real guests: container 164 is a real LXC container of the bed (Debian with
/// systemd), its monitor the real `lxc-start -P <lxcpath> -F -n 164`, and `pct exec` is the real
/// `lxc-attach`. The helper trusts that monitor and runs a command inside (its PID 1 is
/// systemd); once the container is stopped through LXC, uid 65534 binds its command socket's
/// name, and the helper refuses (`exec_monitor_untrusted`) without starting `pct`, so the real
/// `lxc-attach` never meets the squatter.
#[test]
fn the_real_lxc_monitor_is_trusted_and_a_squatter_on_a_stopped_containers_name_is_refused() {
    use felhom_agent::guest::lxc_monitor::{check_monitor, Monitor};
    let opts = felhom_tests::fakepve::AgentOptions {
        exec_helper: false,
        ..felhom_tests::fakepve::AgentOptions::default()
    };
    let Some(w) = World::real_or_skip(felhom_tests::verdict::static_debian_backup(), &opts) else {
        return;
    };
    let h = Helper::start(&w, "");
    let (mut provision, txn) = provision_in_bootstrap(&w, 164);
    let lxc = w.bed.lxc_path();
    let Monitor::Trusted(pid) = check_monitor(&lxc, 164) else {
        panic!("164 has no trusted monitor: {:?}", check_monitor(&lxc, 164));
    };
    // LXC's own program holds the name (not the bed's stand-in, a perl script).
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
    assert!(exe.ends_with("lxc-start"), "{exe:?}");
    let r = h.call(&exec_request(
        164,
        &txn,
        &["/bin/sh", "-c", "echo in-guest; cat /proc/1/comm"],
    ));
    assert_eq!(
        r["exec"]["exit"],
        json!({"exited": 0}),
        "{r:#}\n{}",
        h.log_text()
    );
    assert_eq!(
        r["exec"]["stdout"].as_str().unwrap_or(""),
        b64(b"in-guest\nsystemd\n"),
        "{r:#}"
    );

    // The container stops (through LXC): its monitor ends, the name is free. The provision is
    // held still meanwhile (SIGSTOP), so its transaction stays in its bootstrap while the
    // bootstrap's command dies with the container.
    let agent = nix::unistd::Pid::from_raw(i32::try_from(provision.id()).expect("pid"));
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let stopped = Command::new("lxc-stop")
        .arg("-P")
        .arg(&lxc)
        .args(["-n", "164", "--kill"])
        .status()
        .expect("lxc-stop");
    assert!(stopped.success());
    wait_until_name_is_free(&lxc, 164, Duration::from_secs(20));
    let (_squatter, bed_before) = squat_and_see_the_helper_refuse(&w, &h, &txn, 164);
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");

    // The provision's bootstrap died with its container: the provision fails, and no `pct exec`
    // (so no lxc-attach) ran for 164 after the squat.
    assert_the_provision_fails_without_pct_exec(&w, &mut provision, 164, bed_before);
}

/// `exec-helper --socket` binds only in a folder of root's that nobody else can write: a folder
/// of uid 65534's, one that others may write (even with the sticky bit, as /tmp) and a link to
/// a good folder are refused (exit 6, the folder named), and no socket is left anywhere. In a
/// good folder the socket arrives with mode 0660, nothing else is left beside it, and a stale
/// socket at the name is replaced.
#[test]
fn exec_helper_socket_in_a_folder_others_can_write_is_refused() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let w = world();
    let base = tempfile::Builder::new()
        .prefix("felhom-sockdir-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let entries = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    };
    // Start the helper on `<dir>/exec.sock`: its exit status, stderr and, if it listened, the
    // socket's mode and the folder's entries then.
    let run = |dir: &Path| {
        let socket = dir.join("exec.sock");
        let mut child = agent_command(&w.files.config_path)
            .args(["exec-helper", "--socket"])
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the helper");
        // A refusal ends the helper at once; a helper that binds is stopped once it listens.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = None;
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if UnixStream::connect(&socket).is_ok() {
                let meta = std::fs::symlink_metadata(&socket).expect("socket");
                assert!(meta.file_type().is_socket());
                seen = Some((meta.mode() & 0o7777, entries(dir)));
                // Killed: it leaves its socket behind, stale, for the next run.
                let _ = child.kill();
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the helper neither bound nor ended"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().expect("wait");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
            seen,
        )
    };
    // Owned by uid 65534.
    let theirs = base.path().join("theirs");
    std::fs::create_dir(&theirs).expect("mkdir");
    nix::unistd::chown(&theirs, Some(65534.into()), Some(65534.into())).expect("chown");
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // Root's, but everyone may write (with the sticky bit, as /tmp).
    let shared = base.path().join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    // Root's, group-writable.
    let group = base.path().join("group");
    std::fs::create_dir(&group).expect("mkdir");
    std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o775)).expect("chmod");
    // A good folder, and a link to it.
    let good = base.path().join("good");
    std::fs::create_dir(&good).expect("mkdir");
    std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let link = base.path().join("link");
    std::os::unix::fs::symlink(&good, &link).expect("symlink");

    for dir in [&theirs, &shared, &group, &link] {
        let (code, stderr, seen) = run(dir);
        assert_eq!(code, Some(6), "{}: {stderr}", dir.display());
        assert!(seen.is_none(), "{}: it listened", dir.display());
        assert!(
            stderr.contains(&dir.display().to_string()) && stderr.contains("config_invalid"),
            "{}: {stderr}",
            dir.display()
        );
        assert!(
            entries(dir).is_empty(),
            "{}: {:?}",
            dir.display(),
            entries(dir)
        );
    }
    assert!(entries(&good).is_empty(), "{:?}", entries(&good));

    // The good folder: bound with mode 0660 and nothing else beside it; again over the stale
    // socket the killed helper left at the name.
    let (_, stderr, seen) = run(&good);
    assert_eq!(
        seen,
        Some((0o660, vec!["exec.sock".to_string()])),
        "{stderr}"
    );
    assert!(
        std::fs::symlink_metadata(good.join("exec.sock")).is_ok_and(|m| m.file_type().is_socket())
    );
    let (_, stderr, seen) = run(&good);
    assert_eq!(
        seen,
        Some((0o660, vec!["exec.sock".to_string()])),
        "{stderr}"
    );
}

/// Start `exec-helper --socket <socket>` for `w` and wait until it listens; `Err`: its exit
/// status and stderr when it ended instead.
fn helper_on(w: &World, socket: &Path) -> Result<Child, (Option<i32>, String)> {
    let mut child = agent_command(&w.files.config_path)
        .args(["exec-helper", "--socket"])
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the helper");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            let out = child.wait_with_output().expect("wait");
            return Err((
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            ));
        }
        if let Ok(mut s) = UnixStream::connect(socket) {
            // Answered: its serving loop runs (SIGTERM is handled from there on).
            s.set_read_timeout(Some(Duration::from_secs(20)))
                .expect("timeout");
            let _ = s.write_all(&frame(b"{}"));
            let mut len = [0u8; 4];
            s.read_exact(&mut len)
                .expect("an answer to a malformed request");
            return Ok(child);
        }
        assert!(
            Instant::now() < deadline,
            "the helper neither bound nor ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every folder on the way to `--socket`'s folder counts, not only the last: a root folder
/// that others may write (no sticky bit) or a folder of uid 65534's above a good folder of
/// root's is refused (exit 6, that folder named), and nothing is bound; /tmp (root's, sticky)
/// above is fine.
#[test]
fn exec_helper_socket_below_a_folder_others_can_write_is_refused() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let w = world();
    let base = tempfile::Builder::new()
        .prefix("felhom-sockpath-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    assert_eq!(
        base.path().metadata().expect("base").uid(),
        0,
        "run as root"
    );
    let mkdir = |p: &Path, mode: u32| {
        std::fs::DirBuilder::new()
            .mode(mode)
            .create(p)
            .expect("mkdir");
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    // Root's but writable by everyone, no sticky bit: whoever can write there can rename
    // `good` away and put a folder of their own at its name.
    let open = base.path().join("open");
    mkdir(&open, 0o777);
    mkdir(&open.join("good"), 0o755);
    // A folder of uid 65534 above a good folder of root's.
    let theirs = base.path().join("theirs");
    mkdir(&theirs, 0o755);
    nix::unistd::chown(&theirs, Some(65534.into()), Some(65534.into())).expect("chown");
    mkdir(&theirs.join("good"), 0o755);
    for (above, dir) in [(&open, open.join("good")), (&theirs, theirs.join("good"))] {
        let socket = dir.join("exec.sock");
        match helper_on(&w, &socket) {
            Ok(mut child) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the helper bound {} below {}",
                    socket.display(),
                    above.display()
                );
            }
            Err((code, stderr)) => {
                assert_eq!(code, Some(6), "{stderr}");
                assert!(
                    stderr.contains(&format!("goes through {}", above.display()))
                        && stderr.contains("config_invalid"),
                    "{}: {stderr}",
                    above.display()
                );
            }
        }
        assert!(
            std::fs::read_dir(&dir).expect("dir").next().is_none(),
            "something was left in {}",
            dir.display()
        );
    }
    // The same chain with the folders root's and closed binds (the base lives in /tmp: root's,
    // sticky).
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut child = helper_on(&w, &open.join("good/exec.sock")).expect("binds below /tmp");
    let _ = child.kill();
    let _ = child.wait();
}

/// At SIGTERM the helper removes the socket it bound, and only that one: a socket that root
/// put at the name meanwhile (another helper's) stays.
#[test]
fn exec_helper_removes_at_exit_only_the_socket_it_bound() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let w = world();
    let dir = tempfile::Builder::new()
        .prefix("felhom-sockexit-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let socket = dir.path().join("exec.sock");
    let term = |child: Child| {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid")),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("SIGTERM");
        let out = child.wait_with_output().expect("wait");
        assert_eq!(out.status.code(), Some(0), "{out:?}");
    };
    // Its own socket goes at SIGTERM.
    let child = helper_on(&w, &socket).expect("binds");
    term(child);
    assert!(
        std::fs::symlink_metadata(&socket).is_err(),
        "the helper left its socket"
    );
    // Replaced meanwhile: the new socket stays.
    let child = helper_on(&w, &socket).expect("binds");
    let other = dir.path().join("other.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&other).expect("bind");
    std::fs::rename(&other, &socket).expect("rename over");
    let ino = std::fs::symlink_metadata(&socket).expect("socket").ino();
    term(child);
    let left = std::fs::symlink_metadata(&socket).expect("the replacement was removed");
    assert!(left.file_type().is_socket());
    assert_eq!(left.ino(), ino, "not the replacement");
}

/// How many descriptors process `pid` holds.
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// A guest command that leaves a process behind holding its stdout and stderr (it escaped the
/// exec's process group and PID namespace, as a real `lxc-attach` allows): after the drain
/// grace the helper's readers are aborted, so over 20 such execs the helper's descriptors
/// (`/proc/<helper>/fd`) come back to their baseline instead of growing by two per exec.
#[test]
fn a_guest_holding_its_pipes_open_over_20_execs_leaves_the_helpers_descriptors_at_baseline() {
    use felhom_tests::guestbed::{kill_processes_with_marker, unique_marker, PctFault};
    let w = world();
    let h = Helper::start(&w, "");
    let (mut provision, txn) = provision_in_bootstrap(&w, 164);
    w.bed.add_fault(164, PctFault::ExecEscape);
    let marker = unique_marker("pipes");
    let hold = format!("sh -c 'while :; do sleep 1; done' {marker} & echo started");
    let helper_pid = h.child.id();
    // One plain exec first: whatever the helper opens once (its runtime) is open by then.
    let r = h.call(&exec_request(164, &txn, &["/bin/true"]));
    assert_eq!(
        r["exec"]["exit"],
        json!({"exited": 0}),
        "{r:#}\n{}",
        h.log_text()
    );
    let baseline = fd_count(helper_pid);
    assert!(baseline > 0);
    // Four connections at once, five execs each: each exec waits out the drain grace (its
    // guest process keeps the pipes), and the helper serves them side by side.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..5 {
                    let r = h.call(&exec_request(164, &txn, &["/bin/sh", "-c", &hold]));
                    assert_eq!(
                        r["exec"]["exit"],
                        json!({"exited": 0}),
                        "{r:#}\n{}",
                        h.log_text()
                    );
                    assert_eq!(r["exec"]["stdout"], json!(b64(b"started\n")), "{r:#}");
                }
            });
        }
    });
    // The holders are still there, holding their ends.
    let holders = felhom_tests::guestbed::processes_with_marker(&marker);
    assert!(holders.len() >= 20, "{holders:#?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut now = fd_count(helper_pid);
    while now > baseline {
        if Instant::now() >= deadline {
            kill_processes_with_marker(&marker);
            panic!("the helper holds {now} descriptors after 20 execs whose guest processes keep their pipes, {baseline} before");
        }
        std::thread::sleep(Duration::from_millis(100));
        now = fd_count(helper_pid);
    }
    kill_processes_with_marker(&marker);
    std::fs::write(w.bed.guest_path(164, "/root/release"), b"").expect("release");
    let _ = provision.kill();
    let _ = provision.wait();
}

/// `MemoryMax=` of the packaged helper unit, in bytes.
fn unit_memory_max() -> u64 {
    let unit = felhom_tests::guestbed::repo_root().join("systemd/felhom-agent-exec.service");
    let text = std::fs::read_to_string(&unit).expect("the helper's unit");
    let value = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("MemoryMax="))
        .unwrap_or_else(|| panic!("{} sets no MemoryMax=", unit.display()))
        .trim()
        .to_string();
    let (digits, unit_mult) = match value.chars().last() {
        Some('K') => (&value[..value.len() - 1], 1u64 << 10),
        Some('M') => (&value[..value.len() - 1], 1 << 20),
        Some('G') => (&value[..value.len() - 1], 1 << 30),
        _ => (value.as_str(), 1),
    };
    digits.parse::<u64>().expect("MemoryMax= value") * unit_mult
}

/// The helper's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM")
        * 1024
}

/// Every connection the helper serves at once carries a request at the size limits (16 MiB of
/// stdin, the largest frame) and gets an answer at the output caps (8 MiB on stdout and on
/// stderr): the helper's peak resident memory stays inside the `MemoryMax=` of its unit.
#[test]
fn the_helper_at_its_size_limits_on_every_connection_stays_inside_its_memory_max() {
    use felhom_agent::exec_helper::proto::{MAX_BLOB_BYTES, MAX_OUTPUT_CAP, MAX_REQUEST_FRAME};
    use felhom_agent::exec_helper::server::MAX_CONNECTIONS;
    let w = world();
    let h = Helper::start(&w, "");
    let (mut provision, txn) = provision_in_bootstrap(&w, 165);
    let out = MAX_OUTPUT_CAP + 4096;
    let script = format!("cat > /dev/null; head -c {out} /dev/zero; head -c {out} /dev/zero >&2");
    let mut req = exec_request(165, &txn, &["/bin/sh", "-c", &script]);
    req["stdin"] = json!(b64(&vec![b'x'; MAX_BLOB_BYTES]));
    req["output_cap"] = json!(MAX_OUTPUT_CAP);
    req["timeout_ms"] = json!(600_000);
    let body = serde_json::to_vec(&req).expect("json");
    assert!(body.len() <= MAX_REQUEST_FRAME as usize, "{}", body.len());
    let framed = std::sync::Arc::new(frame(&body));
    drop(body);
    let socket = h.socket.clone();
    let threads: Vec<_> = (0..MAX_CONNECTIONS)
        .map(|_| {
            let framed = framed.clone();
            let socket = socket.clone();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&socket).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(600)))
                    .expect("timeout");
                s.write_all(&framed).expect("send");
                let mut len = [0u8; 4];
                s.read_exact(&mut len).expect("answer length");
                let mut answer = vec![0u8; u32::from_be_bytes(len) as usize];
                s.read_exact(&mut answer).expect("answer");
                let v: Value = serde_json::from_slice(&answer).expect("answer JSON");
                (
                    v["exec"]["exit"].clone(),
                    v["exec"]["stdout_truncated"].clone(),
                    v["error"].clone(),
                )
            })
        })
        .collect();
    for t in threads {
        let (exit, _, error) = t.join().expect("thread");
        assert_eq!(
            exit,
            json!({"exited": 0}),
            "error: {error:#}\n{}",
            h.log_text()
        );
    }
    let peak = peak_rss(h.child.id());
    let max = unit_memory_max();
    eprintln!(
        "helper peak RSS with {MAX_CONNECTIONS} requests at the limits: {} MiB (MemoryMax {} MiB)",
        peak >> 20,
        max >> 20
    );
    assert!(
        peak <= max,
        "the helper peaked at {} MiB with {MAX_CONNECTIONS} requests at the size limits, above its unit's MemoryMax of {} MiB",
        peak >> 20,
        max >> 20
    );
    std::fs::write(w.bed.guest_path(165, "/root/release"), b"").expect("release");
    let _ = provision.kill();
    let _ = provision.wait();
}

/// Config `text` with `vmlist_path` set to `vmlist`.
fn with_vmlist(text: &str, vmlist: &Path) -> String {
    with_path(text, "vmlist_path", vmlist)
}

/// Config `text` with the top-level `key` set to `path`.
fn with_path(text: &str, key: &str, path: &Path) -> String {
    let prefix = format!("{key} = ");
    text.lines()
        .map(|l| {
            if l.starts_with(&prefix) {
                format!("{prefix}{}", toml_string(&path.display().to_string()))
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The world's agent config, reaching containers and `.vmlist` through the helper at
/// `socket` (`vmlist`: its own `vmlist_path` instead of the fake's), with `extra` appended.
fn agent_config_through(w: &World, socket: &Path, vmlist: Option<&Path>, extra: &str) -> PathBuf {
    let mut text = w.files.config_text();
    if let Some(vmlist) = vmlist {
        text = with_vmlist(&text, vmlist);
    }
    text.push('\n');
    assert!(text.contains("[exec]\n"), "{text}");
    let text = text.replacen(
        "[exec]\n",
        &format!(
            "[exec]\nhelper_socket = {}\n",
            toml_string(&socket.display().to_string())
        ),
        1,
    );
    let path = w.files.dir().join("agent-through-helper.toml");
    std::fs::write(&path, format!("{text}\n{extra}\n")).expect("agent config");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    path
}

fn read_vmlist_request() -> Value {
    json!({"v": 1, "op": "read", "file": "vmlist"})
}

/// `.vmlist` through the real helper: a caller gets the bytes of the file the helper's own
/// config names, read afresh for each request, and nothing when that path is, or becomes,
/// something anyone but root could have placed: a link at the file or on the way, a folder
/// others may write, a file over the limit; a missing file is answered as missing; a file
/// outside its closed set (a key, a path) is refused unread. What the
/// helper hands over is still hostile to the agent: a list that is not one is refused, never
/// used, although the agent's own direct read would have found a valid one.
#[test]
fn the_helper_hands_over_the_vmlist_only_from_a_path_nobody_else_can_change() {
    let w = world();
    let live = std::fs::read(w.pve.vmlist_path()).expect("the fake's .vmlist");
    let root = tempfile::Builder::new()
        .prefix("felhom-pmxcfs-")
        .tempdir()
        .expect("tmp");
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let pve = root.path().join("pve");
    std::fs::create_dir(&pve).expect("mkdir");
    std::fs::set_permissions(&pve, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let vmlist = pve.join(".vmlist");
    let put = |bytes: &[u8]| {
        let tmp = pve.join(".vmlist.new");
        std::fs::write(&tmp, bytes).expect("write");
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o440)).expect("chmod");
        std::fs::rename(&tmp, &vmlist).expect("rename");
    };
    put(&live);
    let h = Helper::reading(&w, "", &vmlist);

    let r = h.call(&read_vmlist_request());
    assert_eq!(r["file"]["name"], "vmlist", "{r:#}");
    assert_eq!(r["file"]["data"], json!(b64(&live)), "{r:#}");

    // The file replaced by a link to a copy of itself.
    let copy = root.path().join("copy");
    std::fs::write(&copy, &live).expect("copy");
    std::os::unix::fs::symlink(&copy, pve.join(".vmlist.link")).expect("symlink");
    std::fs::rename(pve.join(".vmlist.link"), &vmlist).expect("swap in the link");
    let r = h.call(&read_vmlist_request());
    assert_eq!(code(&r), "config_invalid", "{r:#}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("symbolic link"),
        "{r:#}"
    );
    put(&live);
    assert!(h.call(&read_vmlist_request())["file"].is_object());

    // Its folder writable by others: whoever may write there could swap the file.
    std::fs::set_permissions(&pve, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let r = h.call(&read_vmlist_request());
    assert_eq!(code(&r), "config_invalid", "{r:#}");
    assert!(
        r["error"]["message"].as_str().unwrap_or("").contains("777"),
        "{r:#}"
    );
    std::fs::set_permissions(&pve, std::fs::Permissions::from_mode(0o755)).expect("chmod");

    // The folder replaced by a link to another folder holding a valid list.
    let elsewhere = root.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).expect("mkdir");
    std::fs::write(elsewhere.join(".vmlist"), &live).expect("write");
    let moved = root.path().join("pve.real");
    std::fs::rename(&pve, &moved).expect("move the folder away");
    std::os::unix::fs::symlink(&elsewhere, &pve).expect("symlink");
    let r = h.call(&read_vmlist_request());
    assert_eq!(code(&r), "config_invalid", "{r:#}");
    std::fs::remove_file(&pve).expect("rm link");
    std::fs::rename(&moved, &pve).expect("move back");

    // Over the limit (16 MiB): refused, not cut.
    put(&vec![b' '; 16 * 1024 * 1024 + 1]);
    let r = h.call(&read_vmlist_request());
    assert_eq!(code(&r), "config_invalid", "{r:#}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("larger than"),
        "{r:#}"
    );

    // Missing: said so (the agent then reads it itself, else asks `pct list`).
    std::fs::remove_file(&vmlist).expect("rm");
    let r = h.call(&read_vmlist_request());
    assert_eq!(r["file"]["name"], "vmlist", "{r:#}");
    assert!(r["file"]["data"].is_null(), "{r:#}");

    // Only the closed set of files, never a path or a key a caller names.
    for file in [
        "nodes/pve1/pve-ssl.key",
        "priv/token.cfg",
        "/etc/shadow",
        "../.vmlist",
    ] {
        let r = h.call(&json!({"v": 1, "op": "read", "file": file}));
        assert_eq!(code(&r), "exec_request_invalid", "{file}: {r:#}");
    }
    // Of user.cfg only the token, group, role and ACL lines (tests/data/pve-secrets-facts.md §2).
    let r = h.call(&json!({"v": 1, "op": "read", "file": "user.cfg"}));
    let user_cfg = std::fs::read_to_string(w.pve.dir().join("user.cfg")).expect("user.cfg");
    assert!(
        user_cfg.lines().any(|l| l.starts_with("user:")),
        "{user_cfg}"
    );
    let needed: String = user_cfg
        .split_inclusive('\n')
        .filter(|l| {
            ["token:", "group:", "role:", "acl:"]
                .iter()
                .any(|t| l.starts_with(t))
        })
        .collect();
    assert!(needed.contains("acl:"), "{user_cfg}");
    assert_eq!(r["file"]["data"], json!(b64(needed.as_bytes())), "{r:#}");

    // Hostile bytes are handed over as they are; the agent refuses them as a guest list.
    let hostile = b"{\"version\": 1, \"ids\": {\"160\": {\"node\": \"pve1\", \"type\": \"lxc\"}, \"160\": {\"node\": \"\x1b[2J\", \"type\": \"qemu\"}}}";
    put(hostile);
    let r = h.call(&read_vmlist_request());
    assert_eq!(r["file"]["data"], json!(b64(hostile)), "{r:#}");
    let config = agent_config_through(&w, &h.socket, None, "");
    let run = felhom_tests::agent::run_agent(&config, &["guests", "--json"]);
    assert_eq!(run.code, Some(6), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    assert_eq!(doc["error"]["code"], "config_invalid", "{doc:#}");
    let message = doc["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&w.files.vmlist_path.display().to_string())
            && message.contains("is not a valid guest list"),
        "{message}"
    );
    assert!(!run.stdout.contains('\x1b') && !run.stderr.contains('\x1b'));
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    // Nothing of this ran `pct`.
    assert!(h.pct_calls().is_empty(), "{:?}", h.pct_calls());
    let log = h.log_text();
    assert!(log.contains("refused to hand over"), "{log}");
}

/// Of `user.cfg` and `datacenter.cfg` the real helper hands the agent's user only the lines the
/// agent reads (tests/data/pve-secrets-facts.md): never a `user:` line (whose keys field may
/// hold a base32 OATH secret), never `http_proxy` (which may hold a password) nor the
/// cluster's description; and the secrets are not in its log either. The agent's readers
/// still find what they need in the answer: doctor's tag policy through the helper.
#[test]
fn the_helper_hands_over_no_user_line_of_user_cfg_and_no_proxy_password_of_datacenter_cfg() {
    let w = world();
    let root = tempfile::Builder::new()
        .prefix("felhom-pmxcfs-")
        .tempdir()
        .expect("tmp");
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let user_cfg = root.path().join("user.cfg");
    let users = "user:root@pam:1:0:::root@example.invalid:::\n\
        user:alice@pve:1:0:Alice:Smith:alice@example.invalid::MARKERSECRETOATHKEY234567:\n\
        token:alice@pve!ci:0:1::\n\
        \n\
        group:ops:alice@pve::\n\
        \n\
        pool:felhom:MARKER-POOL-COMMENT:100,101:local-lvm:\n\
        \n\
        role:felhom-audit:VM.Audit:\n\
        \n\
        acl:1:/pool/felhom:alice@pve!ci:PVEVMAdmin:\n";
    std::fs::write(&user_cfg, users).expect("user.cfg");
    std::fs::set_permissions(&user_cfg, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    let datacenter = root.path().join("datacenter.cfg");
    let dc = "#MARKER-DESCRIPTION\n\
        keyboard: en-us\n\
        http_proxy: http://proxyuser:MARKER-PROXY-PASSWORD@proxy.example.invalid:3128/\n\
        next-id: lower=10000,upper=990000\n\
        user-tag-access: user-allow=none\n\
        email_from: MARKER@example.invalid\n";
    std::fs::write(&datacenter, dc).expect("datacenter.cfg");
    std::fs::set_permissions(&datacenter, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    let text = with_path(&w.files.config_text(), "datacenter_cfg", &datacenter);
    std::fs::write(&w.files.config_path, format!("{text}\n")).expect("config");
    let h = Helper::with_user_cfg(&w, "", &user_cfg);

    let r = h.call(&json!({"v": 1, "op": "read", "file": "user.cfg"}));
    assert_eq!(r["file"]["name"], "user.cfg", "{r:#}");
    assert_eq!(
        r["file"]["data"],
        json!(b64(b"token:alice@pve!ci:0:1::\n\
            group:ops:alice@pve::\n\
            role:felhom-audit:VM.Audit:\n\
            acl:1:/pool/felhom:alice@pve!ci:PVEVMAdmin:\n")),
        "{r:#}"
    );
    let r = h.call(&json!({"v": 1, "op": "read", "file": "datacenter.cfg"}));
    assert_eq!(r["file"]["name"], "datacenter.cfg", "{r:#}");
    assert_eq!(
        r["file"]["data"],
        json!(b64(
            b"next-id: lower=10000,upper=990000\nuser-tag-access: user-allow=none\n"
        )),
        "{r:#}"
    );
    let log = h.log_text();
    assert!(
        log.lines()
            .filter(|l| l.contains("only the lines the agent reads"))
            .count()
            >= 2,
        "{log}"
    );
    assert!(
        !log.contains("MARKER") && !log.contains("proxyuser"),
        "{log}"
    );

    // The agent's readers find what they need in the cut: doctor's tag policy, through the
    // helper (the agent's own config names the same datacenter.cfg).
    let config = agent_config_through(&w, &h.socket, None, "");
    let run = felhom_tests::agent::run_agent(&config, &["doctor", "--json"]);
    assert!(!run.stdout.contains("MARKER") && !run.stderr.contains("MARKER"));
    let doc = run.json();
    let tags = doc["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "tag_policy"))
        .cloned()
        .unwrap_or_else(|| panic!("no tag_policy check: {doc:#}"));
    assert_eq!(tags["status"], "fail", "{tags:#}");
    assert!(
        tags["message"]
            .as_str()
            .unwrap_or("")
            .contains("user-allow=none"),
        "{tags:#}"
    );
}

/// The agent as its own user (`daemon`, uid 1, standing for felhom-agent), in no group that
/// reads the fake's `.vmlist`: `guests` has the full list all the same, handed over by the
/// real helper over its socket, and says so; the helper logged the hand-over for that uid.
/// `datacenter.cfg` (the preflight's tag policy) comes the same way. Without the helper, the
/// same command falls back to reading the file itself, cannot, and asks the local commands
/// (which the test bed's agent user cannot run): it fails naming both.
#[test]
fn the_agent_reads_the_guest_list_through_the_helper_as_a_user_that_cannot_read_it() {
    let w = world();
    // The fake's list, copied where only root may look (as pmxcfs's /etc/pve is for a user
    // outside www-data); the agent and the helper both name the copy.
    let private = tempfile::Builder::new()
        .prefix("felhom-pmxcfs-")
        .tempdir()
        .expect("tmp");
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700))
        .expect("chmod");
    let vmlist = private.path().join(".vmlist");
    std::fs::copy(w.pve.vmlist_path(), &vmlist).expect("copy");
    std::fs::set_permissions(&vmlist, std::fs::Permissions::from_mode(0o440)).expect("chmod");
    let direct = Command::new("cat")
        .arg(&vmlist)
        .uid(1)
        .gid(1)
        .output()
        .expect("cat");
    assert!(
        !direct.status.success(),
        "uid 1 can read {} itself: this test would not show the helper's part",
        vmlist.display()
    );
    // The cluster's datacenter.cfg there too, with a tag policy the marker cannot pass.
    let datacenter = private.path().join("datacenter.cfg");
    std::fs::write(&datacenter, "user-tag-access: user-allow=none\n").expect("datacenter.cfg");
    std::fs::set_permissions(&datacenter, std::fs::Permissions::from_mode(0o440)).expect("chmod");
    let text = with_path(&w.files.config_text(), "datacenter_cfg", &datacenter);
    std::fs::write(&w.files.config_path, format!("{text}\n")).expect("config");
    let h = Helper::reading(&w, "[agent]\nuser = \"daemon\"\n", &vmlist);
    let config = agent_config_through(&w, &h.socket, Some(&vmlist), "[agent]\nuser = \"daemon\"\n");
    nix::unistd::chown(
        &w.files.state_dir,
        Some(nix::unistd::Uid::from_raw(1)),
        Some(nix::unistd::Gid::from_raw(1)),
    )
    .expect("chown state_dir");
    let run = felhom_tests::agent::run_agent(&config, &["guests", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    assert_eq!(doc["source"], "vmlist", "{doc:#}");
    let described = doc["source_description"].as_str().unwrap_or("");
    assert!(
        described.contains("handed over by the root exec helper")
            && described.contains(&h.socket.display().to_string()),
        "{described}"
    );
    let want = w.pve.vmlist_entries().len();
    assert!(want > 0);
    let rows = doc["guests"].as_array().map_or(0, Vec::len);
    assert!(rows >= want, "{rows} rows for {want} guests: {doc:#}");
    let log = h.log_text();
    let handed = log
        .lines()
        .filter(|l| l.contains("handed over") && l.contains("uid=1"))
        .count();
    assert!(handed >= 1, "{log}");
    // The preflight's tag policy, read the same way: doctor (as the user) judges the private
    // datacenter.cfg it could not open itself.
    let doc = felhom_tests::agent::run_agent(&config, &["doctor", "--json"]).json();
    let tags = doc["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "tag_policy"))
        .cloned()
        .unwrap_or_else(|| panic!("no tag_policy check: {doc:#}"));
    assert_eq!(tags["status"], "fail", "{tags:#}");
    assert!(
        tags["message"]
            .as_str()
            .unwrap_or("")
            .contains("user-allow=none"),
        "{tags:#}"
    );
    assert!(
        h.log_text()
            .lines()
            .any(|l| l.contains("handed over") && l.contains("datacenter.cfg")),
        "{}",
        h.log_text()
    );

    // The helper gone: the agent reads the file itself, which its user cannot.
    drop(h);
    let run = felhom_tests::agent::run_agent(&config, &["guests", "--json"]);
    assert_eq!(run.code, Some(6), "{}\n{}", run.stdout, run.stderr);
    let message = run.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        message.contains("did not hand it over") && message.contains("Permission denied"),
        "{message}"
    );
}
