//! `oomscope run`: the flags become the supervisor's config; the supervisor
//! itself is the oomscope-supervisor crate.

use crate::args::RunArgs;

pub fn run(args: RunArgs) -> anyhow::Result<i32> {
    let name = args.name.unwrap_or_else(|| default_name(&args.command));
    oomscope_supervisor::run(oomscope_supervisor::RunConfig {
        command: args.command,
        name,
        collector_url: args.collector.collector,
        restart: args.restart,
        backoff_initial: args.backoff,
        backoff_max: args.backoff_max,
        interval: args.interval,
        stderr_tail_bytes: oomscope_supervisor::DEFAULT_STDERR_TAIL_BYTES,
        flush_timeout: args.flush_timeout,
        spool_dir: args.spool,
        memory_limit_bytes: args.memory_limit,
    })
}

/// The agent's name without `--name`: the command's file name.
fn default_name(command: &[String]) -> String {
    std::path::Path::new(&command[0])
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| command[0].clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_name_is_the_commands_file_name() {
        let name = |c: &[&str]| default_name(&c.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(name(&["/usr/bin/python3", "server.py"]), "python3");
        assert_eq!(name(&["vllm", "serve"]), "vllm");
        // No file name to take: the command as given.
        assert_eq!(name(&[".."]), "..");
    }
}
