//! The package under a real systemd: a Debian bookworm machine with systemd 252 (PVE 8's) as
//! PID 1, booted with `systemd-nspawn` (`felhom_tests::nspawn`), gets the built `.deb`
//! installed with dpkg (sysusers, tmpfiles and postinst as on a node), is configured against
//! the bed's fake PVE (and the dev hub), and runs the package's unmodified units:
//!
//! - the daemon reaches READY (`systemctl is-active` says `active`) without and with a hub;
//! - a connection to `felhom-agent-exec.socket` starts the exec helper;
//! - `felhom-restore-test.service` runs, started by its timer;
//! - `felhom-agent-metrics.path` publishes into node_exporter's folder, and keeps publishing
//!   under a metrics write every 200 ms for 20 s, two of systemd's default start-limit windows
//!   (that limit once stopped it for good after 5 s, `unit-start-limit-hit`), with one
//!   publisher throughout;
//! - `doctor`'s reading of `systemctl show` (the syscall filter) holds against what this
//!   systemd prints;
//! - an upgrade over an older install whose user had a home, no expiry and a user manager:
//!   postinst stops the running daemon, confines the user (`usermod -d /nonexistent`, `-e 1`,
//!   `user@<uid>.service` masked) and starts the daemon again as that user.
//!
//! The `.deb` is `$FELHOM_TEST_DEB` (tests/run.sh builds it in its package step), else it is
//! built here with `packaging/build-deb.sh --from-debug` into `target/debian-test/` (that
//! build puts a binary without test hooks at `target/debug/felhom-agent` for a moment: run
//! no other end-to-end test beside this one then).
//! A machine where the real systemd cannot boot reports why in one line; with
//! `FELHOM_REQUIRE_REAL_SYSTEMD=1` (tests/run.sh) that fails the test.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use felhom_tests::devhub::{DevHub, DevHubOptions};
use felhom_tests::fakepve::{loopback_host, toml_string, workspace_root, FakePve};
use felhom_tests::nspawn::{systemd_root, unavailable, Machine};
use felhom_tests::report;

const WAIT: Duration = Duration::from_secs(60);

/// The package to install: `$FELHOM_TEST_DEB`, else built (once per run, under a lock) into
/// `target/debian-test/`.
fn package_deb() -> PathBuf {
    if let Some(p) = std::env::var_os("FELHOM_TEST_DEB") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "FELHOM_TEST_DEB={} is not a file", p.display());
        return p;
    }
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let out = target.join("debian-test");
    std::fs::create_dir_all(&out).expect("mkdir target/debian-test");
    let built = Command::new("flock")
        .arg(out.join(".lock"))
        .arg(root.join("packaging/build-deb.sh"))
        .args(["--from-debug", "--out"])
        .arg(&out)
        .current_dir(&root)
        .output()
        .expect("run packaging/build-deb.sh");
    assert!(
        built.status.success(),
        "packaging/build-deb.sh --from-debug failed: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&built.stdout).trim())
}

/// A booted machine with the package installed, or `None` (reported) when the real systemd
/// cannot run here.
fn installed_machine(test: &str) -> Option<Machine> {
    let root = match systemd_root() {
        Ok(r) => r,
        Err(why) => {
            unavailable(test, &why);
            return None;
        }
    };
    let deb = package_deb();
    let started = Instant::now();
    let m = match Machine::boot(&root) {
        Ok(m) => m,
        Err(why) => {
            unavailable(test, &format!("systemd-nspawn did not boot systemd: {why}"));
            return None;
        }
    };
    let booted = started.elapsed();
    std::fs::copy(&deb, m.path("/tmp/felhom-agent.deb")).expect("copy the .deb in");
    let out = m.ok("dpkg -i /tmp/felhom-agent.deb 2>&1");
    report(&format!(
        "real systemd: {test}: machine booted in {:.1} s, {} installed in {:.1} s more ({})",
        booted.as_secs_f64(),
        deb.file_name().unwrap_or_default().to_string_lossy(),
        (started.elapsed() - booted).as_secs_f64(),
        m.ok("systemctl --version | head -n 1")
    ));
    assert!(
        out.contains("Setting up felhom-agent"),
        "dpkg -i printed: {out}"
    );
    Some(m)
}

