//! The CLI documents itself: every verb's help is a committed snapshot, no
//! argument lacks help text, and every `oomscope …` line in README.md parses
//! with the CLI's own parser, so the README cannot name a flag that is gone.

use std::process::Command as Process;

use clap::Command;

fn command() -> Command {
    let mut cmd = oomscope_cli::command();
    cmd.build();
    cmd
}

/// The verbs, as the parser knows them (clap's own `help` left out).
fn verbs() -> Vec<String> {
    command()
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .filter(|n| n != "help")
        .collect()
}

/// The verbs under `verb`, if it has any (clap's own `help` left out).
fn subverbs(verb: &str) -> Vec<String> {
    command()
        .find_subcommand(verb)
        .map(|v| {
            v.get_subcommands()
                .map(|s| s.get_name().to_string())
                .filter(|n| n != "help")
                .collect()
        })
        .unwrap_or_default()
}

/// What a user sees: the binary's `--help`, in an empty environment so that
/// no `OOMSCOPE_*` value shows up as an `[env: …]` value.
fn help_of(args: &[&str]) -> String {
    let out = Process::new(env!("CARGO_BIN_EXE_oomscope"))
        .args(args)
        .arg("--help")
        .env_clear()
        .output()
        .expect("run oomscope");
    assert!(out.status.success(), "{args:?} --help: {out:?}");
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// Help drift fails here; after a deliberate change, review and accept the
/// new snapshots (`INSTA_UPDATE=always cargo test -p oomscope --test cli_help`).
#[test]
fn every_verbs_help_is_a_snapshot() {
    insta::assert_snapshot!("help", help_of(&[]));
    for verb in verbs() {
        insta::assert_snapshot!(format!("help_{verb}"), help_of(&[&verb]));
        // A verb with verbs of its own (`bench ingest`): each one's options.
        for sub in subverbs(&verb) {
            insta::assert_snapshot!(format!("help_{verb}_{sub}"), help_of(&[&verb, &sub]));
        }
    }
}

fn args_without_help(cmd: &Command, path: &str, missing: &mut Vec<String>) {
    for a in cmd.get_arguments() {
        let id = a.get_id().as_str();
        if id == "help" || id == "version" {
            continue; // clap's own, with clap's help text
        }
        if a.get_help().is_none() && a.get_long_help().is_none() {
            missing.push(format!("{path} {id}"));
        }
    }
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let sub_path = format!("{path} {}", sub.get_name());
        if sub.get_about().is_none() && sub.get_long_about().is_none() {
            missing.push(sub_path.clone());
        }
        args_without_help(sub, &sub_path, missing);
    }
}

#[test]
fn every_argument_and_verb_has_help() {
    let mut missing = Vec::new();
    args_without_help(&command(), "oomscope", &mut missing);
    assert!(missing.is_empty(), "without help text: {missing:?}");
}

#[test]
fn every_json_flag_says_what_it_prints() {
    for sub in command().get_subcommands() {
        for a in sub.get_arguments().filter(|a| a.get_id() == "json") {
            let help = a.get_long_help().or(a.get_help()).unwrap().to_string();
            assert!(
                help.contains('{') || help.contains('['),
                "`{} --json` does not give its schema: {help:?}",
                sub.get_name()
            );
        }
    }
    assert!(help_of(&["probe"]).contains(oomscope_probe::report::SCHEMA));
}

#[test]
fn probe_help_lists_exit_codes_and_real_defaults() {
    let help = help_of(&["probe"]);
    for code in [
        "0  ok",
        "1  unsafe",
        "2  error",
        "3  environment",
        "4  incomplete",
    ] {
        assert!(help.contains(code), "probe --help lacks exit code `{code}`");
    }
    let d = oomscope_probe::ProbeConfig::new("");
    for shown in [
        format!("[default: {}]", d.max_context),
        format!("[default: {}]", d.suites.join(",")),
        format!("[default: {}]", d.restart_settings.herd),
        format!(
            "long-context {}",
            oomscope_cli::args::format_duration(
                oomscope_probe::Suite::LongContext.default_budget()
            )
        ),
    ] {
        assert!(help.contains(&shown), "probe --help lacks {shown}");
    }
}

#[test]
fn a_sampling_interval_under_10ms_is_refused() {
    let parse = |interval: &str| {
        oomscope_cli::command().try_get_matches_from([
            "oomscope",
            "run",
            "--interval",
            interval,
            "--",
            "true",
        ])
    };
    let err = parse("5ms")
        .expect_err("5ms is under the floor")
        .to_string();
    assert!(err.contains("10 ms"), "{err}");
    assert!(parse("10ms").is_ok());
    // The help states the same floor as agent-core's rule.
    let floor = oomscope_agent_core::agent::MIN_SAMPLE_INTERVAL.as_millis();
    assert!(help_of(&["run"]).contains(&format!("at least {floor} ms")));
}

