//! How a command line starts its program: directly (`vllm serve`,
//! `llama-server`), or through an interpreter or launcher that runs a module
//! (`python3.11 -X dev -m llama_cpp.server`, `uv run --with x python -m
//! sglang.launch_server`, `uv run -m vllm.entrypoints.openai.api_server`).
//! The launcher's own words (the interpreter, its options, `-m` and the
//! module) say which program runs, never how it is set.

/// Where the program's own words start, and the module the interpreter runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Launch {
    /// Words before this index belong to the launcher (`python3 -m mod`),
    /// or are the program itself (`vllm`, `script.py`).
    pub program_end: usize,
    /// Index of the program's name (`vllm`, the script), where not a module.
    pub program: Option<usize>,
    /// `llama_cpp.server` of `python -m llama_cpp.server`.
    pub module: Option<String>,
}

/// `uv run` options that take a value (the rest are switches).
const UV_VALUED: &[&str] = &[
    "--with",
    "--with-editable",
    "--with-requirements",
    "--python",
    "-p",
    "--project",
    "--directory",
    "--env-file",
    "--extra",
    "--group",
    "--only-group",
    "--no-group",
    "--index",
    "--default-index",
    "--index-url",
    "--extra-index-url",
    "--package",
    "--script",
    "--config-file",
    "--cache-dir",
];

/// Python's options that take a value, alone or attached (`-X dev`, `-Xdev`).
const PYTHON_VALUED: &[char] = &['X', 'W', 'c', 'm'];

fn base(word: &str) -> &str {
    word.rsplit('/').next().unwrap_or(word)
}

/// `python`, `python3`, `python3.11`, `/venv/bin/python3` (not `python-foo`).
pub fn is_python(word: &str) -> bool {
    base(word)
        .strip_prefix("python")
        .is_some_and(|rest| rest.chars().all(|c| c.is_ascii_digit() || c == '.'))
}

/// Reads the launcher words of `command`.
pub fn read(command: &[String]) -> Launch {
    let mut i = 0;
    if command.first().is_some_and(|w| base(w) == "uv")
        && command.get(1).is_some_and(|w| w == "run")
    {
        i = 2;
        while let Some(w) = command.get(i).filter(|w| w.starts_with('-')) {
            if w == "-m" || w == "--module" {
                return module_at(command, i + 1);
            }
            if w == "--" {
                i += 1;
                break;
            }
            i += if UV_VALUED.contains(&w.as_str()) {
                2
            } else {
                1
            };
        }
    }
    match command.get(i) {
        Some(w) if is_python(w) => python(command, i + 1),
        Some(_) => Launch {
            program_end: i + 1,
            program: Some(i),
            module: None,
        },
        None => Launch {
            program_end: command.len(),
            ..Default::default()
        },
    }
}

/// The interpreter's options from `i`, up to the module, code or script.
fn python(command: &[String], mut i: usize) -> Launch {
    while let Some(w) = command.get(i) {
        if w == "--" {
            i += 1;
            break;
        }
        let Some(opts) = w.strip_prefix('-').filter(|o| !o.is_empty()) else {
            break;
        };
        if opts.starts_with('-') {
            // `--check-hash-based-pycs MODE` takes a value; other long options don't.
            i += if opts == "-check-hash-based-pycs" {
                2
            } else {
                1
            };
            continue;
        }
        // Bundled switches (`-uB`), ending at the first option that takes a value.
        match opts.char_indices().find(|(_, c)| PYTHON_VALUED.contains(c)) {
            Some((at, c)) => {
                let attached = &opts[at + 1..];
                let (value, next) = if attached.is_empty() {
                    (command.get(i + 1).cloned(), i + 2)
                } else {
                    (Some(attached.to_string()), i + 1)
                };
                match c {
                    'm' => {
                        return Launch {
                            program_end: next.min(command.len()),
                            program: None,
                            module: value,
                        }
                    }
                    // The code is the program: everything after it is its argv.
                    'c' => {
                        return Launch {
                            program_end: next.min(command.len()),
                            program: None,
                            module: None,
                        }
                    }
                    _ => i = next,
                }
            }
            None => i += 1,
        }
    }
    Launch {
        program_end: (i + 1).min(command.len()),
        program: (i < command.len()).then_some(i),
        module: None,
    }
}

fn module_at(command: &[String], i: usize) -> Launch {
    Launch {
        program_end: (i + 1).min(command.len()),
        program: None,
        module: command.get(i).cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn a_module_is_found_behind_any_interpreter_or_launcher() {
        let cases = [
            ("python -m llama_cpp.server --n_ctx 8", 3),
            ("python3.11 -m llama_cpp.server --n_ctx 8", 3),
            (
                "/opt/venv/bin/python3 -u -X dev -W ignore -m llama_cpp.server",
                8,
            ),
            (
                "python -Xfrozen_modules=off -OO -mllama_cpp.server --n_ctx 8",
                4,
            ),
            (
                "uv run --with llama-cpp-python python -m llama_cpp.server",
                7,
            ),
            ("uv run -m llama_cpp.server --n_ctx 8", 4),
        ];
        for (c, end) in cases {
            let l = read(&argv(c));
            assert_eq!(l.module.as_deref(), Some("llama_cpp.server"), "{c}");
            assert_eq!(l.program_end, end, "{c}");
        }
    }

    #[test]
    fn a_binary_or_a_script_is_the_program() {
        let l = read(&argv("/usr/bin/llama-server -c 8"));
        assert_eq!((l.program, l.program_end, l.module), (Some(0), 1, None));
        let l = read(&argv("python3 -u runtimes/server.py --port 1"));
        assert_eq!((l.program, l.program_end, l.module), (Some(2), 3, None));
        let l = read(&argv("uv run vllm serve m"));
        assert_eq!((l.program, l.program_end), (Some(2), 3));
        assert!(!is_python("python-config") && is_python("/v/bin/python3.12"));
    }
}
