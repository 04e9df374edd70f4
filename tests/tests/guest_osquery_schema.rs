//! The default check pack against osquery 5.23.1's real table schema
//! (`tests/data/osquery-schema.json`), and the `osqueryi` stand-in against the same
//! schema and osquery's documented output format.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use felhom_agent::guest::checks::Expectation;
use felhom_agent::guest::{load_packs, ExecRequest, GuestExec, GuestExit};
use felhom_tests::guestbed::{repo_root, test_data, GuestBed};

/// One table of the schema: its Linux columns (name -> hidden) and flags.
struct Table {
    columns: BTreeMap<String, bool>,
    required: BTreeSet<String>,
    linux: bool,
    evented: bool,
}

fn schema() -> BTreeMap<String, Table> {
    let path = test_data("osquery-schema.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (see tests/data/README.md)", path.display()));
    let doc: serde_json::Value = serde_json::from_str(&text).expect("the schema is JSON");
    assert_eq!(doc["osquery_version"], "5.23.1");
    let mut tables = BTreeMap::new();
    for t in doc["tables"].as_array().expect("tables") {
        let has_linux =
            |v: &serde_json::Value| v.as_array().is_some_and(|a| a.iter().any(|p| p == "linux"));
        let mut columns = BTreeMap::new();
        let mut required = BTreeSet::new();
        for c in t["columns"].as_array().expect("columns") {
            // A column limited to other platforms does not exist on Linux.
            if c.get("platforms").is_some() && !has_linux(&c["platforms"]) {
                continue;
            }
            let name = c["name"].as_str().expect("a column name").to_owned();
            if c.get("required").and_then(serde_json::Value::as_bool) == Some(true) {
                required.insert(name.clone());
            }
            columns.insert(
                name,
                c.get("hidden").and_then(serde_json::Value::as_bool) == Some(true),
            );
        }
        tables.insert(
            t["name"].as_str().expect("a table name").to_owned(),
            Table {
                columns,
                required,
                linux: has_linux(&t["platforms"]),
                evented: t.get("evented").and_then(serde_json::Value::as_bool) == Some(true),
            },
        );
    }
    tables
}

/// The tables and the column names a simple query refers to (SELECT … FROM t [JOIN u] WHERE …).
fn tables_and_columns(sql: &str) -> (Vec<String>, BTreeSet<String>) {
    const KEYWORDS: &[&str] = &[
        "select", "from", "where", "and", "or", "not", "like", "in", "is", "null", "as", "join",
        "on", "distinct", "order", "by", "group", "limit", "asc", "desc", "having", "left",
        "inner", "glob", "between",
    ];
    // Tokens: identifiers, string literals (dropped), and single characters.
    let mut tokens: Vec<String> = Vec::new();
    let chars: Vec<char> = sql.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '\'' {
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
            tokens.push("'literal'".to_owned());
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect());
        } else {
            tokens.push(c.to_string());
            i += 1;
        }
    }
    let mut tables = Vec::new();
    let mut columns = BTreeSet::new();
    for (n, tok) in tokens.iter().enumerate() {
        let lower = tok.to_ascii_lowercase();
        let prev = n.checked_sub(1).map(|p| tokens[p].to_ascii_lowercase());
        let next = tokens.get(n + 1).map(String::as_str);
        if !(tok.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')) {
            continue;
        }
        if KEYWORDS.contains(&lower.as_str()) || next == Some("(") {
            continue;
        }
        match prev.as_deref() {
            Some("from") | Some("join") => tables.push(tok.clone()),
            Some("as") => {}
            _ => {
                columns.insert(tok.clone());
            }
        }
    }
    (tables, columns)
}

#[test]
fn the_query_reader_finds_tables_and_columns() {
    let (t, c) = tables_and_columns(
        "SELECT path, flags AS f FROM mounts WHERE path = '/' AND (flags LIKE 'rw,%' OR count(type) > 1)",
    );
    assert_eq!(t, ["mounts"]);
    assert_eq!(c.into_iter().collect::<Vec<_>>(), ["flags", "path", "type"]);
}

