//! The agent's modules depend one way: from the front ends down (README, "Layout").
//!
//! This reads every source file under `agent/src`, finds each `crate::…` and `super::…` path
//! outside comments and `#[cfg(test)]` modules, resolves it to the module it names, and checks:
//! - every top-level module is in [`LAYERS`], and uses only modules of a lower layer (or of its
//!   own layer where the table lets it): the hub never uses the command line, the service never
//!   uses either door, `pve` never uses `guest`, `inventory` never uses `vmid`;
//! - the graph of all modules (files) has no cycle.
//!
//! Run it alone with `cargo test -p felhom-tests --test module_deps`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use felhom_tests::guestbed::repo_root;

/// The layers, top first. A module may use modules of the layers below its own, and the
/// modules named beside it in its own layer entry's list.
const LAYERS: &[&[&str]] = &[
    &["cli"],
    &["hub"],
    &["service", "doctor"],
    &["metrics"],
    &["preflight"],
    &["exec_helper"],
    &["provision"],
    &["guest"],
    &["pve"],
    &["vmid"],
    &[
        "inventory",
        "tls",
        "durable_log",
        "privdrop",
        "lab_kernel",
        "outbox_keep",
    ],
    &["config"],
    &["error", "timefmt", "nofollow"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The module path of a source file (`hub/session.rs` → `hub::session`, `hub/mod.rs` → `hub`,
/// `lib.rs` → the crate root, ``), or `None` for files that are not library modules.
fn module_of(src: &Path, file: &Path) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    match last.as_str() {
        "main.rs" if parts.is_empty() => return None,
        "lib.rs" if parts.is_empty() => {}
        "mod.rs" => {}
        // A test module in its own file belongs to the tests, not to the dependency graph.
        "tests.rs" => return None,
        other => parts.push(other.strip_suffix(".rs")?.to_string()),
    }
    Some(parts)
}

/// The code of a file without line comments and without its `#[cfg(test)] mod tests` block
/// (tests may reach anywhere).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            if let Some(next) = lines.peek() {
                if next.trim_start().starts_with("mod tests") {
                    break;
                }
            }
        }
        if t.starts_with("//") {
            continue;
        }
        let code = match line.find("//") {
            // Keep `://` of URLs in strings; drop a trailing comment otherwise.
            Some(i) if !line[..i].ends_with(':') => &line[..i],
            _ => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Parse a path tree after `crate::` or `super::`: `a::b::C`, `a::{b, c::d}`, `{a, b}`.
/// Returns every full path it names.
fn paths_at(text: &str) -> Vec<Vec<String>> {
    fn tree(chars: &[char], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let skip_ws = |i: &mut usize| {
            while *i < chars.len() && chars[*i].is_whitespace() {
                *i += 1;
            }
        };
        skip_ws(i);
        if *i < chars.len() && chars[*i] == '{' {
            *i += 1;
            loop {
                skip_ws(i);
                if *i >= chars.len() || chars[*i] == '}' {
                    *i += 1;
                    return;
                }
                tree(chars, i, prefix.clone(), out);
                skip_ws(i);
                if *i < chars.len() && chars[*i] == ',' {
                    *i += 1;
                }
            }
        }
        let mut path = prefix;
        loop {
            let start = *i;
            while *i < chars.len() && is_ident(chars[*i]) {
                *i += 1;
            }
            if *i == start {
                break;
            }
            path.push(chars[start..*i].iter().collect());
            if chars.get(*i) == Some(&':') && chars.get(*i + 1) == Some(&':') {
                *i += 2;
                if chars.get(*i) == Some(&'{') {
                    tree(chars, i, path.clone(), out);
                    out.push(path);
                    return;
                }
                continue;
            }
            break;
        }
        // `as Name` and the rest of a group entry.
        while *i < chars.len() && !matches!(chars[*i], ',' | '}' | ';') && chars[*i] != '\n' {
            if !is_ident(chars[*i]) && !chars[*i].is_whitespace() {
                break;
            }
            *i += 1;
        }
        out.push(path);
    }
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    tree(&chars, &mut i, Vec::new(), &mut out);
    out
}

/// Every module `code` (of the module `me`, whose file is a `mod.rs` or `lib.rs` when
/// `is_dir_module`) refers to, resolved against the known modules.
fn references(
    code: &str,
    me: &[String],
    is_dir_module: bool,
    modules: &BTreeSet<Vec<String>>,
) -> BTreeSet<Vec<String>> {
    let mut found = BTreeSet::new();
    for (anchor, base) in [
        ("crate::", Vec::new()),
        ("super::", {
            // `super` of a file module is its folder's module; of a folder module, the parent.
            let mut b = me.to_vec();
            if is_dir_module || !b.is_empty() {
                b.pop();
            }
            b
        }),
    ] {
        let mut from = 0;
        while let Some(pos) = code[from..].find(anchor) {
            let at = from + pos;
            from = at + anchor.len();
            // Not the tail of another identifier (`my_crate::`).
            if at > 0 && code[..at].chars().next_back().is_some_and(is_ident) {
                continue;
            }
            for rel in paths_at(&code[from..]) {
                let mut full = base.clone();
                full.extend(rel);
                // The longest prefix that is a module.
                let target = (0..=full.len())
                    .rev()
                    .map(|n| full[..n].to_vec())
                    .find(|p| modules.contains(p));
                if let Some(t) = target {
                    if t != me && !t.is_empty() {
                        found.insert(t);
                    }
                }
            }
        }
    }
    found
}

struct Graph {
    edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
}

fn graph() -> Graph {
    let src = repo_root().join("agent/src");
    let mut files = Vec::new();
    files.extend(felhom_tests::rust_files(&src));
    let mut by_module = BTreeMap::new();
    for f in &files {
        if let Some(m) = module_of(&src, f) {
            let is_dir = f
                .file_name()
                .is_some_and(|n| n == "mod.rs" || n == "lib.rs");
            by_module.insert(m, (f.clone(), is_dir));
        }
    }
    let modules: BTreeSet<Vec<String>> = by_module.keys().cloned().collect();
    let mut edges = BTreeMap::new();
    for (m, (f, is_dir)) in &by_module {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        edges.insert(m.clone(), references(&code_of(&text), m, *is_dir, &modules));
    }
    Graph { edges }
}

fn name(m: &[String]) -> String {
    m.join("::")
}

#[test]
fn the_parser_finds_grouped_nested_and_renamed_paths() {
    let modules: BTreeSet<Vec<String>> = [
        vec!["a".to_string()],
        vec!["a".to_string(), "x".to_string()],
        vec!["b".to_string()],
        vec!["c".to_string()],
        vec!["d".to_string()],
    ]
    .into_iter()
    .collect();
    let code = "use crate::{a::x::{One, Two}, b::Three as T};\nfn f() { crate::c::go(); }\n\
                let s = \"my_crate::d::no\";\n";
    let got: Vec<String> = references(code, &["z".to_string()], false, &modules)
        .iter()
        .map(|m| name(m))
        .collect();
    assert_eq!(got, ["a::x", "b", "c"]);
    // `super::` from a file module names its siblings.
    let me = vec!["a".to_string(), "x".to_string()];
    let got: Vec<String> = references(
        "use super::super::b::Z;\nuse super::Y;\n",
        &me,
        false,
        &modules,
    )
    .iter()
    .map(|m| name(m))
    .collect();
    assert_eq!(got, ["a"], "super::Y from a::x is an item of a");
    assert!(code_of("// use crate::b::X;\nfn f() {}\n")
        .find("crate::")
        .is_none());
}

#[test]
fn top_level_modules_depend_only_downwards() {
    let g = graph();
    let mut violations = Vec::new();
    let mut unknown = BTreeSet::new();
    for (from, tos) in &g.edges {
        let Some(top) = from.first() else { continue };
        let Some(from_layer) = layer_of(top) else {
            unknown.insert(top.clone());
            continue;
        };
        for to in tos {
            let target = &to[0];
            if target == top {
                continue;
            }
            match layer_of(target) {
                None => {
                    unknown.insert(target.clone());
                }
                Some(l) if l > from_layer => {}
                Some(_) => violations.push(format!("{} uses {}", name(from), name(to))),
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "modules missing from LAYERS (add them where they belong): {unknown:?}"
    );
    assert!(
        violations.is_empty(),
        "dependencies that point up or sideways:\n  {}",
        violations.join("\n  ")
    );
    // The table is not vacuous: the doors really use what is below them.
    let uses = |a: &str, b: &str| {
        g.edges
            .iter()
            .any(|(f, t)| f.first().is_some_and(|x| x == a) && t.iter().any(|m| m[0] == b))
    };
    assert!(uses("cli", "service") && uses("hub", "service") && uses("service", "provision"));
}

#[test]
fn no_module_cycle() {
    let g = graph();
    // Depth-first search with colours; report the first cycle's path.
    #[derive(Clone, Copy, PartialEq)]
    enum Colour {
        White,
        Grey,
        Black,
    }
    let mut colour: BTreeMap<&Vec<String>, Colour> =
        g.edges.keys().map(|k| (k, Colour::White)).collect();
    fn visit<'a>(
        n: &'a Vec<String>,
        g: &'a Graph,
        colour: &mut BTreeMap<&'a Vec<String>, Colour>,
        stack: &mut Vec<&'a Vec<String>>,
    ) -> Option<Vec<String>> {
        colour.insert(n, Colour::Grey);
        stack.push(n);
        for m in g.edges.get(n).into_iter().flatten() {
            match colour.get(m).copied().unwrap_or(Colour::Black) {
                Colour::Grey => {
                    let start = stack.iter().position(|s| *s == m).unwrap_or(0);
                    let mut cycle: Vec<String> = stack[start..].iter().map(|s| name(s)).collect();
                    cycle.push(name(m));
                    return Some(cycle);
                }
                Colour::White => {
                    if let Some(c) = visit(m, g, colour, stack) {
                        return Some(c);
                    }
                }
                Colour::Black => {}
            }
        }
        stack.pop();
        colour.insert(n, Colour::Black);
        None
    }
    let nodes: Vec<&Vec<String>> = g.edges.keys().collect();
    for n in nodes {
        if colour[n] == Colour::White {
            let mut stack = Vec::new();
            if let Some(cycle) = visit(n, &g, &mut colour, &mut stack) {
                panic!("import cycle: {}", cycle.join(" -> "));
            }
        }
    }
    assert!(g.edges.len() > 30, "only {} modules found", g.edges.len());
}
