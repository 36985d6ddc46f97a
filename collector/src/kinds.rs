//! The kinds of incident, as `oomscope incidents` names them: the names of
//! [`IncidentKind`] (whose variants say what each means), as constants that
//! detection (`incidents`) and correlation (`correlate`) match on.

use oomscope_proto::IncidentKind;

pub const OOM: &str = IncidentKind::Oom.as_str();
pub const SIGNAL: &str = IncidentKind::Signal.as_str();
pub const MEMBER_DIED: &str = IncidentKind::MemberDied.as_str();
pub const MEMBER_FAILED: &str = IncidentKind::MemberFailed.as_str();
pub const EXIT_OOM_TEXT: &str = IncidentKind::ExitOomText.as_str();
pub const FAILED_START: &str = IncidentKind::FailedStart.as_str();
pub const CRASH_LOOP: &str = IncidentKind::CrashLoop.as_str();
pub const AGENT_LOST: &str = IncidentKind::AgentLost.as_str();
pub const RESTART_STORM: &str = IncidentKind::RestartStorm.as_str();
pub const KERNEL_OOM_KILL: &str = IncidentKind::KernelOomKill.as_str();
pub const MASS_DISCONNECT: &str = IncidentKind::MassDisconnect.as_str();
