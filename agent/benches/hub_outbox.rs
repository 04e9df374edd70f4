//! Durable outbox throughput: events stored per second, each one synced to disk before its
//! `push` returns.
//!
//! `cargo bench -p felhom-agent --bench hub_outbox` prints three figures on the disk that holds
//! the target dir: one producer (every event waits for its own `fdatasync`, the floor), and 16
//! and 64 concurrent producers (events that arrive together share one write and one
//! `fdatasync`, the group commit). The goal is at least 5,000 events/s.

use std::time::{Duration, Instant};

use felhom_agent::hub::outbox::{now_timestamp, Outbox};
use hub_protocol::{AgentMessage, Event, Phase, TxnId, TxnKind};

const EVENTS: usize = 20_000;
const SINGLE_PRODUCER_EVENTS: usize = 2_000;

fn event(txn: TxnId, n: usize) -> AgentMessage {
    AgentMessage::Event(Event {
        txn,
        kind: TxnKind::Provision,
        vmid: Some(120),
        phase: Phase::Bootstrapped,
        at: now_timestamp().unwrap_or_else(|e| panic!("clock: {e}")),
        detail: Some(format!("profile base, step {n}")),
        error: None,
        guest: None,
        backup: None,
    })
}

async fn run(producers: usize, events: usize) -> (Duration, u64) {
    let dir = tempfile::Builder::new()
        .prefix("hub-outbox-bench-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap_or_else(|e| panic!("temporary dir: {e}"));
    let (outbox, _) = Outbox::open(dir.path()).unwrap_or_else(|e| panic!("open: {e}"));
    let per = events / producers;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..producers {
        let outbox = outbox.clone();
        tasks.push(tokio::spawn(async move {
            let txn = TxnId::from_ulid(ulid::Ulid::new());
            for n in 0..per {
                outbox
                    .push(event(txn, p * per + n))
                    .await
                    .unwrap_or_else(|e| panic!("push: {e}"));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap_or_else(|e| panic!("producer: {e}"));
    }
    let took = started.elapsed();
    let stored = outbox.depth();
    outbox.close().await;
    (took, stored)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    println!(
        "durable outbox throughput (every event synced before push returns), in {}",
        env!("CARGO_TARGET_TMPDIR")
    );
    for (producers, events) in [(1, SINGLE_PRODUCER_EVENTS), (16, EVENTS), (64, EVENTS)] {
        let (took, stored) = rt.block_on(run(producers, events));
        assert_eq!(
            stored as usize,
            events / producers * producers,
            "events lost"
        );
        println!(
            "  {producers:>2} producers: {stored} events in {:.2} s = {:.0} events/s",
            took.as_secs_f64(),
            stored as f64 / took.as_secs_f64()
        );
    }
}