/// `/etc/felhom-agent/agent.toml` and the token files for `pve` (and `hub`), as an operator
/// writes them: secrets root 0600, the config root 0640 (tmpfiles lets the agent's group read
/// it).
fn configure(m: &Machine, pve: &FakePve, hub: Option<&DevHub>) {
    felhom_tests::fakepve::write_vmlist(
        &m.path("/etc/felhom-agent/test-vmlist"),
        &pve.vmlist_entries(),
    );
    m.write(
        "/etc/felhom-agent/pve-token",
        format!("{}\n", pve.token_secret()).as_bytes(),
        0o600,
    );
    let mut text = format!(
        "node = \"pve1\"\npool = {}\nvmlist_path = \"/etc/felhom-agent/test-vmlist\"\n\n\
         [pve]\nurl = {}\ntoken_id = {}\ntoken_secret_file = \"/etc/felhom-agent/pve-token\"\n\
         tls_fingerprint = {}\n\n[provision]\nstorage = \"local-lvm\"\n\n[agent]\nuser = \"felhom-agent\"\n",
        toml_string(&pve.pool()),
        toml_string(pve.url()),
        toml_string(&pve.token_id()),
        toml_string(pve.sha256_hex()),
    );
    if let Some(hub) = hub {
        m.write(
            "/etc/felhom-agent/hub-token",
            format!("{}\n", hub.token()).as_bytes(),
            0o600,
        );
        text.push_str(&format!(
            "\n[hub]\nurl = {}\ntoken_file = \"/etc/felhom-agent/hub-token\"\n",
            toml_string(&hub.url())
        ));
    }
    m.write("/etc/felhom-agent/agent.toml", text.as_bytes(), 0o640);
    m.ok("chgrp felhom-agent /etc/felhom-agent/agent.toml");
}

/// `systemctl is-active UNIT` once it has settled (not activating/deactivating).
/// Settled: no job of the unit is queued (a `restart --no-block` passes through `inactive`
/// between its stop and its start while its job waits) and the state is not a transition.
fn settled_state(m: &Machine, unit: &str) -> String {
    let (state, _) = m.wait_for(
        &format!("{unit} to settle"),
        WAIT,
        |m| {
            let out = m.sh(&format!(
                "systemctl is-active {unit}; systemctl list-jobs --no-legend --no-pager {unit} | wc -l"
            ));
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let mut lines = text.lines().map(str::trim);
            let state = lines.next().unwrap_or("").to_string();
            let jobs = lines.next().unwrap_or("").to_string();
            (state, jobs)
        },
        |(s, jobs)| {
            jobs == "0" && !matches!(s.as_str(), "activating" | "deactivating" | "reloading" | "")
        },
    );
    state
}

fn journal(m: &Machine, unit: &str) -> String {
    String::from_utf8_lossy(
        &m.sh(&format!("journalctl -b --no-pager -o cat -u {unit} 2>&1"))
            .stdout,
    )
    .into_owned()
}

/// What the processes of `unit` logged (not systemd's lines about it).
fn output_of(m: &Machine, unit: &str) -> String {
    String::from_utf8_lossy(
        &m.sh(&format!(
            "journalctl -b -q --no-pager -o cat _SYSTEMD_UNIT={unit} 2>&1"
        ))
        .stdout,
    )
    .into_owned()
}

