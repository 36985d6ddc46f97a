//! The shared names are spelled once, in `proto/src/vocab.rs`: every other
//! production file of the workspace uses the enums. This test greps each
//! crate's `src/` (not tests, benches, generated code, nor `#[cfg(test)]`
//! modules) for every name as a quoted literal and names each file:line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use oomscope_proto::{CauseKind, IncidentKind, Role, TriggerKind};

/// Files that are the home of another vocabulary whose names coincide with
/// ours, and why.
const OTHER_VOCABULARIES: &[(&str, &str)] = &[(
    "analysis/src/memory_domain.rs",
    "the memory domains: \"swap_thrash\", \"external_kill\" and \"unknown\" are domains there",
)];

/// A line that spells a shared name in another sense (a JSON key, an event's
/// field name, a runtime's name) says so with this comment and why, on the
/// line or the line above: `"oom" => ..., // vocab: memory.events' key`.
const OTHER_SENSE: &str = "// vocab: ";

/// Lines where a comment marker cannot go (inside a SQL schema, which the
/// store keeps as written): the file, the text on the line, and why.
const MARKED_HERE: &[(&str, &str, &str)] = &[(
    "collector/src/store/mod.rs",
    "the Event oneof's field name, e.g. 'oom'",
    "an event's field name in the schema's comment, not the incident kind",
)];

/// Every shared name, with the enum that owns it.
fn names() -> BTreeMap<String, Vec<&'static str>> {
    let mut names: BTreeMap<String, Vec<&'static str>> = BTreeMap::new();
    let mut add = |name: &str, owner: &'static str| {
        names.entry(format!("\"{name}\"")).or_default().push(owner);
        // SQL's quotes: a Rust char literal is never a whole name.
        names.entry(format!("'{name}'")).or_default().push(owner);
    };
    CauseKind::ALL
        .iter()
        .for_each(|k| add(k.as_str(), "CauseKind"));
    IncidentKind::ALL
        .iter()
        .for_each(|k| add(k.as_str(), "IncidentKind"));
    TriggerKind::ALL
        .iter()
        .for_each(|k| add(k.as_str(), "TriggerKind"));
    Role::KNOWN.iter().for_each(|r| add(r.as_str(), "Role"));
    names
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The workspace's members, from the root Cargo.toml's `members` list.
fn members(root: &Path) -> Vec<String> {
    let toml = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let start = toml.find("members = [").expect("a members list");
    let list = &toml[start..start + toml[start..].find(']').unwrap()];
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The production lines of a file, numbered from 1: a `#[cfg(test)]`
/// module's body (up to its closing brace at column 0) is left out, and the
/// files of `#[cfg(test)] mod name;` go to `test_files`.
fn production_lines(
    path: &Path,
    text: &str,
    test_files: &mut Vec<PathBuf>,
) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        if line == "#[cfg(test)]" {
            let next = lines.get(i + 1).map(|l| l.trim()).unwrap_or("");
            let module = next.strip_prefix("pub(crate) ").unwrap_or(next);
            if let Some(name) = module
                .strip_prefix("mod ")
                .and_then(|m| m.strip_suffix(';'))
            {
                test_files.push(module_file(path, name));
            } else if module.starts_with("mod ") && module.ends_with('{') {
                // Skip to the module's closing brace (rustfmt puts it at column 0).
                i += 2;
                while i < lines.len() && lines[i] != "}" {
                    i += 1;
                }
            }
        } else if !line.starts_with("//") && !lines[i].contains(OTHER_SENSE) {
            let marked_above = i > 0 && lines[i - 1].trim().starts_with(OTHER_SENSE);
            if !marked_above {
                out.push((i + 1, lines[i].to_string()));
            }
        }
        i += 1;
    }
    out
}

/// Where `mod name;` declared in `path` lives.
fn module_file(path: &Path, name: &str) -> PathBuf {
    let dir = path.parent().unwrap();
    let stem = path.file_stem().unwrap().to_str().unwrap();
    let base = if ["mod", "lib", "main"].contains(&stem) {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    let file = base.join(format!("{name}.rs"));
    if file.exists() {
        file
    } else {
        base.join(name).join("mod.rs")
    }
}

/// "file:line: "name" (Owner)" for every quoted shared name in the lines.
fn spelled(
    file: &str,
    lines: &[(usize, String)],
    names: &BTreeMap<String, Vec<&'static str>>,
) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in lines {
        for (name, owners) in names {
            if line.contains(name.as_str()) {
                found.push(format!("{file}:{n}: {name} ({})", owners.join(", ")));
            }
        }
    }
    found
}

