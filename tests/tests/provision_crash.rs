//! Crash safety: the agent is SIGKILLed at every phase boundary of a provision (just before and
//! just after each journal record), then a later command settles what it left. Every
//! transaction must settle; a guest is destroyed only with proof of ownership; no foreign guest
//! is ever touched.

use felhom_tests::agent::AgentRun;
use felhom_tests::world::World;
use serde_json::Value;

fn run(w: &World, args: &[&str], kill_at: Option<&str>) -> AgentRun {
    let mut cmd = w.command();
    cmd.args(args);
    if let Some(k) = kill_at {
        cmd.env("FELHOM_AGENT_KILL_AT", k);
    }
    cmd.output().expect("run agent").into()
}

const FOREIGN: [u32; 3] = [101, 990000, 990001];

#[test]
fn sigkill_at_every_phase_boundary_settles_safely() {
    let mut covered = 0;
    let mut destroyed_with_proof = 0;
    let mut needs_human = 0;
    for when in ["before-journal", "after-journal"] {
        for k in 1..=30u32 {
            let w = World::demo();
            let pve = &w.pve;

            let point = format!("{when}:{k}");
            let first = run(
                &w,
                &["--selftest=provision", "-vmid", "140", "--json"],
                Some(&point),
            );
            if first.code.is_some() {
                // The provision ended before reaching this kill point: every boundary is covered.
                assert_eq!(
                    first.code,
                    Some(0),
                    "{point}: {}\n{}",
                    first.stdout,
                    first.stderr
                );
                break;
            }
            covered += 1;

            // Any writing command settles the open transaction first; a dry run of another
            // vmid does not, so use a real (kept) provision of another vmid.
            let second = run(
                &w,
                &["--selftest=provision", "-vmid", "141", "--keep", "--json"],
                None,
            );
            assert_eq!(
                second.code,
                Some(0),
                "{point}: the follow-up run failed: {}\n{}",
                second.stdout,
                second.stderr
            );

            let journal = run(&w, &["journal", "--json"], None).json();
            let txns = journal["transactions"]
                .as_array()
                .expect("transactions")
                .clone();
            let crashed: Vec<&Value> = txns.iter().filter(|t| t["vmid"] == 140).collect();
            assert_eq!(
                crashed.len(),
                if k == 1 && when == "before-journal" {
                    0
                } else {
                    1
                },
                "{point}: {journal:#}"
            );
            for t in &crashed {
                assert!(
                    !t["outcome"].is_null(),
                    "{point}: transaction left open: {t:#}"
                );
            }

            // Nothing foreign touched, ever.
            for vmid in FOREIGN {
                assert!(
                    pve.writes_for(vmid).is_empty(),
                    "{point}: foreign {vmid} written"
                );
                assert!(pve.guest(vmid).is_some(), "{point}: foreign {vmid} gone");
            }
            assert!(
                pve.writes_for(200).is_empty() && pve.writes_for(300).is_empty(),
                "{point}: pool guests written"
            );

            // A DELETE of 140 only happened with proof: the crashed transaction was armed.
            let deleted = !pve.deletes_for(140).is_empty();
            if deleted {
                let t = crashed.first().expect("a transaction");
                assert_eq!(
                    t["destroy_armed"],
                    Value::Bool(true),
                    "{point}: destroyed without proof: {t:#}"
                );
                destroyed_with_proof += 1;
            }
            // A guest left at 140 is reported to a human, never silently kept.
            if pve.guest(140).is_some() {
                let t = crashed.first().expect("a transaction");
                assert_eq!(
                    t["outcome"], "needs_human",
                    "{point}: guest 140 left behind silently by {t:#}"
                );
                needs_human += 1;
            }
        }
    }
    felhom_tests::report(&format!(
        "crash test: kill points covered: {covered}; settled by a gated destroy: {destroyed_with_proof}; left for a human: {needs_human}"
    ));
    assert!(covered >= 20, "only {covered} kill points were reached");
}
