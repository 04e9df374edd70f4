//! Every PVE endpoint the agent sends has its section in `tests/data/pve-call-map.md`, and every
//! section of the map names an endpoint the agent sends.
//!
//! The endpoints are read from the agent's request builders as text
//! (`agent/src/pve/request.rs`, module `build`): each builder's `ApiRequest::get|post|put|
//! delete(&[…])` segment list becomes a path, a string literal as itself, `kind.path()` as both
//! `lxc` and `qemu`, any other expression as `{name}` after its last field (`&vmid.to_string()`
//! → `{vmid}`, `&upid.node` → `{node}`). A builder whose request cannot be read that way, a
//! request built anywhere else under `agent/src`, or no endpoint at all fails the test: the map
//! is only worth its test while the test sees every request.
//!
//! Each section of the map is a `### \`METHOD /path\`` heading followed by its fields
//! (`**Parameters**`, `**PVE chain**`, `**Dies and checks**`, `**Bed**`, the last one starting
//! with `yes`, `no` or `partly`).
//!
//! Run it alone with `cargo test -p felhom-tests --test pve_call_map`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use felhom_tests::guestbed::{repo_root, test_data};

/// The fields every section of the map carries.
const FIELDS: [&str; 4] = [
    "**Parameters**",
    "**PVE chain**",
    "**Dies and checks**",
    "**Bed**",
];

/// The code of a Rust file without comments (line comments, doc comments and block comments;
/// string literals kept) and without everything from its first `#[cfg(test)]` line on (the
/// tests at the end of the file build requests too, for their asserts).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        out.push_str(line);
        out.push('\n');
    }
    strip_comments(&out)
}

