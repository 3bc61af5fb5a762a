//! The tree's shape, checked on the source: within a crate, no module reaches back to a
//! module that reaches it (directly or through others; and within a folder module, no file
//! reaches back through `super::` either), so that each module can be read,
//! tested and replaced on its own. Only `crate::` paths count between a crate's modules
//! and `super::` paths between a folder's files (that is how they name each other in this
//! tree); a name that is not a module (a re-export at the root) is not an edge.

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
    paths_after(code, "crate::")
}

/// The first segment of every path in `code` that starts with `prefix` (`crate::`,
/// `super::`), groups included.
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // e.g. `some_crate::`, `super::super::`
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

/// The files of a folder module (`src/engine/`) and the siblings each names through
/// `super::`: the same rule one floor down.
fn sibling_graph(dir: &Path) -> Graph {
    let stems: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_owned()))
        .collect();
    let mut graph = Graph::new();
    for m in &stems {
        let code = without_comments(&std::fs::read_to_string(dir.join(format!("{m}.rs"))).unwrap());
        let names = paths_after(&code, "super::");
        let uses = names.into_iter().filter(|n| n != m && stems.contains(n));
        graph.insert(m.clone(), uses.collect());
    }
    graph
}

fn folders(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
        if e.path().is_dir() {
            out.push(e.path());
            folders(&e.path(), out);
        }
    }
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
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut report = Vec::new();
    let mut crates = 0;
    let dirs = ["crates", "testbeds"].map(|d| std::fs::read_dir(root.join(d)).unwrap());
    for e in dirs.into_iter().flatten().map(Result::unwrap) {
        let src = e.path().join("src");
        if !src.is_dir() {
            continue;
        }
        crates += 1;
        for c in cycles(&module_graph(&src)) {
            report.push(format!("{}: {c}", e.file_name().to_string_lossy()));
        }
        let mut dirs = Vec::new();
        folders(&src, &mut dirs);
        for d in dirs {
            for c in cycles(&sibling_graph(&d)) {
                report.push(format!("{}: {c}", d.display()));
            }
        }
    }
    assert!(
        crates >= 10,
        "only {crates} crates under {}/{{crates,testbeds}}",
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
    let code = "use super::{rescue::Rescue, push};\nsuper::ring::x(); a_super::no();";
    assert_eq!(paths_after(code, "super::"), ["rescue", "push", "ring"]);
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

/// What of a comment reads as the lab notebook rather than a rule: a date
/// (`2026-12-02`) or a run count (`5 of 16 PostgreSQL runs`). A rule's comment states
/// the rule and points to `benches/RESULTS.md`, which keeps the dates and the counts.
fn lab_story(comment: &str) -> Option<String> {
    let b = comment.as_bytes();
    let digits = |at: usize, n: usize| {
        b.get(at..at + n)
            .is_some_and(|s| s.iter().all(u8::is_ascii_digit))
    };
    for i in 0..b.len() {
        let starts_word = i == 0 || !b[i - 1].is_ascii_alphanumeric();
        if starts_word
            && digits(i, 4)
            && b.get(i + 4) == Some(&b'-')
            && digits(i + 5, 2)
            && b.get(i + 7) == Some(&b'-')
            && digits(i + 8, 2)
        {
            return Some(comment[i..i + 10].to_owned());
        }
    }
    let words: Vec<&str> = comment
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    for (i, w) in words.iter().enumerate() {
        let number = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
        if number(w)
            && words.get(i + 1) == Some(&"of")
            && words.get(i + 2).is_some_and(|s| number(s))
        {
            let tail = &words[i + 3..(i + 6).min(words.len())];
            if tail
                .iter()
                .any(|t| matches!(*t, "runs" | "reps" | "repetitions"))
            {
                return Some(words[i..(i + 6).min(words.len())].join(" "));
            }
        }
    }
    None
}

/// The source files of the product's crates: `crates/` (the test beds, whose comments may
/// tell the lab's story, live in `testbeds/`).
fn product_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&root).unwrap().map(Result::unwrap) {
        if e.path().join("src").is_dir() {
            rust_files(&e.path().join("src"), &mut files);
        }
    }
    assert!(files.len() > 50, "only {} product files", files.len());
    files
}

#[test]
fn product_comments_carry_no_dates_or_run_counts() {
    let files = product_files();
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in text.lines().enumerate() {
            if let Some((_, comment)) = line.split_once("//") {
                if let Some(story) = lab_story(comment) {
                    found.push(format!("{}:{}: {story}", f.display(), n + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "lab notebook in product comments (state the rule, point to benches/RESULTS.md):\n{}",
        found.join("\n")
    );
}

#[test]
fn dates_and_run_counts_are_found_and_rules_are_not() {
    assert_eq!(
        lab_story(" measured on 2026-12-02: ").as_deref(),
        Some("2026-12-02")
    );
    assert!(lab_story(" it helped in 5 of 16 PostgreSQL runs").is_some());
    assert!(lab_story(" lost in 4 of 26 runs").is_some());
    assert_eq!(lab_story(" one of 2 vCPUs, 10-20 ms, 1.3x"), None);
    assert_eq!(lab_story(" slot 1 of 4 entries"), None);
    assert_eq!(lab_story(" v2026-12-02x"), None);
}

/// The longest function a reader should have to hold in mind at once.
const MAX_FN_LINES: usize = 100;

fn indent(line: &str) -> &str {
    &line[..line.len() - line.trim_start().len()]
}

/// Functions with a body (name, first line, length in lines) outside `#[cfg(test)]`
/// modules. The tree is rustfmt-formatted (`make lint`), so a body ends at the first
/// line that is a `}` at its signature's indent; that is all the parsing needed.
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let closes = |from: usize, at: &str| {
        (from..lines.len()).find(|&j| lines[j].strip_prefix(at) == Some("}"))
    };
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let code = line.trim_start();
        if code == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|l| l.trim_start().starts_with("mod "))
        {
            i = closes(i + 1, indent(lines[i + 1])).map_or(lines.len(), |j| j + 1);
            continue;
        }
        let sig = [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
            "extern \"C\" ",
        ]
        .iter()
        .fold(code, |c, p| c.strip_prefix(p).unwrap_or(c));
        if let Some(rest) = sig.strip_prefix("fn ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            // The signature may run over several lines; it ends with `{` or, without a body, `;`.
            let end = (i..lines.len()).find(|&j| lines[j].trim_end().ends_with(['{', ';']));
            if let Some(open) = end.filter(|&j| lines[j].trim_end().ends_with('{')) {
                if let Some(close) = closes(open, indent(line)) {
                    found.push((name, i + 1, close - i + 1));
                }
            }
        }
        i += 1;
    }
    found
}

#[test]
fn no_product_function_is_over_100_lines() {
    let mut long = Vec::new();
    for f in product_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        for (name, line, len) in functions(&text) {
            if len > MAX_FN_LINES {
                long.push(format!("{}:{line}: {name}, {len} lines", f.display()));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines (split them into named steps):\n{}",
        long.join("\n")
    );
}

#[test]
fn functions_are_measured_and_tests_and_declarations_are_not() {
    let text = "\
pub fn short(a: u32) -> u32 {
    a
}

trait T {
    fn declared(&self);
    fn provided(&self) {
        let _ = 1;
    }
}

pub(crate) fn spread(
    a: u32,
) -> u32 {
    if a > 0 {
        a
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    fn helper() {}
}
";
    assert_eq!(
        functions(text),
        [
            ("short".to_string(), 1, 3),
            ("provided".to_string(), 7, 3),
            ("spread".to_string(), 12, 9),
        ]
    );
}
