//! The kinds of incident, as `oomscope incidents` names them. Detection
//! (`incidents`) and correlation (`correlate`) both speak them.

pub const OOM: &str = "oom";
pub const SIGNAL: &str = "signal";
/// A process of the instance other than the one `oomscope run` started (an
/// engine, a worker) was killed by a signal, as the supervisor saw.
pub const MEMBER_DIED: &str = "member_died";
/// Such a process exited with a non-zero code: it gave up, often for a
/// reason another process prints (an API server's out-of-memory text).
pub const MEMBER_FAILED: &str = "member_failed";
pub const EXIT_OOM_TEXT: &str = "exit_oom_text";
/// The child `oomscope run` started exited non-zero within the start-up
/// window (`oomscope_analysis::STARTUP_WINDOW_NS`) with no memory text: it
/// failed while starting. Failed starts of one service in a row are a crash
/// loop, whether one `oomscope run --restart N` or separate runs made them.
pub const FAILED_START: &str = "failed_start";
pub const CRASH_LOOP: &str = "crash_loop";
pub const AGENT_LOST: &str = "agent_lost";
/// Many agents of one service restarting together, then a request burst.
pub const RESTART_STORM: &str = "restart_storm";
/// The kernel's OOM killer took a process of the instance (its own record).
pub const KERNEL_OOM_KILL: &str = "kernel_oom_kill";
/// Many agents lost together: one incident, not one each (see `correlate`).
pub const MASS_DISCONNECT: &str = "mass_disconnect";