#[test]
fn the_packaged_units_run_under_a_real_systemd() {
    let Some(m) = installed_machine("the packaged units") else {
        return;
    };
    // What dpkg did as on a node: the user from sysusers, the folders from tmpfiles, the
    // units postinst enabled and started (the daemon only once agent.toml exists).
    let passwd = m.ok("getent passwd felhom-agent");
    assert!(passwd.ends_with(":/usr/sbin/nologin"), "{passwd}");
    assert_eq!(
        m.ok("stat -c '%a %U' /var/lib/felhom-agent /var/lib/felhom-agent-metrics"),
        "700 felhom-agent\n755 felhom-agent"
    );
    for unit in [
        "felhom-agent-exec.socket",
        "felhom-restore-test.timer",
        "felhom-agent-metrics.path",
    ] {
        assert_eq!(settled_state(&m, unit), "active", "{unit} after dpkg -i");
    }
    assert_eq!(
        m.prop("felhom-agent.service", "ConditionResult"),
        "no",
        "postinst started the daemon before it was configured?"
    );

    // The daemon without a hub: READY (Type=notify: active only after READY=1).
    let pve = FakePve::demo();
    configure(&m, &pve, None);
    m.ok("systemctl start --no-block felhom-agent.service");
    let state = settled_state(&m, "felhom-agent.service");
    assert_eq!(
        state,
        "active",
        "felhom-agent.service without a hub: {}",
        journal(&m, "felhom-agent.service")
    );
    assert_eq!(m.prop("felhom-agent.service", "Type"), "notify");
    let status = m.prop("felhom-agent.service", "StatusText");
    report(&format!(
        "real systemd: felhom-agent.service active without a hub; STATUS={status}"
    ));

    // Its metrics reach node_exporter's folder through the path unit.
    let published = m.wait_for(
        "felhom_hub.prom published into node_exporter's folder",
        WAIT,
        |m| {
            std::fs::read_to_string(m.path("/var/lib/prometheus/node-exporter/felhom_hub.prom"))
                .ok()
        },
        Option::is_some,
    );
    assert!(
        published
            .as_deref()
            .is_some_and(|t| t.contains("felhom_hub_connected 0")),
        "{published:?}"
    );
    let meta = std::fs::metadata(m.path("/var/lib/prometheus/node-exporter/felhom_hub.prom"))
        .expect("published copy");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 0);
    // A node without a hub says so (its hub alert stays quiet), and the publisher's status
    // names the file it published.
    assert!(
        published
            .as_deref()
            .is_some_and(|t| t.contains("felhom_hub_configured 0")),
        "{published:?}"
    );
    m.wait_for(
        "the publisher's status names felhom_hub.prom",
        WAIT,
        |m| {
            std::fs::read_to_string(
                m.path("/var/lib/prometheus/node-exporter/felhom_metrics_publish.prom"),
            )
            .unwrap_or_default()
        },
        |t| t.contains("felhom_metrics_published{file=\"felhom_hub.prom\"} 1"),
    );

    // With a hub token: READY again, and the hub sees the session.
    let hub = DevHub::start(DevHubOptions {
        host: loopback_host(std::process::id(), 900),
        ..DevHubOptions::default()
    });
    configure(&m, &pve, Some(&hub));
    m.ok("systemctl restart --no-block felhom-agent.service");
    let state = settled_state(&m, "felhom-agent.service");
    assert_eq!(
        state,
        "active",
        "felhom-agent.service with a hub: {}",
        journal(&m, "felhom-agent.service")
    );
    hub.wait_for("the daemon's hub session", WAIT, |s| s.sessions >= 1);
    m.wait_for(
        "felhom_hub_connected 1 published",
        WAIT,
        |m| {
            std::fs::read_to_string(m.path("/var/lib/prometheus/node-exporter/felhom_hub.prom"))
                .unwrap_or_default()
        },
        |t| t.contains("felhom_hub_connected 1"),
    );

    // The exec helper: not running until a connection to its socket starts it. The daemon's
    // own reads of the cluster files go through it and may have started it already: with the
    // daemon stopped, the helper stopped stays down until the next connection (nothing else
    // starts it). The daemon first: it reads nothing once it stops. But a read it made just
    // before may still wait in the socket's queue, and systemd starts the socket's service
    // for a waiting connection even right after a `systemctl stop` of the service (in one
    // command with the daemon's stop, that start job cancelled the helper's stop: "Job …
    // canceled"; alone, the helper came back and idled). Stopping the socket drops what waits
    // in it; started again, it holds no connection.
    m.ok("systemctl stop felhom-agent.service");
    m.ok("systemctl stop felhom-agent-exec.socket felhom-agent-exec.service");
    m.ok("systemctl start felhom-agent-exec.socket");
    let before = m.wait_for(
        "felhom-agent-exec.service stopped",
        WAIT,
        |m| m.prop("felhom-agent-exec.service", "ActiveState"),
        |v| v == "inactive" || v == "failed",
    );
    let stopped_at = m.prop(
        "felhom-agent-exec.service",
        "ExecMainStartTimestampMonotonic",
    );
    report(&format!(
        "real systemd: felhom-agent-exec.service {before} (last started at monotonic {stopped_at})"
    ));
    let sock = m.path("/run/felhom-agent/exec.sock");
    let conn = std::os::unix::net::UnixStream::connect(&sock)
        .unwrap_or_else(|e| panic!("connect {}: {e}", sock.display()));
    let started = m.wait_for(
        "felhom-agent-exec.service started by its socket",
        WAIT,
        |m| {
            m.prop(
                "felhom-agent-exec.service",
                "ExecMainStartTimestampMonotonic",
            )
        },
        |v| *v != stopped_at && v != "0",
    );
    drop(conn);
    m.ok("systemctl start --no-block felhom-agent.service");
    assert_eq!(settled_state(&m, "felhom-agent.service"), "active");
    let helper_log = journal(&m, "felhom-agent-exec.service");
    assert!(
        m.prop("felhom-agent-exec.service", "Result") == "success",
        "the exec helper failed: {helper_log}"
    );
    report(&format!(
        "real systemd: felhom-agent-exec.socket started the helper (monotonic {started})"
    ));

    // The restore test, started by its timer: a drop-in makes the timer fire 2 s after it
    // starts (the packaged one fires once a day).
    assert_eq!(
        m.prop(
            "felhom-restore-test.service",
            "ExecMainStartTimestampMonotonic"
        ),
        "0"
    );
    m.write(
        "/etc/systemd/system/felhom-restore-test.timer.d/soon.conf",
        b"[Timer]\nOnCalendar=\nOnActiveSec=2s\nRandomizedDelaySec=0\nAccuracySec=1ms\n",
        0o644,
    );
    m.ok("systemctl daemon-reload && systemctl restart felhom-restore-test.timer");
    m.wait_for(
        "felhom-restore-test.service started",
        WAIT,
        |m| {
            m.prop(
                "felhom-restore-test.service",
                "ExecMainStartTimestampMonotonic",
            )
        },
        |v| v != "0",
    );
    // Nothing but the timer starts the service in this machine: it was never started before
    // (above), and it started after the timer's last trigger (wall clock, whole seconds, as
    // systemctl prints them; `LastTriggerUSecMonotonic` is printed as a time span).
    let secs = |m: &Machine, unit: &str, prop: &str| -> u64 {
        m.ok(&format!(
            "date -d \"$(systemctl show -p {prop} --value {unit})\" +%s"
        ))
        .parse()
        .unwrap_or_else(|e| panic!("{unit} {prop}: {e}"))
    };
    let trigger_s = secs(&m, "felhom-restore-test.timer", "LastTriggerUSec");
    let ran_s = secs(&m, "felhom-restore-test.service", "ExecMainStartTimestamp");
    assert!(
        trigger_s <= ran_s && ran_s - trigger_s < 30,
        "the service started at {ran_s}, the timer last triggered at {trigger_s}"
    );
    assert_eq!(
        m.prop("felhom-restore-test.service", "ConditionResult"),
        "yes"
    );
    let restore_log = m.wait_for(
        "the restore test's output in its journal",
        WAIT,
        |m| output_of(m, "felhom-restore-test.service"),
        |j| !j.trim().is_empty(),
    );
    report(&format!(
        "real systemd: felhom-restore-test.timer started felhom-restore-test.service ({} lines of output)",
        restore_log.lines().count()
    ));

    // doctor's reading of the syscall filter, against what this systemd prints.
    for unit in felhom_agent::doctor::AGENT_USER_UNITS {
        let filter = m.prop(unit, "SystemCallFilter");
        felhom_agent::doctor::filter_refuses(&filter, felhom_agent::doctor::MUST_REFUSE)
            .unwrap_or_else(|e| panic!("{unit}: {e}; systemctl printed: {filter}"));
        assert_eq!(m.prop(unit, "SystemCallArchitectures"), "native", "{unit}");
    }
    let doctor = m.sh("felhom-agent --json doctor 2>/dev/null");
    let text = String::from_utf8_lossy(&doctor.stdout).into_owned();
    assert!(
        text.contains("abstract_sockets") && doctor_check(&text, "abstract_sockets") == "pass",
        "doctor under the real systemd: {text}"
    );
    // A drop-in that drops the deny list: doctor sees it in systemd's reading.
    m.write(
        "/etc/systemd/system/felhom-agent.service.d/filter.conf",
        b"[Service]\nSystemCallFilter=\nSystemCallFilter=@system-service\n",
        0o644,
    );
    m.ok("systemctl daemon-reload");
    let filter = m.prop("felhom-agent.service", "SystemCallFilter");
    assert!(
        felhom_agent::doctor::filter_refuses(&filter, felhom_agent::doctor::MUST_REFUSE).is_err(),
        "@system-service alone read as refusing bind and listen: {filter}"
    );
    let text = String::from_utf8_lossy(&m.sh("felhom-agent --json doctor 2>/dev/null").stdout)
        .into_owned();
    assert_eq!(doctor_check(&text, "abstract_sockets"), "warn", "{text}");

    // A group of containers' lab under the shipped units: doctor (run as root, it drops to the
    // agent's user) has the exec helper make a lab as a group's run would, under the helper's
    // own sandbox, and remove it. The helper cannot `ip netns add` there (/run is read-only
    // to it, its mounts are private); an instance of felhom-lab@.service holds the namespace.
    let gpve = FakePve::start(felhom_tests::fakepve::pool_with_backups(&[
        (201, "db"),
        (202, "shop"),
    ]));
    configure(&m, &gpve, None);
    let mut cfg =
        std::fs::read_to_string(m.path("/etc/felhom-agent/agent.toml")).expect("agent.toml");
    cfg.push_str("\n[[restore_test.group]]\nname = \"shop\"\nguests = [201, 202]\n");
    m.write("/etc/felhom-agent/agent.toml", cfg.as_bytes(), 0o640);
    m.ok("chgrp felhom-agent /etc/felhom-agent/agent.toml");
    let lab_line = |m: &Machine| -> (String, String) {
        let out = m.sh("felhom-agent --json doctor 2>/dev/null");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let v: serde_json::Value = serde_json::from_str(text.trim())
            .unwrap_or_else(|e| panic!("doctor's JSON: {e}: {text}"));
        let line = v["checks"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == "restore_group_lab")
            .cloned()
            .unwrap_or_else(|| panic!("no restore_group_lab line under the real systemd: {text}"));
        (
            line["status"].as_str().unwrap_or_default().to_string(),
            line["message"].as_str().unwrap_or_default().to_string(),
        )
    };
    let (status, said) = lab_line(&m);
    assert_eq!(
        status,
        "pass",
        "{said}\nthe helper's journal: {}",
        journal(&m, "felhom-agent-exec.service")
    );
    assert!(
        said.contains("the root exec helper")
            && said.contains("made the lab felhom-lab@")
            && said.contains(", and removed it"),
        "{said}"
    );
    let unit = said
        .split("made the lab ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_default()
        .to_string();
    // systemd ran the instance (its start is in systemd's journal) and holds nothing of it now.
    let ran = m.ok(&format!(
        "journalctl --no-pager -o cat -u '{unit}' | grep -c . || true"
    ));
    assert_ne!(ran, "0", "systemd's journal has nothing of {unit}");
    assert_eq!(
        m.ok("systemctl list-units --all --plain --no-legend 'felhom-lab@*' | wc -l"),
        "0",
        "a lab unit is left after doctor's probe"
    );
    assert!(
        journal(&m, "felhom-agent-exec.service").contains("lab probe: made the lab felhom-lab@"),
        "the helper's journal: {}",
        journal(&m, "felhom-agent-exec.service")
    );
    report(&format!(
        "real systemd: the exec helper made and removed a group lab ({unit})"
    ));
    // Without the unit (masked), the same probe fails, naming the unit and the code.
    m.ok("systemctl mask --quiet felhom-lab@.service && systemctl daemon-reload");
    let (status, said) = lab_line(&m);
    assert_eq!(status, "fail", "{said}");
    assert!(
        said.contains("felhom-lab@") && said.contains("group_lab_failed"),
        "{said}"
    );
    m.ok("systemctl unmask --quiet felhom-lab@.service && systemctl daemon-reload");
    configure(&m, &pve, None);

    // The publisher stays while the daemon writes: an upgrade (the package again: postinst
    // configure <installed version>) restarts it onto the new binary, and a removal stops it
    // with every other unit of the package.
    let publisher = m.wait_for(
        "the metrics publisher running",
        WAIT,
        |m| m.prop("felhom-agent-metrics.service", "MainPID"),
        |pid| pid != "0",
    );
    m.ok("dpkg -i /tmp/felhom-agent.deb >/dev/null 2>&1");
    m.wait_for(
        "the metrics publisher restarted by the upgrade",
        WAIT,
        |m| m.prop("felhom-agent-metrics.service", "MainPID"),
        |pid| pid != "0" && *pid != publisher,
    );
    m.ok("dpkg -r felhom-agent >/dev/null 2>&1");
    let running = m.wait_for(
        "no process of the package after dpkg -r",
        WAIT,
        |m| {
            m.ok("for p in /proc/[0-9]*; do readlink \"$p/exe\" 2>/dev/null; done | grep -c felhom-agent || true")
        },
        |n| n == "0",
    );
    assert_eq!(running, "0");
    for unit in [
        "felhom-agent.service",
        "felhom-agent-exec.socket",
        "felhom-agent-exec.service",
        "felhom-restore-test.timer",
        "felhom-agent-metrics.path",
        "felhom-agent-metrics.service",
    ] {
        assert_ne!(
            String::from_utf8_lossy(&m.sh(&format!("systemctl is-active {unit}")).stdout).trim(),
            "active",
            "{unit} after dpkg -r"
        );
    }

    let left = m.shut_down();
    assert!(left.is_empty(), "left after the machine stopped: {left:?}");
    report("real systemd: ran the packaged units");
}

