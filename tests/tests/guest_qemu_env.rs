//! A VM's command gets its environment values on stdin, never on a command line: the bed VM's
//! processes run on this machine, so every process's `/proc/<pid>/cmdline` is read while the
//! command runs, as any user inside the VM could.

use felhom_agent::config::Config;
use felhom_agent::guest::exec::{ExecIds, ExecRequest, GuestExec};
use felhom_agent::guest::qemu::{QemuConfig, QemuExec};
use felhom_agent::pve::PveClient;
use felhom_tests::fakepve::{add_qemu_backup, demo_scenario, start_qemu_copy, AgentFiles, FakePve};
use felhom_tests::guestbed::{all_cmdlines, GuestBed};
use serde_json::json;

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
    start_qemu_copy(&pve, vmid).await;
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
