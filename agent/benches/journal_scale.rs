//! The journal after years of use (prints figures; not a timed test): 100,000 settled
//! transactions plus a few that may still own a guest, the cost of `journal` and of the settle
//! step before and after retention moves the settled ones into the archive, and what the
//! journal folder holds then.
//!
//! The transactions are written with the journal's own code on tmpfs (its fsyncs cost nothing
//! there), then copied to the disk the measurements run on (`target/tmp`).
//!
//! Run: `cargo bench -p felhom-agent --bench journal_scale` (`FELHOM_JOURNAL_BENCH_N` changes
//! the 100,000).

use std::path::Path;
use std::time::{Duration, Instant};

use felhom_agent::error::{ErrorCode, Failure};
use felhom_agent::provision::machine::{step, Event, Request, State, TxnKind};
use felhom_agent::provision::Journal;
use felhom_agent::pve::GuestKind;
use ulid::Ulid;

/// Transactions that may still own a guest (open ones): never archived.
const OPEN: u64 = 10;
const RUNS: usize = 10;

fn request(txn: Ulid, vmid: u32) -> Request {
    Request {
        txn,
        kind: TxnKind::SelftestProvision,
        vmid: Some(vmid),
        guest: GuestKind::Lxc,
        volid: "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst".to_string(),
        storage: "local-lvm".to_string(),
        pool: "felhom".to_string(),
        isolate_network: false,
        keep: false,
        dry_run: false,
        profile: None,
        lab_bridge: None,
        group: None,
    }
}

fn next(s: &State, e: Event) -> State {
    step(s, e).map(|(s, _)| s).expect("allowed transition")
}

/// A transaction PVE refused at the restore: two records, settled.
fn refused(j: &Journal, n: u64) {
    let txn = Ulid::from_parts(1_700_000_000_000 + n, u128::from(n));
    let vmid = 100 + (n % 1_000_000) as u32;
    let s0 = next(&State::new(request(txn, vmid)), Event::VmidAccepted);
    let s1 = next(
        &s0,
        Event::SubmitRefused(Failure::new(
            ErrorCode::PveRefused,
            format!("CT {vmid} already exists on node 'pve1'"),
        )),
    );
    j.record(&s0).expect("record");
    j.record(&s1).expect("record");
}

/// A transaction left open after its vmid was accepted.
fn open(j: &Journal, n: u64) {
    let txn = Ulid::from_parts(1_800_000_000_000 + n, u128::from(n));
    let s0 = next(
        &State::new(request(txn, 2_000_000 + n as u32)),
        Event::VmidAccepted,
    );
    j.record(&s0).expect("record");
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        last = Some(f());
        times.push(t.elapsed());
    }
    (median(times), last.expect("one run"))
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .count()
        })
        .unwrap_or(0)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    let n: u64 = std::env::var("FELHOM_JOURNAL_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let shm = tempfile::Builder::new()
        .prefix("felhom-journal-bench")
        .tempdir_in("/dev/shm")
        .expect("tmpfs folder");
    let started = Instant::now();
    {
        let j = Journal::open(shm.path()).expect("journal on tmpfs");
        for i in 0..n {
            refused(&j, i);
        }
        for i in 0..OPEN {
            open(&j, i);
        }
    }
    let generated = started.elapsed();
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tmp");
    std::fs::create_dir_all(&base).expect("target/tmp");
    let disk = tempfile::Builder::new()
        .prefix("felhom-journal-bench")
        .tempdir_in(&base)
        .expect("disk folder");
    let state = disk.path().join("state");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(shm.path())
        .arg(&state)
        .status()
        .expect("cp");
    assert!(status.success(), "cp -a failed");
    drop(shm);
    let j = Journal::open(&state).expect("journal on disk");
    let live = j.dir().to_path_buf();
    println!(
        "journal benchmark: {n} settled transactions + {OPEN} open ones (written in {:.1} s, copied to {})",
        generated.as_secs_f64(),
        state.display()
    );
    println!(
        "  journal folder before retention: {} files",
        files_in(&live)
    );
    let (list_before, listing) = time(3, || j.list_recent(50).expect("list"));
    assert_eq!(listing.rows.len() as u64, OPEN + 50.min(n));
    let (open_before, _) = time(3, || j.open_transactions().expect("open"));
    println!(
        "  before: `journal` (open ones + the 50 newest settled) {} ; settle step (open transactions) {}",
        ms(list_before),
        ms(open_before)
    );
    // Retention as `[journal] keep_days = 90` sees it 91 days from now.
    let later = time::OffsetDateTime::now_utc() + time::Duration::days(91);
    let keep = Duration::from_secs(90 * 24 * 3600);
    let t = Instant::now();
    let moved = j.compact(keep, later).expect("compact");
    let compact_once = t.elapsed();
    println!(
        "  retention: moved {:?} in {:.1} s (once)",
        moved,
        compact_once.as_secs_f64()
    );
    let archive_files = files_in(&j.archive_dir());
    println!(
        "  journal folder after retention: {} files (the open ones) + archive/ with {archive_files} file(s)",
        files_in(&live)
    );
    let (list_after, listing) = time(RUNS, || j.list_recent(50).expect("list"));
    assert_eq!(listing.rows.len() as u64, OPEN + 50.min(n));
    assert_eq!(listing.not_shown, n.saturating_sub(50));
    let (open_after, open_rows) = time(RUNS, || j.open_transactions().expect("open"));
    assert_eq!(open_rows.len() as u64, OPEN);
    let (compact_idle, _) = time(RUNS, || j.compact(keep, later).expect("compact"));
    assert_eq!(
        files_in(&j.archive_dir()),
        archive_files,
        "the retention check writes nothing"
    );
    println!(
        "  after: `journal` (open ones + the 50 newest from the archive's end) {} (goal < 100 ms); settle step: open transactions {} + retention check {} (goal < 10 ms)",
        ms(list_after),
        ms(open_after),
        ms(compact_idle)
    );
    let (metrics, view) = time(RUNS, || j.timings_with_archive().expect("metrics view"));
    assert_eq!(view.archived.transactions, n);
    println!(
        "  metrics (journal folder + the archive's totals): {}",
        ms(metrics)
    );
    let (all, archived) = time(1, || j.archived().expect("archive"));
    println!(
        "  `journal --all` reading the archive: {} rows in {}",
        archived.len(),
        ms(all)
    );
}