/// The status doctor's JSON gives check `name` ("" when absent).
fn doctor_check(json: &str, name: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json.trim()) else {
        return String::new();
    };
    v["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == name)
        .and_then(|c| c["status"].as_str())
        .unwrap_or("")
        .to_string()
}

/// An upgrade from a version whose user had its state directory as home, no expiry, a user
/// manager it could start and membership in www-data (which reads the node's TLS key):
/// postinst stops the running daemon (usermod refuses while a process of the user runs), moves
/// the home, expires the account, masks `user@<uid>.service`, removes the user from www-data
/// (saying so), stops the older exec helper and starts the daemon again, under a real systemd;
/// the new daemon runs without www-data, and doctor finds the user confined.
#[test]
fn an_upgrade_confines_an_older_installs_user_and_restarts_its_running_daemon() {
    let Some(m) = installed_machine("the upgrade's confinement of the user") else {
        return;
    };
    let pve = FakePve::demo();
    configure(&m, &pve, None);
    // The older install: its user's home the state directory, not expired, no mask, in group
    // www-data (which reads the node's TLS key in /etc/pve); the daemon running as that user,
    // and an exec helper of that install running.
    let uid = m.ok("id -u felhom-agent");
    m.ok(&format!(
        "usermod -d /var/lib/felhom-agent -e '' -aG www-data felhom-agent && \
         rm -f /etc/systemd/system/user@{uid}.service && systemctl daemon-reload && \
         systemctl start felhom-agent-exec.service && \
         systemctl start --no-block felhom-agent.service"
    ));
    let www_data = m.ok("getent group www-data | cut -d: -f3");
    assert!(
        m.ok("id -nG felhom-agent")
            .split(' ')
            .any(|g| g == "www-data"),
        "the older install's user is not in www-data: the upgrade proves nothing"
    );
    let old_helper = m.prop("felhom-agent-exec.service", "MainPID");
    assert_ne!(old_helper, "0", "the older exec helper does not run");
    assert_eq!(
        settled_state(&m, "felhom-agent.service"),
        "active",
        "{}",
        journal(&m, "felhom-agent.service")
    );
    let old_pid = m.prop("felhom-agent.service", "MainPID");
    assert_eq!(
        m.ok(&format!("stat -c %U /proc/{old_pid}")),
        "felhom-agent",
        "the daemon does not run as the agent's user: the upgrade proves nothing"
    );
    let groups_of = |pid: &str| {
        m.ok(&format!(
            "sed -n 's/^Groups:[[:space:]]*//p' /proc/{pid}/status"
        ))
        .split_whitespace()
        .map(str::to_string)
        .collect::<Vec<_>>()
    };
    assert!(
        groups_of(&old_pid).contains(&www_data),
        "the older daemon runs without www-data: the upgrade proves nothing"
    );
    let home = m.ok("getent passwd felhom-agent | cut -d: -f6");
    assert_eq!(home, "/var/lib/felhom-agent");
    let before = m.sh("felhom-agent --json doctor 2>/dev/null");
    let before = String::from_utf8_lossy(&before.stdout).into_owned();
    assert_eq!(doctor_check(&before, "agent_user_home"), "fail", "{before}");

    // The upgrade (the same .deb again runs `postinst configure <version>`).
    let out = m.ok("dpkg -i /tmp/felhom-agent.deb 2>&1");
    assert!(
        out.contains("Setting up felhom-agent") && !out.contains("could not"),
        "dpkg -i printed: {out}"
    );
    assert_eq!(
        m.ok("getent passwd felhom-agent | cut -d: -f6"),
        "/nonexistent"
    );
    // Out of www-data, and said so; the older exec helper stopped (the socket starts this
    // version's on the next request).
    assert!(
        out.contains("removed the user felhom-agent from group www-data"),
        "dpkg -i printed: {out}"
    );
    assert!(
        !m.ok("id -nG felhom-agent")
            .split(' ')
            .any(|g| g == "www-data"),
        "{}",
        m.ok("getent group www-data")
    );
    assert_ne!(
        m.prop("felhom-agent-exec.service", "MainPID"),
        old_helper,
        "the older exec helper still runs"
    );
    assert_eq!(m.prop("felhom-agent-exec.socket", "ActiveState"), "active");
    assert_eq!(m.ok("getent shadow felhom-agent | cut -d: -f8"), "1");
    assert_eq!(
        m.ok(&format!(
            "readlink /etc/systemd/system/user@{uid}.service; systemctl is-enabled user@{uid}.service || true"
        )),
        "/dev/null\nmasked"
    );
    // The daemon runs again, a new process, as the agent's user.
    assert_eq!(
        settled_state(&m, "felhom-agent.service"),
        "active",
        "{}",
        journal(&m, "felhom-agent.service")
    );
    let new_pid = m.prop("felhom-agent.service", "MainPID");
    assert_ne!(new_pid, old_pid, "the daemon was not restarted");
    assert_eq!(m.ok(&format!("stat -c %U /proc/{new_pid}")), "felhom-agent");
    assert!(
        !groups_of(&new_pid).contains(&www_data),
        "the new daemon still runs in www-data"
    );
    let after = m.sh("felhom-agent --json doctor 2>/dev/null");
    let after = String::from_utf8_lossy(&after.stdout).into_owned();
    for check in ["agent_user_home", "agent_user_login", "agent_user_manager"] {
        assert_eq!(doctor_check(&after, check), "pass", "{check}: {after}");
    }
    report("real systemd: ran an upgrade that confined an older install's user, took it out of www-data and restarted its daemon");

    let left = m.shut_down();
    assert!(left.is_empty(), "left after the machine stopped: {left:?}");
}