fn strip_comments(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let mut in_str = false;
    let mut depth = 0usize;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if depth > 0 {
            if c == '*' && next == Some('/') {
                depth -= 1;
                i += 2;
            } else if c == '/' && next == Some('*') {
                depth += 1;
                i += 2;
            } else {
                if c == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            continue;
        }
        if in_str {
            out.push(c);
            if c == '\\' {
                if let Some(n) = next {
                    out.push(n);
                }
                i += 2;
                continue;
            }
            if c == '"' {
                in_str = false;
            }
            i += 1;
            continue;
        }
        match (c, next) {
            ('/', Some('/')) => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ('/', Some('*')) => {
                depth = 1;
                i += 2;
            }
            _ => {
                // A char literal holding a quote ('"') does not open a string.
                if c == '"' && !(i > 0 && chars[i - 1] == '\'' && next == Some('\'')) {
                    in_str = true;
                }
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// One endpoint: `GET /nodes/{node}/lxc/{vmid}/config`.
type Endpoint = (String, String);

fn show(e: &Endpoint) -> String {
    format!("`{} {}`", e.0, e.1)
}

/// The request constructors of `ApiRequest` and the method each sends.
const CONSTRUCTORS: [(&str, &str); 4] = [
    ("ApiRequest::get(", "GET"),
    ("ApiRequest::post(", "POST"),
    ("ApiRequest::put(", "PUT"),
    ("ApiRequest::delete(", "DELETE"),
];

/// A path segment as written in a builder: a literal, the guest kind, or a named value.
fn segment(expr: &str) -> Result<Vec<String>, String> {
    let e = expr.trim();
    if let Some(lit) = e.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
        if lit.is_empty() || lit.contains(['/', '"', '\\', '{']) {
            return Err(format!(
                "the literal segment {e} is not a plain path segment"
            ));
        }
        return Ok(vec![lit.to_string()]);
    }
    if e == "kind.path()" {
        return Ok(vec!["lxc".to_string(), "qemu".to_string()]);
    }
    let e = e.trim_start_matches('&');
    let mut parts: Vec<&str> = e.split('.').collect();
    while parts.len() > 1 && parts.last().is_some_and(|p| p.ends_with("()")) {
        parts.pop();
    }
    let name = parts.last().copied().unwrap_or("");
    let ident = !name.is_empty()
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_');
    if !ident {
        return Err(format!(
            "the segment `{expr}` is neither a literal, `kind.path()` nor a named value"
        ));
    }
    Ok(vec![format!("{{{name}}}")])
}

/// The endpoints of one `ApiRequest::<method>(&[ … ])` call starting at `at` (just after the
/// opening parenthesis).
fn endpoints_at(code: &str, at: usize, method: &str) -> Result<Vec<Endpoint>, String> {
    let rest = code[at..].trim_start();
    let list = rest
        .strip_prefix("&[")
        .ok_or_else(|| "its argument is not a literal segment list `&[…]`".to_string())?;
    let end = list
        .find(']')
        .ok_or_else(|| "its segment list does not end".to_string())?;
    let mut paths: Vec<String> = vec![String::new()];
    for expr in list[..end].split(',').filter(|s| !s.trim().is_empty()) {
        let options = segment(expr)?;
        paths = paths
            .iter()
            .flat_map(|p| options.iter().map(move |o| format!("{p}/{o}")))
            .collect();
    }
    if paths.iter().any(String::is_empty) {
        return Err("its segment list is empty".to_string());
    }
    Ok(paths.into_iter().map(|p| (method.to_string(), p)).collect())
}

/// The endpoints each builder of `mod build` names: builder → endpoints. Every problem (a
/// builder whose request cannot be read) is returned in `problems`.
fn builder_endpoints(code: &str, problems: &mut Vec<String>) -> BTreeMap<String, Vec<Endpoint>> {
    let mut out = BTreeMap::new();
    let Some(start) = code.find("pub mod build {") else {
        problems.push("agent/src/pve/request.rs has no `pub mod build { … }`".to_string());
        return out;
    };
    let build = &code[start..];
    for chunk in build.split("pub fn ").skip(1) {
        let name: String = chunk
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let signature = chunk.split('{').next().unwrap_or("");
        if !signature.contains("-> ApiRequest") {
            continue;
        }
        let mut found = Vec::new();
        for (ctor, method) in CONSTRUCTORS {
            let mut from = 0;
            while let Some(pos) = chunk[from..].find(ctor) {
                let at = from + pos + ctor.len();
                match endpoints_at(chunk, at, method) {
                    Ok(mut e) => found.append(&mut e),
                    Err(why) => problems.push(format!("build::{name}: {why}")),
                }
                from = at;
            }
        }
        if found.is_empty() {
            problems.push(format!(
                "build::{name} returns an ApiRequest but builds none with \
                 `ApiRequest::get|post|put|delete(&[…])`; build it that way so this test sees \
                 its endpoint"
            ));
        }
        out.insert(name, found);
    }
    out
}

/// Whether a line holds an `ApiRequest { … }` struct literal (not a function returning one:
/// `-> ApiRequest {`).
fn struct_literal(line: &str) -> bool {
    line.match_indices("ApiRequest {").any(|(at, _)| {
        let before = line[..at]
            .trim_end_matches(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':')
            .trim_end();
        !before.ends_with("->")
    })
}

/// Every place under `agent/src` outside `request.rs` that builds a request itself.
fn requests_built_elsewhere(src: &Path, request_rs: &Path) -> Vec<String> {
    let root = repo_root();
    let mut files = Vec::new();
    files.extend(felhom_tests::rust_files(src));
    let mut found = Vec::new();
    for f in files {
        if f == request_rs {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        // The whole file, its tests included: a test that builds a request by hand is one
        // more request the map cannot see.
        let code = strip_comments(&text);
        for (n, line) in code.lines().enumerate() {
            let builds = CONSTRUCTORS.iter().any(|(c, _)| line.contains(c))
                || struct_literal(line)
                || line.contains("ApiRequest::new(");
            if builds {
                found.push(format!(
                    "{}:{}: {}",
                    f.strip_prefix(&root).unwrap_or(&f).display(),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    found
}

/// The map's sections: endpoint → the section's text (heading excluded).
fn map_sections(map: &str, problems: &mut Vec<String>) -> BTreeMap<Endpoint, String> {
    let mut out: BTreeMap<Endpoint, String> = BTreeMap::new();
    let mut current: Option<Endpoint> = None;
    for line in map.lines() {
        if let Some(heading) = line.strip_prefix("### ") {
            let inner = heading.split('`').nth(1).map(str::trim).unwrap_or_default();
            let mut words = inner.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some(m), Some(p), None)
                    if ["GET", "POST", "PUT", "DELETE"].contains(&m) && p.starts_with('/') =>
                {
                    let e = (m.to_string(), p.to_string());
                    if out.contains_key(&e) {
                        problems.push(format!("the map has two sections for {}", show(&e)));
                    }
                    out.insert(e.clone(), String::new());
                    current = Some(e);
                }
                _ => {
                    problems.push(format!(
                        "the map's heading `{line}` names no endpoint (### `METHOD /path`)"
                    ));
                    current = None;
                }
            }
            continue;
        }
        if line.starts_with("## ") || line.starts_with("# ") {
            current = None;
            continue;
        }
        if let Some(e) = &current {
            if let Some(s) = out.get_mut(e) {
                s.push_str(line);
                s.push('\n');
            }
        }
    }
    for (e, text) in &out {
        for field in FIELDS {
            if !text.contains(field) {
                problems.push(format!("the map's section {} has no {field}", show(e)));
            }
        }
        let bed = text
            .lines()
            .find_map(|l| l.split_once("**Bed**:").map(|(_, r)| r.trim().to_string()));
        if let Some(b) = bed {
            if !["yes", "no", "partly"].iter().any(|w| b.starts_with(w)) {
                problems.push(format!(
                    "the map's section {} says `**Bed**: {b}`; it must start with yes, no or \
                     partly",
                    show(e)
                ));
            }
        }
    }
    out
}

#[test]
fn every_endpoint_the_agent_sends_has_a_section_in_the_call_map() {
    let root = repo_root();
    let src = root.join("agent").join("src");
    let request_rs = src.join("pve").join("request.rs");
    let text = std::fs::read_to_string(&request_rs)
        .unwrap_or_else(|e| panic!("read {}: {e}", request_rs.display()));
    let map_path = test_data("pve-call-map.md");
    let map = std::fs::read_to_string(&map_path)
        .unwrap_or_else(|e| panic!("read {}: {e}", map_path.display()));

    let mut problems = Vec::new();
    let builders = builder_endpoints(&code_of(&text), &mut problems);
    let sent: BTreeMap<Endpoint, Vec<String>> =
        builders.iter().fold(BTreeMap::new(), |mut acc, (b, es)| {
            for e in es {
                acc.entry(e.clone())
                    .or_default()
                    .push(format!("build::{b}"));
            }
            acc
        });
    assert!(
        !sent.is_empty(),
        "no endpoint found in {}: the extraction no longer matches how the request builders \
         are written ({} builders read; problems: {problems:#?})",
        request_rs.display(),
        builders.len()
    );
    // The builders this test is known to read; fewer means the extraction lost some.
    assert!(
        builders.len() >= 20 && sent.contains_key(&("GET".to_string(), "/version".to_string())),
        "the extraction read only {} builders from {} ({:?})",
        builders.len(),
        request_rs.display(),
        builders.keys().collect::<Vec<_>>()
    );

    for place in requests_built_elsewhere(&src, &request_rs) {
        problems.push(format!(
            "a PVE request is built outside agent/src/pve/request.rs `build`, where this test \
             cannot see its endpoint: {place}; add a builder there and a section to the map"
        ));
    }

    let sections = map_sections(&map, &mut problems);
    for (e, by) in &sent {
        if !sections.contains_key(e) {
            problems.push(format!(
                "tests/data/pve-call-map.md has no section for {} (built by {}): add one with \
                 its parameters, PVE's function chain, every die and permission check on it, \
                 and whether the bed models each",
                show(e),
                by.join(", ")
            ));
        }
    }
    let sent_keys: BTreeSet<&Endpoint> = sent.keys().collect();
    for e in sections.keys() {
        if !sent_keys.contains(e) {
            problems.push(format!(
                "tests/data/pve-call-map.md has a section for {}, which no request builder \
                 names any more: remove it or correct its heading",
                show(e)
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "the PVE call map and the agent's requests disagree:\n- {}",
        problems.join("\n- ")
    );
}

#[test]
fn the_extraction_reads_each_kind_of_segment() {
    let code = r#"
pub mod build {
    /// `GET /nodes/{node}/{kind}/{vmid}/x` (a doc comment: ApiRequest::get(&["ignored"]))
    pub fn a(node: &str, kind: GuestKind, vmid: u32) -> ApiRequest {
        ApiRequest::get(&["nodes", node, kind.path(), &vmid.to_string(), "x"])
    }
    pub fn b(upid: &Upid) -> ApiRequest {
        ApiRequest::delete(&["nodes", &upid.node, "tasks", upid.as_str()])
    }
    pub fn c() -> ApiRequest {
        ApiRequest::new(Method::Get, &["hidden"])
    }
}
"#;
    let mut problems = Vec::new();
    let got = builder_endpoints(&code_of(code), &mut problems);
    let e = |m: &str, p: &str| (m.to_string(), p.to_string());
    assert_eq!(
        got.get("a"),
        Some(&vec![
            e("GET", "/nodes/{node}/lxc/{vmid}/x"),
            e("GET", "/nodes/{node}/qemu/{vmid}/x"),
        ])
    );
    assert_eq!(
        got.get("b"),
        Some(&vec![e("DELETE", "/nodes/{node}/tasks/{upid}")])
    );
    assert!(
        problems.len() == 1 && problems[0].starts_with("build::c "),
        "a builder whose request the test cannot read is a problem: {problems:?}"
    );
}