#[test]
fn no_production_file_spells_a_shared_name() {
    let root = workspace_root();
    let names = names();
    let mut files = Vec::new();
    for m in members(&root) {
        rust_files(&root.join(&m).join("src"), &mut files);
    }
    assert!(
        files.len() > 50,
        "the walk found only {} files",
        files.len()
    );
    let skip = |rel: &str| {
        rel == "proto/src/vocab.rs"
            || rel.starts_with("proto/src/generated/")
            || OTHER_VOCABULARIES.iter().any(|(f, _)| *f == rel)
    };
    let mut test_files = Vec::new();
    let mut per_file = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if skip(&rel) {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        per_file.push((f.clone(), rel, production_lines(f, &text, &mut test_files)));
    }
    let found: Vec<String> = per_file
        .iter()
        .filter(|(f, _, _)| !test_files.contains(f))
        .flat_map(|(_, rel, lines)| {
            let lines: Vec<(usize, String)> = lines
                .iter()
                .filter(|(_, l)| {
                    !MARKED_HERE
                        .iter()
                        .any(|(f, text, _)| f == rel && l.contains(text))
                })
                .cloned()
                .collect();
            spelled(rel, &lines, &names)
        })
        .collect();
    assert!(
        found.is_empty(),
        "{} shared names spelled as literals outside proto/src/vocab.rs; use the enums:\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn the_grep_sees_a_spelled_name_and_skips_test_modules() {
    let names = names();
    let text = "fn a() -> bool { k == \"leak\" }\n\
                // a comment may say \"leak\"\n\
                #[cfg(test)]\n\
                mod tests {\n    \
                    fn t() { let _ = \"agent_lost\"; }\n\
                }\n\
                fn b() -> &'static str { \"supervisor\" }\n\
                fn c() -> &'static str { \"oom\" } // vocab: a key\n\
                // vocab: the runtime's name\n\
                fn d() -> &'static str { \"replay\" }\n\
                fn e() -> &'static str { \"replay\" }\n";
    let mut test_files = Vec::new();
    let lines = production_lines(Path::new("x/src/a.rs"), text, &mut test_files);
    let found = spelled("x/src/a.rs", &lines, &names);
    assert_eq!(
        found,
        [
            "x/src/a.rs:1: \"leak\" (CauseKind)",
            "x/src/a.rs:7: \"supervisor\" (Role)",
            "x/src/a.rs:11: \"replay\" (Role)",
        ]
    );
    let mut tf = Vec::new();
    production_lines(
        Path::new("/r/src/reporter/mod.rs"),
        "#[cfg(test)]\nmod hold_tests;\n",
        &mut tf,
    );
    assert_eq!(tf, [PathBuf::from("/r/src/reporter/hold_tests/mod.rs")]);
}

#[test]
fn every_name_parses_back_and_an_unknown_one_is_named() {
    for k in CauseKind::ALL {
        assert_eq!(CauseKind::from_str(k.as_str()), Ok(*k));
        assert_eq!(k.to_string(), k.as_str());
    }
    for k in IncidentKind::ALL {
        assert_eq!(k.as_str().parse::<IncidentKind>(), Ok(*k));
    }
    for k in TriggerKind::ALL {
        assert_eq!(k.as_str().parse::<TriggerKind>(), Ok(*k));
    }
    for r in Role::KNOWN {
        assert_eq!(Role::parse(r.as_str()), *r);
    }
    let err = "leaks".parse::<CauseKind>().unwrap_err();
    assert_eq!(err.to_string(), "unknown cause kind \"leaks\"");
    assert!("Oom".parse::<IncidentKind>().is_err());
    // A role this build does not know round-trips as sent.
    let r = Role::parse("detokenizer");
    assert_eq!(r, Role::Other("detokenizer".into()));
    assert_eq!(String::from(r), "detokenizer");
    // No name belongs to two vocabularies of the same message field.
    let all: Vec<&str> = CauseKind::ALL.iter().map(|k| k.as_str()).collect();
    let mut dedup = all.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(all.len(), dedup.len());
}
