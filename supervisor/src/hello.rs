//! The supervisor's Hello: its identity (the instance every process it
//! starts joins), the child's command line and GPUs, and the memory
//! variables the child inherits.

use oomscope_agent_core::agent::Identity;
use oomscope_agent_core::pb;
use oomscope_agent_core::readers::HostReader;

use crate::config::RunConfig;

/// The Hello label that says whether the kernel's OOM records can be read:
/// `"readable"`, or `"unreadable: <reason>"` (an unprivileged container).
pub const KERNEL_LOG_LABEL: &str = "kernel_log";

/// The supervisor's Hello; its cgroup is the child's where it is read before the
/// supervisor leaves (see `restarts::run`).
pub(crate) fn hello(cfg: &RunConfig, me: &HostReader) -> pb::Hello {
    let mut hello = Identity {
        name: cfg.name.clone(),
        role: oomscope_proto::Role::Supervisor.into(),
        rank: 0,
        runtime: "supervisor".into(), // vocab: the runtime's name
    }
    .hello(me);
    // Its CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER are the child's: the
    // child inherits them (`child::run_once` adds only OOMSCOPE_* variables).
    // The supervisor is its instance: every process it starts joins it.
    hello.instance = hello.agent_id.clone();
    hello.gpus = me.gpu().placements();
    hello.command = cfg.command.clone();
    hello
        .labels
        .extend(memory_env_labels(|name| std::env::var(name).ok()));
    hello
}

/// The memory variables the child inherits (`settings::MEMORY_ENV`, e.g.
/// `VLLM_CPU_KVCACHE_SPACE`), as Hello labels `env.NAME`: the analysis reads
/// them with the command line, so that a fix can name their values.
fn memory_env_labels(get: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    oomscope_analysis::settings::MEMORY_ENV
        .iter()
        .filter_map(|name| {
            get(name).map(|v| {
                (
                    format!("{}{name}", oomscope_analysis::settings::ENV_LABEL_PREFIX),
                    v,
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_variables_become_env_labels() {
        let labels = memory_env_labels(|name| {
            (name == "VLLM_CPU_KVCACHE_SPACE" || name == "HOME").then(|| "1".to_string())
        });
        assert_eq!(
            labels,
            [("env.VLLM_CPU_KVCACHE_SPACE".to_string(), "1".to_string())]
        );
    }
}
