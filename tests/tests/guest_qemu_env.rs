//! A VM's command gets its environment values on stdin, never on a command line: the bed VM's
//! processes run on this machine, so every process's `/proc/<pid>/cmdline` is read while the
//! command runs, as any user inside the VM could.

use std::time::{Duration, Instant};

use felhom_agent::config::Config;
use felhom_agent::guest::exec::{ExecIds, ExecRequest, GuestExec};
use felhom_agent::guest::qemu::{QemuConfig, QemuExec};
use felhom_agent::pve::PveClient;
use felhom_tests::fakepve::{
    add_qemu_backup, api_get as get, api_send as send, demo_scenario, AgentFiles, FakePve,
    QEMU_BACKUP,
};
use felhom_tests::guestbed::GuestBed;
use serde_json::json;

async fn post_and_wait(pve: &FakePve, path: &str, form: &[(&str, &str)]) {
    let (status, body) = send(pve, reqwest::Method::POST, path, form).await;
    assert_eq!(status, 200, "{body}");
    let upid = body["data"].as_str().expect("UPID").to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, t) = get(pve, &format!("/nodes/pve1/tasks/{upid}/status")).await;
        if t["data"]["status"] == "stopped" {
            assert_eq!(t["data"]["exitstatus"], "OK", "{t}");
            return;
        }
        assert!(Instant::now() < deadline, "task {upid} did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn all_cmdlines() -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if !entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        if let Ok(bytes) = std::fs::read(entry.path().join("cmdline")) {
            out.push(String::from_utf8_lossy(&bytes).replace('\0', " "));
        }
    }
    out
}

#[tokio::test]
async fn environment_values_never_appear_on_a_vm_command_line() {
    let bed = GuestBed::new();
    let mut s = demo_scenario();
    s["time_scale"] = json!(0.01);
    s["attrs"] = json!({"qemu_restore_secs": 5});
    add_qemu_backup(
        &mut s,
        json!({"name": "vm", "agent": "1"}),
        json!({"agent": true}),
    );
    bed.join_scenario(&mut s);
    let pve = FakePve::start(s);
    let vmid = 311;
    let id = vmid.to_string();
    post_and_wait(
        &pve,
        "/nodes/pve1/qemu",
        &[
            ("vmid", &id),
            ("archive", QEMU_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ],
    )
    .await;
    post_and_wait(&pve, &format!("/nodes/pve1/qemu/{vmid}/status/start"), &[]).await;
    let files = AgentFiles::for_fake(&pve);
    let cfg = Config::load(&files.config_path).expect("config");
    let api = PveClient::new(&cfg.pve).expect("client");
    let vm =
        QemuExec::new(&api, "pve1", vmid, QemuConfig::default()).with_exec_ids(ExecIds::random());

    let secret = format!("vmsecret{}", ulid::Ulid::new()).to_ascii_lowercase();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (stop, secret) = (stop.clone(), secret.clone());
        std::thread::spawn(move || {
            let (mut scans, mut seen) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                seen.extend(all_cmdlines().into_iter().filter(|l| l.contains(&secret)));
                scans += 1;
            }
            (scans, seen)
        })
    };
    let outcome = vm
        .exec(
            &ExecRequest::new(vec![
                "/bin/sh",
                "-c",
                "sleep 2; printf '%s|' \"$FELHOM_SECRET\"; cat",
            ])
            .env("FELHOM_SECRET", &secret)
            .stdin(b"its own stdin\n".to_vec()),
        )
        .await
        .expect("exec");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (scans, seen) = watcher.join().expect("watcher");
    assert!(outcome.success(), "{outcome:?}");
    assert_eq!(outcome.stdout.text(), format!("{secret}|its own stdin\n"));
    assert!(scans > 5, "the command lines were read only {scans} times");
    assert!(seen.is_empty(), "a command line held the value: {seen:#?}");
}