/// Shell words, with quotes taken off; `;`, `|`, `&`, `<` and `>` runs are
/// tokens of their own, and an unquoted `#` starts a comment.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                in_word = true;
                for q in chars.by_ref() {
                    if q == c {
                        break;
                    }
                    cur.push(q);
                }
            }
            '#' if !in_word => break,
            c if c.is_whitespace() || ";|&<>".contains(c) => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
                if !c.is_whitespace() {
                    let mut sep = c.to_string();
                    while let Some(&n) = chars.peek().filter(|n| ";|&<>".contains(**n)) {
                        sep.push(n);
                        chars.next();
                    }
                    words.push(sep);
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    words
}

fn is_separator(w: &str) -> bool {
    !w.is_empty() && w.chars().all(|c| ";|&<>".contains(c))
}

/// The `oomscope` invocations on one shell line (also inside a quoted
/// `sh -c '…'`, and `cargo run -p oomscope -- VERB …`), each as argv.
fn invocations(line: &str) -> Vec<Vec<String>> {
    let words = shell_words(line);
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if w.contains(char::is_whitespace) {
            out.extend(invocations(w));
        }
        if w != "oomscope" {
            continue;
        }
        let prev = i.checked_sub(1).map(|p| words[p].as_str());
        let mut start = i + 1;
        match prev {
            None | Some("exec") => {}
            Some(p) if is_separator(p) => {}
            // `cargo run … -p oomscope -- VERB`
            Some("-p") if words.get(i + 1).is_some_and(|n| n == "--") => start += 1,
            _ => continue, // a mention, such as `cargo build -p oomscope`
        }
        let mut argv = vec!["oomscope".to_string()];
        argv.extend(
            words[start..]
                .iter()
                .take_while(|w| !is_separator(w))
                .cloned(),
        );
        out.push(argv);
    }
    out
}

/// Fenced code lines and inline code spans of README.md.
fn readme() -> (Vec<String>, Vec<String>) {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("read README.md");
    let (mut code, mut spans, mut fenced) = (Vec::new(), Vec::new(), false);
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            code.push(line.to_string());
        } else {
            spans.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
        }
    }
    (code, spans)
}

#[test]
fn readme_code_blocks_parse() {
    let (code, _) = readme();
    let mut checked = 0;
    for line in &code {
        for argv in invocations(line) {
            if let Err(e) = oomscope_cli::command().try_get_matches_from(&argv) {
                panic!("README.md: `{line}` does not parse as {argv:?}:\n{e}");
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 8,
        "found only {checked} oomscope lines in README.md"
    );
}

/// A synopsis (the Verbs table, or `oomscope …` in prose) has placeholders
/// such as `[--agent N]` and `(--html OUT.html \| --md)`, so it is checked
/// for its verb and flag names rather than parsed.
#[test]
fn readme_synopses_name_real_verbs_and_flags() {
    let cmd = command();
    let (_, spans) = readme();
    let mut checked = 0;
    for span in spans.iter().filter(|s| s.starts_with("oomscope ")) {
        let words: Vec<&str> = span
            .split(|c: char| c.is_whitespace() || "[]()|\\".contains(c))
            .filter(|w| !w.is_empty())
            .collect();
        let mut verb = cmd
            .find_subcommand(words[1])
            .unwrap_or_else(|| panic!("README.md: `{span}`: no verb `{}`", words[1]));
        // A verb's own verb (`bench ingest`) holds the flags.
        if let Some(sub) = words.get(2).and_then(|w| verb.find_subcommand(w)) {
            verb = sub;
        }
        for flag in words.iter().filter_map(|w| w.strip_prefix("--")) {
            let flag = flag.split('=').next().unwrap();
            if flag.is_empty() {
                continue; // `-- CMD ARGS...`
            }
            assert!(
                verb.get_arguments().any(|a| a.get_long() == Some(flag)),
                "README.md: `{span}`: `{} --{flag}` does not exist",
                verb.get_name()
            );
        }
        checked += 1;
    }
    assert!(checked >= 10, "found only {checked} synopses in README.md");
}

/// The workflow that `oomscope --help` ends with is runnable as written.
#[test]
fn the_workflow_in_help_parses() {
    let help = help_of(&[]);
    let lines: Vec<&str> = help
        .lines()
        .filter(|l| l.trim_start().starts_with("oomscope "))
        .collect();
    assert_eq!(lines.len(), 5, "{help}");
    for line in lines {
        for argv in invocations(line.trim()) {
            if let Err(e) = oomscope_cli::command().try_get_matches_from(&argv) {
                panic!("--help workflow: `{line}` does not parse:\n{e}");
            }
        }
    }
}

#[test]
fn invocations_are_found_in_shell_lines() {
    assert_eq!(
        invocations("cargo run --release -p oomscope -- collector --db x.db"),
        [["oomscope", "collector", "--db", "x.db"]]
    );
    assert_eq!(
        invocations(r#"sh -c 'echo $$ > f; exec oomscope run --name d -- python3 -c "b(1<<2)"'"#),
        [["oomscope", "run", "--name", "d", "--", "python3", "-c", "b(1<<2)"]]
    );
    assert_eq!(
        invocations("oomscope probe --json > b.json; oomscope agents  # all"),
        [
            vec!["oomscope", "probe", "--json"],
            vec!["oomscope", "agents"]
        ]
    );
    assert!(invocations("cargo build --release -p oomscope && export X=1").is_empty());
}
