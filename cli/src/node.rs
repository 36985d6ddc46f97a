//! `oomscope node`: the flags become the watcher's config; the watcher
//! itself is the supervisor crate's `node` module.

use crate::args::NodeArgs;

pub fn run(args: NodeArgs) -> anyhow::Result<i32> {
    oomscope_supervisor::node::watch(oomscope_supervisor::node::NodeConfig {
        collector_url: args.collector.collector,
        cgroup_root: args.cgroup_root,
        interval: args.interval,
        max_cgroups: args.max_cgroups,
        kmsg_path: args.kmsg,
        flush_timeout: args.flush_timeout,
    })
}
