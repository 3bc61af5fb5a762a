//! The tree's shape, checked on the source: within a crate, no module reaches back to a
//! module that reaches it (directly or through others), so that each module can be read,
//! tested and replaced on its own. Only `crate::` paths count (that is how modules name
//! each other in this tree); a name that is not a module of the crate (a re-export at
//! the root) is not an edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file belongs to; `None` for the crate roots and binaries.
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.to_owned();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_owned();
    (!matches!(name.as_str(), "lib" | "main" | "bin")).then_some(name)
}

/// The first segment of every `crate::` path in `code`, groups included
/// (`crate::{a::B, c}` names `a` and `c`).
fn crate_paths(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `some_crate::`
        }
        if let Some(group) = rest.strip_prefix('{') {
            // Items at the group's own level, up to its matching brace.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth > 0 => depth -= 1,
                    ',' | '}' if depth == 0 => {
                        let head: String = item
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        names.push(head);
                        item.clear();
                        if c == '}' {
                            break;
                        }
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
        } else {
            names.push(
                rest.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

fn without_comments(text: &str) -> String {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn module_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = Graph::new();
    for f in &files {
        if let Some(m) = top_module(src, f) {
            graph.entry(m).or_default();
        }
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for f in &files {
        let Some(m) = top_module(src, f) else {
            continue;
        };
        let code = without_comments(&std::fs::read_to_string(f).unwrap());
        for name in crate_paths(&code) {
            if name != m && modules.contains(&name) {
                graph.get_mut(&m).unwrap().insert(name);
            }
        }
    }
    graph
}

/// Every cycle's modules, as the path that closes it (`a -> b -> a`).
fn cycles(graph: &Graph) -> Vec<String> {
    fn visit(
        graph: &Graph,
        m: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut c = path[at..].to_vec();
            c.push(m.to_owned());
            found.push(c.join(" -> "));
            return;
        }
        if done.contains(m) {
            return;
        }
        path.push(m.to_owned());
        for next in &graph[m] {
            visit(graph, next, path, done, found);
        }
        path.pop();
        done.insert(m.to_owned());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        visit(graph, m, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

#[test]
fn no_module_cycles_in_any_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut report = Vec::new();
    let mut crates = 0;
    for e in std::fs::read_dir(&root).unwrap().map(Result::unwrap) {
        let src = e.path().join("src");
        if !src.is_dir() {
            continue;
        }
        crates += 1;
        for c in cycles(&module_graph(&src)) {
            report.push(format!("{}: {c}", e.file_name().to_string_lossy()));
        }
    }
    assert!(
        crates >= 10,
        "only {crates} crates under {}",
        root.display()
    );
    assert!(
        report.is_empty(),
        "modules that import each other:\n{}",
        report.join("\n")
    );
}

#[test]
fn paths_and_groups_are_read_as_modules() {
    let code =
        "use crate::a::X;\nuse crate::{b::{Y, Z}, c};\nlet v = crate::d::f(); other_crate::e;";
    assert_eq!(crate_paths(code), ["a", "b", "c", "d"]);
}

#[test]
fn a_cycle_of_three_is_found_and_a_chain_is_not() {
    let g = |edges: &[(&str, &str)]| {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(
        cycles(&g(&[("a", "b"), ("b", "c"), ("c", "a")])),
        ["a -> b -> c -> a"]
    );
    assert!(cycles(&g(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
}
