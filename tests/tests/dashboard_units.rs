//! The Grafana dashboard (`packaging/grafana/felhom-agent.json`): every panel shows one
//! quantity on one axis, with the unit that quantity has: durations and ages in seconds
//! (`s`), counts without a time unit, and never a timestamp beside a duration.

use felhom_tests::guestbed::repo_root;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quantity {
    /// A duration or an age, in seconds.
    Seconds,
    /// A point in time.
    Timestamp,
    /// A count, a depth, a 0/1.
    Count,
}

fn quantity(expr: &str) -> Quantity {
    if expr.contains("_timestamp_seconds") && !expr.contains("time() -") {
        Quantity::Timestamp
    } else if expr.contains("_seconds") {
        Quantity::Seconds
    } else {
        Quantity::Count
    }
}

#[test]
fn every_panel_shows_one_quantity_with_its_unit() {
    let path = repo_root().join("packaging/grafana/felhom-agent.json");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("dashboard")).expect("JSON");
    let panels = doc["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        let kinds: Vec<(Quantity, String)> = p["targets"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|t| t["expr"].as_str())
                    .map(|e| (quantity(e), e.to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let first = kinds.first().map(|k| k.0);
        assert!(
            kinds.iter().all(|k| Some(k.0) == first),
            "panel {title:?} mixes quantities on one axis: {kinds:#?}"
        );
        assert!(
            p["fieldConfig"]["overrides"]
                .as_array()
                .is_none_or(|o| o.is_empty()),
            "panel {title:?}: a per-series override would give it a second unit"
        );
        let unit = p["fieldConfig"]["defaults"]["unit"].as_str();
        match first {
            Some(Quantity::Seconds) => assert_eq!(unit, Some("s"), "panel {title:?}"),
            Some(Quantity::Timestamp) => assert!(
                unit.is_some_and(|u| u.starts_with("dateTime")),
                "panel {title:?}: {unit:?}"
            ),
            Some(Quantity::Count) => assert!(
                unit.is_none_or(|u| !matches!(u, "s" | "ms") && !u.starts_with("dateTime")),
                "panel {title:?}: a count shown as {unit:?}"
            ),
            None => {}
        }
    }
}
