//! The `pct list` parser: [`parse_pct_list`] reads the table pve-container prints, character
//! for character, and keeps only the vmids (the names are read and dropped).
//!
//! It may use only the shared types and table helpers of [`crate::inventory`] and std.

use std::sync::Arc;

use super::{parse_pmxcfs_vmid, table_lines, words, GuestEntry, GuestType, InventoryError};

/// `pct list`'s line layout (pve-container `pct.pm`): `"%-10s %-10s %-12s %-20s\n"`.
fn pct_layout(vmid: &str, status: &str, lock: &str, name: &str) -> String {
    format!("{vmid:<10} {status:<10} {lock:<12} {name:<20}")
}

/// Parse the output of `pct list` into entries on `node` (the command sees only this node).
///
/// `pct list` prints nothing at all when there are no containers; otherwise a header
/// `VMID Status Lock Name` and one row per container, laid out by `"%-10s %-10s %-12s %-20s"`.
/// The Lock column is blank unless the container is locked, so a row has three or four words;
/// the name (a hostname, no whitespace) is always the last. A value longer than its column
/// (the `snapshot-delete` lock) pushes the rest of the row right, exactly as printf does. Every
/// row must match that layout character for character; the names are read and dropped.
pub fn parse_pct_list(text: &str, node: &str) -> Result<Vec<GuestEntry>, InventoryError> {
    let node: Arc<str> = Arc::from(node);
    let bad = |line: usize, detail: String| InventoryError::PctListInvalid { line, detail };
    let header = pct_layout("VMID", "Status", "Lock", "Name");
    let mut lines = table_lines(text);
    let Some((n, first)) = lines.next() else {
        return Ok(Vec::new());
    };
    if first.trim_end() != header.trim_end() {
        return Err(bad(
            n,
            format!("expected the header {:?}", header.trim_end()),
        ));
    }
    let mut out = Vec::new();
    for (n, line) in lines {
        let w = words(line);
        let (vmid, status, lock, name) = match w.as_slice() {
            [(_, v), (_, s), (_, nm)] => (*v, *s, "", *nm),
            [(_, v), (_, s), (_, l), (_, nm)] => (*v, *s, *l, *nm),
            _ => {
                return Err(bad(
                    n,
                    format!("expected 3 or 4 columns, found {}", w.len()),
                ))
            }
        };
        let Some(id) = parse_pmxcfs_vmid(vmid) else {
            return Err(bad(n, format!("{vmid:?} is not a vmid")));
        };
        if pct_layout(vmid, status, lock, name).trim_end() != line.trim_end() {
            return Err(bad(n, "the columns are not where pct puts them".into()));
        }
        out.push(GuestEntry {
            vmid: id,
            kind: GuestType::Lxc,
            node: Arc::clone(&node),
            version: None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fixtures::{entry, PCT_LIST};

    #[test]
    fn pct_list_sample_with_lock_column() {
        let got = parse_pct_list(PCT_LIST, "pve1").unwrap();
        assert_eq!(
            got,
            vec![
                entry(101, GuestType::Lxc, "pve1", None),
                entry(102, GuestType::Lxc, "pve1", None),
                entry(103, GuestType::Lxc, "pve1", None),
            ]
        );
    }

    #[test]
    fn pct_list_rejects_what_pct_does_not_print() {
        let cases: &[(&str, usize, &str)] = &[
            ("101        running                 web\n", 1, "header"),
            // Whitespace splitting would take "backup" for the name here; the layout check does not.
            (
                "VMID       Status     Lock         Name\n101        running    backup\n",
                2,
                "columns",
            ),
            (
                "VMID       Status     Lock         Name\n101 running web\n",
                2,
                "columns",
            ),
            (
                "VMID       Status     Lock         Name\n0101       running                 web\n",
                2,
                "not a vmid",
            ),
            (
                "VMID       Status     Lock         Name\n101        running    backup       db extra\n",
                2,
                "3 or 4 columns",
            ),
            ("VMID       Status     Lock         Name\n101\n", 2, "3 or 4"),
        ];
        for (text, line, want) in cases {
            match parse_pct_list(text, "pve1") {
                Err(InventoryError::PctListInvalid { line: l, detail }) => {
                    assert_eq!(l, *line, "{text:?}");
                    assert!(detail.contains(want), "{text:?}: {detail}");
                }
                other => panic!("{text:?} gave {other:?}"),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn pct_rows_round_trip(
            rows in proptest::collection::btree_map(
                100u32..1_000_000,
                ("(running|stopped)", "(|backup|create|snapshot-delete|mounted)", "[a-z][a-z0-9-]{0,30}"),
                0..20,
            )
        ) {
            let mut text = String::new();
            if !rows.is_empty() {
                text.push_str(&pct_layout("VMID", "Status", "Lock", "Name"));
                text.push('\n');
            }
            for (vmid, (status, lock, name)) in &rows {
                text.push_str(&pct_layout(&vmid.to_string(), status, lock, name));
                text.push('\n');
            }
            let got: Vec<u32> = parse_pct_list(&text, "n").unwrap().iter().map(|e| e.vmid).collect();
            proptest::prop_assert_eq!(got, rows.keys().copied().collect::<Vec<_>>());
        }
    }
}
