//! Parse throughput of a 100,000-guest `/etc/pve/.vmlist` (the direct scanner `parse_vmlist`
//! uses, and the JSON reference decoder), and the work of one `vmid-check` against it (read the
//! file, parse, sort, join with an empty pool view, give the verdict).
//!
//! `cargo bench -p felhom-agent --bench vmlist` prints the figures; criterion reports the
//! parse throughput in bytes per second.

// criterion_group! defines an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use felhom_agent::inventory::{
    join, parse_vmlist, parse_vmlist_reference, read_full_list, InventoryError, ListCommand,
    PoolView,
};
use felhom_agent::vmid::check;

const GUESTS: u32 = 100_000;

/// A `.vmlist` laid out exactly as pmxcfs writes it, entries in a scrambled (hash-like) order
/// over 16 nodes.
fn big_vmlist(guests: u32) -> String {
    let mut vmids: Vec<u32> = (0..guests).map(|i| 100 + i * 7).collect();
    // A fixed linear congruential shuffle stands in for pmxcfs's hash order.
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    for i in (1..vmids.len()).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = (state >> 33) as usize % (i + 1);
        vmids.swap(i, j);
    }
    let rows: Vec<String> = vmids
        .iter()
        .enumerate()
        .map(|(i, vmid)| {
            let kind = if i % 3 == 0 { "qemu" } else { "lxc" };
            format!(
                "\"{vmid}\": {{ \"node\": \"pve{}\", \"type\": \"{kind}\", \"version\": {} }}",
                i % 16 + 1,
                i + 1
            )
        })
        .collect();
    format!(
        "{{\n\"version\": {},\n\"ids\": {{\n{}}}\n\n}}\n",
        guests * 2,
        rows.join(",\n")
    )
}

fn no_commands(_: ListCommand) -> Result<String, InventoryError> {
    Err(InventoryError::CommandFailed {
        command: "bench",
        detail: "the benchmark reads .vmlist only".into(),
    })
}

fn vmlist(c: &mut Criterion) {
    let text = big_vmlist(GUESTS);
    let mut group = c.benchmark_group("vmlist_100k");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("parse", |b| {
        b.iter(|| parse_vmlist(black_box(text.as_bytes())).map(|v| v.len()))
    });
    group.bench_function("parse_json_reference", |b| {
        b.iter(|| parse_vmlist_reference(black_box(text.as_bytes())).map(|v| v.len()))
    });

    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(e) => panic!("cannot make a temporary directory: {e}"),
    };
    let path = dir.path().join(".vmlist");
    if let Err(e) = std::fs::write(&path, &text) {
        panic!("cannot write {}: {e}", path.display());
    }
    group.bench_function("read_join_check", |b| {
        b.iter(|| {
            let full = read_full_list(black_box(&path), "pve1", &no_commands)
                .map_err(|e| e.to_string())?;
            let pool = PoolView::default();
            let inventory = join(&full, &pool);
            Ok::<_, String>(check(black_box("120"), &inventory).is_free())
        })
    });
    group.finish();
}

criterion_group!(benches, vmlist);
criterion_main!(benches);
