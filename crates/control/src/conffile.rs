//! The shipped configuration file of both programs: every key commented out under a line
//! that says what it does, so that the defaults live in the program and a new release's
//! defaults reach every machine whose file sets nothing (as irqbalance, tuned and
//! node_exporter ship theirs).

/// `dump` (the defaults as `toml::to_string_pretty` writes them) with every key commented
/// out under its doc lines from `key_docs` (by `section.key`) and each section header
/// under its doc lines from `section_docs`. A header stays active unless
/// `commented_section` says otherwise (an empty table sets nothing); keys in `skip` (by
/// path) are left out for the caller to show by example. Pure.
pub fn commented_defaults(
    dump: &str,
    key_docs: &[(&str, &str)],
    section_docs: &[(&str, &str)],
    commented_section: impl Fn(&str) -> bool,
    skip: &[&str],
) -> String {
    let mut out = String::new();
    let mut section = String::new();
    let doc = |out: &mut String, docs: &[(&str, &str)], path: &str| {
        if let Some((_, d)) = docs.iter().find(|(k, _)| *k == path) {
            for l in d.lines() {
                out.push_str(&format!("# {l}\n"));
            }
        }
    };
    for line in dump.lines() {
        let line = line.trim_end();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_owned();
            out.push('\n');
            doc(&mut out, section_docs, &section);
            let hash = if commented_section(&section) { "#" } else { "" };
            out.push_str(&format!("{hash}{line}\n"));
            continue;
        }
        let Some((key, _)) = line.split_once(" = ") else {
            continue;
        };
        let path = key_path(&section, key);
        if skip.contains(&path.as_str()) {
            continue;
        }
        doc(&mut out, key_docs, &path);
        out.push_str(&format!("#{line}\n"));
    }
    out
}

/// `section.key`, or `key` at the top.
fn key_path(section: &str, key: &str) -> String {
    if section.is_empty() {
        key.to_owned()
    } else {
        format!("{section}.{key}")
    }
}

/// The keys of `dump` (as `commented_defaults` reads it) that have no line in `key_docs`,
/// `skip` aside: the tests of both programs hold this empty.
pub fn undocumented(dump: &str, key_docs: &[(&str, &str)], skip: &[&str]) -> Vec<String> {
    let mut section = String::new();
    let mut missing = Vec::new();
    for line in dump.lines() {
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.to_owned();
            continue;
        }
        let Some((key, _)) = line.split_once(" = ") else {
            continue;
        };
        let path = key_path(&section, key);
        if !skip.contains(&path.as_str()) && !key_docs.iter().any(|(k, _)| *k == path) {
            missing.push(path);
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_commented_under_their_docs_and_headers_kept() {
        let dump = "a = 1\nskipped = []\n\n[s]\nb = \"x\"\n\n[hidden]\nc = true\n";
        let text = commented_defaults(
            dump,
            &[("a", "The a.\nTwo lines."), ("s.b", "The b.")],
            &[("s", "Section s.")],
            |s| s == "hidden",
            &["skipped"],
        );
        assert_eq!(
            text,
            "# The a.\n# Two lines.\n#a = 1\n\n# Section s.\n[s]\n# The b.\n#b = \"x\"\n\n#[hidden]\n#c = true\n"
        );
        assert_eq!(
            undocumented(dump, &[("a", ""), ("s.b", "")], &["skipped"]),
            vec!["hidden.c"]
        );
    }
}