#[test]
fn the_metrics_path_keeps_publishing_under_a_write_every_200ms_for_12s() {
    let Some(m) = installed_machine("the metrics path under load") else {
        return;
    };
    let pve = FakePve::demo();
    configure(&m, &pve, None);
    let dir = m.path("/var/lib/felhom-agent-metrics");
    let published = m.path("/var/lib/prometheus/node-exporter/felhom_restore_test.prom");
    let uid: u32 = m.ok("id -u felhom-agent").parse().expect("uid");
    let text_of = |n: u64| {
        felhom_agent::metrics::restore_test_text(&felhom_agent::metrics::RestoreTestFigures {
            outcome: "ok",
            duration_s: 1.0,
            now: 1_700_000_000 + n,
            last_success: Some(1_700_000_000 + n),
            skipped_total: 0,
            runs_total: n,
        })
    };
    // As the agent writes: a new name, then a rename over the old one.
    let write = |n: u64| {
        let tmp = dir.join(format!(".felhom_restore_test.prom.{n}"));
        std::fs::write(&tmp, text_of(n)).expect("write");
        nix::unistd::chown(&tmp, Some(uid.into()), Some(uid.into())).expect("chown");
        std::fs::rename(&tmp, dir.join("felhom_restore_test.prom")).expect("rename");
    };
    // The publisher the first write starts (or the one already running) must be the one that
    // runs at the end: it stays and follows every write itself, so systemd starts nothing
    // during the run and no start limit can be reached, however long the writes go on (the
    // publisher's InvocationID is the same at every 25th write and at the end). The run spans
    // more than one of systemd's default start-limit windows (10 s, 5 starts;
    // `DefaultStartLimitIntervalSec`): the oneshot publisher failed the path unit after 5 s.
    let started = Instant::now();
    write(0);
    let publisher = m
        .wait_for(
            "the publisher to run",
            Duration::from_secs(30),
            |m| {
                (
                    m.prop("felhom-agent-metrics.service", "ActiveState"),
                    m.prop("felhom-agent-metrics.service", "InvocationID"),
                )
            },
            |(state, id)| state == "active" && !id.is_empty(),
        )
        .1;
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(12) {
        n += 1;
        write(n);
        if n.is_multiple_of(25) {
            // Fail early once the path unit is dead for good, or the publisher was started
            // again.
            let state = m.prop("felhom-agent-metrics.path", "ActiveState");
            assert_eq!(
                state,
                "active",
                "felhom-agent-metrics.path after {n} writes in {:.1} s: {state}, result {}",
                started.elapsed().as_secs_f64(),
                m.prop("felhom-agent-metrics.path", "Result")
            );
            assert_eq!(
                m.prop("felhom-agent-metrics.service", "InvocationID"),
                publisher,
                "the publisher was started again after {n} writes"
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let last = text_of(n);
    let seen = m.wait_for(
        "the published copy to follow the last write",
        Duration::from_secs(20),
        |_| std::fs::read_to_string(&published).unwrap_or_default(),
        |t| *t == last,
    );
    assert_eq!(seen, last);
    let runs = journal(&m, "felhom-agent-metrics.service")
        .lines()
        .filter(|l| l.contains("felhom_restore_test.prom") && l.contains("published"))
        .count();
    assert_eq!(m.prop("felhom-agent-metrics.path", "ActiveState"), "active");
    assert_eq!(m.prop("felhom-agent-metrics.path", "Result"), "success");
    assert_eq!(
        m.prop("felhom-agent-metrics.service", "ActiveState"),
        "active"
    );
    assert_eq!(
        m.prop("felhom-agent-metrics.service", "InvocationID"),
        publisher,
        "the publisher was started again"
    );
    report(&format!(
        "real systemd: {n} metrics writes in {:.0} s (one every 200 ms): {runs} publishes, the published copy is the last write, felhom-agent-metrics.path still active, one publisher throughout",
        started.elapsed().as_secs_f64()
    ));
    let left = m.shut_down();
    assert!(left.is_empty(), "left after the machine stopped: {left:?}");
    report("real systemd: ran the metrics path under load");
}

#[test]
fn nothing_of_a_machine_is_left_after_a_panic() {
    let root = match systemd_root() {
        Ok(r) => r,
        Err(why) => return unavailable("cleanup after a panic", &why),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let panicked = std::panic::catch_unwind(move || {
        let m = match Machine::boot(&root) {
            Ok(m) => m,
            Err(why) => return Err::<(), String>(why),
        };
        // Something of the test inside the machine, then a panic mid-test.
        m.ok("systemd-run --unit=felhom-test-sleeper sleep 600");
        tx.send((m.init_pid(), m.nspawn_pid(), m.overlay()))
            .expect("send");
        panic!("a test fails while its machine runs");
    });
    let Ok((init, nspawn, overlay)) = rx.try_recv() else {
        match panicked {
            Ok(Err(why)) => return unavailable("cleanup after a panic", &why),
            other => panic!("the machine did not come up: {other:?}"),
        }
    };
    assert!(panicked.is_err(), "the closure did not panic");
    let left = felhom_tests::nspawn::leftovers(init, nspawn, &overlay);
    assert!(left.is_empty(), "left after a panic: {left:?}");
    report("real systemd: ran cleanup after a panic");
}

/// The test process is SIGKILLed while its machine runs (no unwinding, no `Drop`): the
/// machine's watcher ends it. The test runs itself again as that process
/// (`FELHOM_NSPAWN_KILL_CHILD=1`: boot, print the pids, wait to be killed).
#[test]
fn nothing_of_a_machine_is_left_after_the_test_process_is_killed() {
    use std::io::BufRead as _;
    let root = match systemd_root() {
        Ok(r) => r,
        Err(why) => return unavailable("cleanup after SIGKILL", &why),
    };
    if std::env::var_os("FELHOM_NSPAWN_KILL_CHILD").is_some() {
        let m = Machine::boot(&root).expect("boot");
        println!(
            "MACHINE {} {} {}",
            m.init_pid(),
            m.nspawn_pid(),
            m.overlay().display()
        );
        std::thread::sleep(Duration::from_secs(600));
        unreachable!("the parent kills this process");
    }
    // This test binary again, running only the child half, in a process group of its own.
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "nothing_of_a_machine_is_left_after_the_test_process_is_killed",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("FELHOM_NSPAWN_KILL_CHILD", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the child half");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            // libtest prints `test <name> ... ` before the test's own output, on that line.
            if let Some(rest) = line.split_once("MACHINE ").map(|(_, r)| r) {
                let _ = tx.send(rest.to_string());
            }
        }
    });
    let Ok(line) = rx.recv_timeout(Duration::from_secs(180)) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the child half printed no machine");
    };
    let mut f = line.splitn(3, ' ');
    let init: u32 = f.next().and_then(|x| x.parse().ok()).expect("init pid");
    let nspawn: u32 = f.next().and_then(|x| x.parse().ok()).expect("nspawn pid");
    let overlay = PathBuf::from(f.next().expect("overlay"));
    assert!(
        std::path::Path::new(&format!("/proc/{init}")).exists(),
        "the machine is not running"
    );
    // SIGKILL: no unwinding, no Drop; the watcher ends the machine.
    child.kill().expect("SIGKILL the child half");
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = felhom_tests::nspawn::leftovers(init, nspawn, &overlay);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left 30 s after the test process was killed: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The overlay's folder (Drop did not run to remove it).
    if let Some(dir) = overlay.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    report("real systemd: ran cleanup after SIGKILL");
}
