//! Pushes into a VM fit the 64 KiB POST body of pve-http-server before libpve-http-server-perl
//! 5.2.1 (`501 for data too large` beyond it), counted with every encoding: base64, then the
//! form's percent-encoding of `+`, `/` and `=`. The bed's `post_limit` is PVE's check.

use felhom_agent::config::Config;
use felhom_agent::guest::exec::{ExecIds, GuestExec, PushSource};
use felhom_agent::guest::qemu::{QemuConfig, QemuExec, MAX_POST_BODY};
use felhom_agent::pve::PveClient;
use felhom_tests::fakepve::{add_qemu_backup, demo_scenario, start_qemu_copy, AgentFiles, FakePve};
use felhom_tests::guestbed::GuestBed;
use serde_json::json;

#[tokio::test]
async fn a_45_kib_file_arrives_in_a_vm_behind_a_64_kib_post_limit() {
    let bed = GuestBed::new();
    let mut s = demo_scenario();
    s["time_scale"] = json!(0.01);
    s["attrs"] = json!({"qemu_restore_secs": 30});
    add_qemu_backup(
        &mut s,
        json!({"name": "vm", "agent": "1"}),
        json!({"agent": true}),
    );
    bed.join_scenario(&mut s);
    let pve = FakePve::start(s);
    let vmid = 310;
    start_qemu_copy(&pve, vmid).await;
    pve.set(json!({"post_limit": MAX_POST_BODY}));

    // The bed refuses a larger body as pve-http-server does: 501, "for data too large".
    let big = "/".repeat(30_000);
    let body = format!("command=true&input-data={}", big.replace('/', "%2F"));
    assert!(body.len() > MAX_POST_BODY);
    let resp = pve
        .https_client()
        .post(format!(
            "{}/nodes/pve1/qemu/{vmid}/agent/exec",
            pve.api_url()
        ))
        .header("Authorization", pve.auth_header())
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 501);
    assert_eq!(resp.status().canonical_reason(), Some("Not Implemented"));
    assert_eq!(resp.text().await.unwrap_or_default(), "for data too large");

    // 45 KiB whose base64 is all '/' (each %2F in the form): the worst case.
    let files = AgentFiles::for_fake(&pve);
    let cfg = Config::load(&files.config_path).expect("config");
    let api = PveClient::new(&cfg.pve).expect("client");
    let vm =
        QemuExec::new(&api, "pve1", vmid, QemuConfig::default()).with_exec_ids(ExecIds::random());
    let payload = vec![0xFF_u8; 45 * 1024];
    let receipt = vm
        .push_file(
            &PushSource::Bytes(payload.clone()),
            "/root/pushed.bin",
            0o600,
        )
        .await
        .expect("the push arrives");
    assert_eq!(receipt.size, payload.len() as u64);
    let on_disk = std::fs::read(bed.rootfs(vmid).join("root/pushed.bin")).expect("in the VM");
    assert_eq!(on_disk, payload);
    let posts: Vec<_> = pve
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/agent/exec"))
        .collect();
    assert!(posts.len() >= 4, "the push went in chunks: {}", posts.len());
    for p in &posts[1..] {
        assert!(p.body.len() <= MAX_POST_BODY, "{} bytes", p.body.len());
    }
}
