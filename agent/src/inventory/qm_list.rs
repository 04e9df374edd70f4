//! The `qm list` parser: [`parse_qm_list`] reads the table qemu-server prints, character for
//! character, and keeps only the vmids (the names are read and dropped).
//!
//! It may use only the shared types and table helpers of [`crate::inventory`] and std.

use std::sync::Arc;

use super::{parse_pmxcfs_vmid, table_lines, words, GuestEntry, GuestType, InventoryError};

/// `qm list`'s line layout (qemu-server `qm.pm`): `"%10s %-20s %-10s %-10s %12s %-10s\n"`.
fn qm_layout(vmid: &str, name: &str, status: &str, mem: &str, disk: &str, pid: &str) -> String {
    format!("{vmid:>10} {name:<20} {status:<10} {mem:<10} {disk:>12} {pid:<10}")
}

fn is_perl_number(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
        && s.parse::<f64>().is_ok()
}

fn is_fixed_2(s: &str) -> bool {
    match s.split_once('.') {
        Some((int, frac)) => {
            !int.is_empty()
                && int.bytes().all(|b| b.is_ascii_digit())
                && frac.len() == 2
                && frac.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

/// Parse the output of `qm list` into entries on `node` (the command sees only this node).
///
/// `qm list` prints nothing when there are no virtual machines; otherwise a header
/// `VMID NAME STATUS MEM(MB) BOOTDISK(GB) PID` and one row per VM, laid out by
/// `"%10s %-20s %-10s %-10s %12.2f %-10s"`. The NAME may contain spaces (the default name is
/// `VM <vmid>`), so a row is read from both ends: the vmid first, then status, memory, boot
/// disk and pid from the right, and the name is what lies between. Every row must match that
/// layout character for character; the names are read and dropped.
pub fn parse_qm_list(text: &str, node: &str) -> Result<Vec<GuestEntry>, InventoryError> {
    let node: Arc<str> = Arc::from(node);
    let bad = |line: usize, detail: String| InventoryError::QmListInvalid { line, detail };
    let header = qm_layout("VMID", "NAME", "STATUS", "MEM(MB)", "BOOTDISK(GB)", "PID");
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
        if w.len() < 6 {
            return Err(bad(n, format!("expected 6 columns, found {}", w.len())));
        }
        let k = w.len();
        let vmid = w[0].1;
        let (status_at, status) = w[k - 4];
        let (mem, disk, pid) = (w[k - 3].1, w[k - 2].1, w[k - 1].1);
        let name_at = w[1].0;
        let name = line
            .get(name_at..status_at)
            .map(str::trim_end)
            .unwrap_or_default();
        let Some(id) = parse_pmxcfs_vmid(vmid) else {
            return Err(bad(n, format!("{vmid:?} is not a vmid")));
        };
        if !is_perl_number(mem) {
            return Err(bad(n, format!("MEM(MB) {mem:?} is not a number")));
        }
        if !is_fixed_2(disk) {
            return Err(bad(n, format!("BOOTDISK(GB) {disk:?} is not a number")));
        }
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(n, format!("PID {pid:?} is not a number")));
        }
        if qm_layout(vmid, name, status, mem, disk, pid).trim_end() != line.trim_end() {
            return Err(bad(n, "the columns are not where qm puts them".into()));
        }
        out.push(GuestEntry {
            vmid: id,
            kind: GuestType::Qemu,
            node: Arc::clone(&node),
            version: None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fixtures::{entry, QM_LIST};

    #[test]
    fn qm_list_sample_with_spaces_in_names() {
        let got = parse_qm_list(QM_LIST, "pve1").unwrap();
        assert_eq!(
            got,
            vec![
                entry(100, GuestType::Qemu, "pve1", None),
                entry(105, GuestType::Qemu, "pve1", None),
                entry(110, GuestType::Qemu, "pve1", None),
            ]
        );
    }

    #[test]
    fn qm_list_rejects_what_qm_does_not_print() {
        let header =
            "      VMID NAME                 STATUS     MEM(MB)    BOOTDISK(GB) PID       \n";
        let cases: Vec<(String, usize, &str)> = vec![
            ("VMID NAME STATUS\n".into(), 1, "header"),
            (format!("{header}       100 gw running\n"), 2, "6 columns"),
            (
                format!("{header}100 gw                   running    2048              32.00 4711\n"),
                2,
                "columns",
            ),
            (
                format!("{header}       100 gw                   running    2048              32 4711\n"),
                2,
                "BOOTDISK",
            ),
            (
                format!("{header}       100 gw                   running    lots              32.00 4711\n"),
                2,
                "MEM",
            ),
            (
                format!("{header}       100 gw                   running    2048              32.00 x\n"),
                2,
                "PID",
            ),
            (
                format!("{header}        -1 gw                   running    2048              32.00 0\n"),
                2,
                "not a vmid",
            ),
        ];
        for (text, line, want) in &cases {
            match parse_qm_list(text, "pve1") {
                Err(InventoryError::QmListInvalid { line: l, detail }) => {
                    assert_eq!(l, *line, "{text:?}");
                    assert!(detail.contains(want), "{text:?}: {detail}");
                }
                other => panic!("{text:?} gave {other:?}"),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn qm_rows_round_trip(
            rows in proptest::collection::btree_map(
                100u32..1_000_000,
                (proptest::option::of("[a-z][a-z0-9-]{0,30}"), "(running|stopped|paused)", 0u64..1_000_000, 0u32..100_000),
                0..20,
            )
        ) {
            let mut text = String::new();
            if !rows.is_empty() {
                text.push_str(&qm_layout("VMID", "NAME", "STATUS", "MEM(MB)", "BOOTDISK(GB)", "PID"));
                text.push('\n');
            }
            for (vmid, (name, status, mem, pid)) in &rows {
                let name = name.clone().unwrap_or_else(|| format!("VM {vmid}"));
                let disk = format!("{:.2}", f64::from(*pid) / 7.0);
                text.push_str(&qm_layout(&vmid.to_string(), &name, status, &mem.to_string(), &disk, &pid.to_string()));
                text.push('\n');
            }
            let got: Vec<u32> = parse_qm_list(&text, "n").unwrap().iter().map(|e| e.vmid).collect();
            proptest::prop_assert_eq!(got, rows.keys().copied().collect::<Vec<_>>());
        }
    }
}
