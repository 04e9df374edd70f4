//! `journal --stats`: per kind and per phase, how many times the phase ended and how long it
//! took (p50, p95, max), and the outcomes counted. Read from the journal only.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::provision::journal::TxnTimings;
use crate::provision::machine::Phase;

/// The figures of one phase of one kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseFigures {
    /// The phase.
    pub phase: String,
    /// How many times it ended.
    pub count: u64,
    /// Median duration, seconds (nearest rank).
    pub p50: f64,
    /// 95th percentile, seconds (nearest rank).
    pub p95: f64,
    /// Longest, seconds.
    pub max: f64,
}

/// The figures of one kind of transaction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindFigures {
    /// The kind (`provision`, `destroy`, `selftest-provision`, `restore-test`).
    pub kind: String,
    /// Transactions of this kind.
    pub transactions: u64,
    /// Settled transactions by outcome; open ones under `open`.
    pub outcomes: BTreeMap<String, u64>,
    /// Phases in the order of the forward path.
    pub phases: Vec<PhaseFigures>,
}

/// What `journal --stats` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    /// Only transactions started at or after this instant (RFC 3339), if `--since` was given.
    pub since: Option<String>,
    /// Transactions counted.
    pub transactions: u64,
    /// Per kind, by name.
    pub kinds: Vec<KindFigures>,
}

/// The nearest-rank percentile `p` (0 < p <= 100) of sorted `v`: the smallest value with at
/// least p % of the values at or below it.
pub fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Per kind: transactions, outcomes, durations by phase.
type Tally = (u64, BTreeMap<String, u64>, BTreeMap<Phase, Vec<f64>>);

/// The figures of `timings` (already filtered by `--since`).
pub fn compute(timings: &[TxnTimings], since: Option<String>) -> Stats {
    let mut kinds: BTreeMap<&str, Tally> = BTreeMap::new();
    for t in timings {
        let entry = kinds.entry(t.kind.as_str()).or_default();
        entry.0 += 1;
        let outcome = t.outcome.map_or("open", |o| o.as_str());
        *entry.1.entry(outcome.to_string()).or_default() += 1;
        for p in &t.phases {
            entry.2.entry(p.phase).or_default().push(p.seconds);
        }
    }
    let kinds = kinds
        .into_iter()
        .map(|(kind, (transactions, outcomes, phases))| KindFigures {
            kind: kind.to_string(),
            transactions,
            outcomes,
            phases: phases
                .into_iter()
                .map(|(phase, mut v)| {
                    v.sort_by(f64::total_cmp);
                    PhaseFigures {
                        phase: phase.as_str().to_string(),
                        count: v.len() as u64,
                        p50: round_ms(nearest_rank(&v, 50.0)),
                        p95: round_ms(nearest_rank(&v, 95.0)),
                        max: round_ms(v.last().copied().unwrap_or(0.0)),
                    }
                })
                .collect(),
        })
        .collect();
    Stats {
        since,
        transactions: timings.len() as u64,
        kinds,
    }
}

fn round_ms(s: f64) -> f64 {
    (s * 1000.0).round() / 1000.0
}

/// Parse `--since`: a number and a unit, `s`, `m`, `h` or `d` (`90m`, `36h`, `7d`), into
/// seconds.
pub fn parse_since(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("--since {s:?} has no unit; write e.g. 90m, 36h or 7d"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("--since {s:?} does not start with a number; write e.g. 36h"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => {
            return Err(format!(
                "--since {s:?}: unknown unit {unit:?}; use s, m, h or d (e.g. 36h)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("--since {s:?} is too large"))
}

/// The human table of `journal --stats`.
pub fn human(stats: &Stats) -> String {
    let mut s = String::new();
    if let Some(since) = &stats.since {
        s.push_str(&format!("transactions started since {since}\n"));
    }
    if stats.kinds.is_empty() {
        s.push_str("(no transactions)\n");
        return s;
    }
    for k in &stats.kinds {
        let outcomes: Vec<String> = k.outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
        s.push_str(&format!(
            "{}: {} transactions ({})\n",
            k.kind,
            k.transactions,
            outcomes.join(", ")
        ));
        s.push_str(&format!(
            "  {:<14} {:>6} {:>10} {:>10} {:>10}\n",
            "PHASE", "COUNT", "P50 s", "P95 s", "MAX s"
        ));
        for p in &k.phases {
            s.push_str(&format!(
                "  {:<14} {:>6} {:>10.3} {:>10.3} {:>10.3}\n",
                p.phase, p.count, p.p50, p.p95, p.max
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 50.0), 10.0);
        assert_eq!(nearest_rank(&v, 95.0), 19.0);
        assert_eq!(nearest_rank(&v, 100.0), 20.0);
        assert_eq!(nearest_rank(&[3.0], 95.0), 3.0);
        assert_eq!(nearest_rank(&[], 50.0), 0.0);
        assert_eq!(nearest_rank(&[1.0, 2.0], 50.0), 1.0);
    }

    #[test]
    fn since_units() {
        assert_eq!(parse_since("90m"), Ok(5400));
        assert_eq!(parse_since("36h"), Ok(129_600));
        assert_eq!(parse_since("7d"), Ok(604_800));
        assert!(parse_since("7").is_err());
        assert!(parse_since("h").is_err());
        assert!(parse_since("3w").is_err());
        assert!(parse_since("99999999999999999999d").is_err());
    }
}