#[test]
fn the_default_pack_names_real_linux_tables_and_columns() {
    let schema = schema();
    let checks = load_packs(&repo_root().join("packaging/checks.d")).unwrap();
    assert!(!checks.is_empty());
    for check in &checks {
        let (tables, columns) = tables_and_columns(&check.sql);
        assert!(
            !tables.is_empty(),
            "{}: no table in {:?}",
            check.name,
            check.sql
        );
        for t in &tables {
            let table = schema
                .get(t)
                .unwrap_or_else(|| panic!("{}: osquery has no table {t}", check.name));
            assert!(
                table.linux,
                "{}: table {t} does not exist on Linux",
                check.name
            );
            assert!(
                !table.evented,
                "{}: {t} is event-based and empty in one-shot osqueryi",
                check.name
            );
            // A required column must be constrained, else osquery refuses the query.
            for req in &table.required {
                assert!(
                    columns.contains(req),
                    "{}: {t} needs {req} in the WHERE clause",
                    check.name
                );
            }
        }
        for col in &columns {
            assert!(
                tables.iter().any(|t| schema[t].columns.contains_key(col)),
                "{}: no column {col} in {tables:?}",
                check.name
            );
        }
        if let Expectation::ColumnEquals { column, .. } = &check.expect {
            assert!(
                columns.contains(column),
                "{}: the expectation reads {column}, which the query does not select",
                check.name
            );
        }
    }
}

async fn osqueryi(bed: &GuestBed, vmid: u32, sql: &str) -> felhom_agent::guest::ExecOutcome {
    bed.lxc(vmid)
        .exec(
            &ExecRequest::new(["/usr/bin/osqueryi", "--json", sql])
                .timeout(Duration::from_secs(20)),
        )
        .await
        .expect("osqueryi ran")
}

/// The stand-in answers `SELECT *` with exactly the visible Linux columns of osquery 5.23.1,
/// every value a string, keys sorted, in osquery's byte layout.
#[tokio::test]
async fn the_stand_in_matches_the_schema_for_the_default_pack_tables() {
    let schema = schema();
    let bed = GuestBed::new();
    bed.add_ct(140);
    for table in [
        "os_version",
        "system_info",
        "osquery_info",
        "mounts",
        "systemd_units",
    ] {
        let outcome = osqueryi(&bed, 140, &format!("SELECT * FROM {table}")).await;
        assert!(outcome.success(), "{table}: {}", outcome.summary());
        let text = outcome.stdout.text().into_owned();
        assert!(text.starts_with("[\n  {"), "{table}: {text:?}");
        assert!(text.ends_with("}\n]\n"), "{table}: {text:?}");
        let rows: Vec<serde_json::Map<String, serde_json::Value>> =
            serde_json::from_str(&text).unwrap();
        let want: BTreeSet<&str> = schema[table]
            .columns
            .iter()
            .filter(|(_, hidden)| !**hidden)
            .map(|(c, _)| c.as_str())
            .collect();
        for (n, row) in rows.iter().enumerate() {
            let got: BTreeSet<&str> = row.keys().map(String::as_str).collect();
            assert_eq!(got, want, "{table} row {n}");
            assert!(
                row.values().all(serde_json::Value::is_string),
                "{table}: {row:?}"
            );
        }
        // One compact object per line, keys in byte order.
        for line in text.lines().filter(|l| l.starts_with("  {")) {
            let obj = line.trim_start().trim_end_matches(',');
            let keys: Vec<String> = serde_json::from_str::<serde_json::Value>(obj)
                .unwrap()
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect();
            let order: Vec<usize> = keys
                .iter()
                .map(|k| obj.find(&format!("\"{k}\":")).unwrap())
                .collect();
            assert!(
                order.windows(2).all(|w| w[0] < w[1]),
                "{table}: keys unsorted: {obj}"
            );
        }
    }
}

/// Zero rows and errors look exactly as osquery-facts.md (sections 3.1 and 4) describes.
#[tokio::test]
async fn the_stand_in_prints_osquerys_empty_and_error_output() {
    let bed = GuestBed::new();
    bed.add_ct(141);
    let empty = osqueryi(
        &bed,
        141,
        "SELECT id FROM systemd_units WHERE active_state = 'failed'",
    )
    .await;
    assert_eq!(empty.exit, GuestExit::Exited(0));
    assert_eq!(empty.stdout.bytes, b"[\n\n]\n");

    let unknown = osqueryi(&bed, 141, "SELECT * FROM no_such_table").await;
    assert_eq!(unknown.exit, GuestExit::Exited(1));
    assert_eq!(unknown.stdout.bytes, b"[\n\n]\n");
    assert_eq!(
        unknown.stderr.text(),
        "Error: no such table: no_such_table\n"
    );

    let syntax = osqueryi(&bed, 141, "SELECT FROM os_version").await;
    assert_eq!(syntax.exit, GuestExit::Exited(1));
    assert_eq!(syntax.stderr.text(), "Error: near \"FROM\": syntax error\n");

    let one = osqueryi(&bed, 141, "SELECT version FROM osquery_info").await;
    assert_eq!(one.stdout.text(), "[\n  {\"version\":\"5.23.1\"}\n]\n");
}
