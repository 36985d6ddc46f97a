//! The cause a runtime names in its own words: the stderr text matched an
//! entry of the table in `crate::runtime_text` that names a cause (the KV
//! reservation, a KV cache too small for the context, a prefill batch, ...).

use super::cause;
use crate::domain::DomainVerdict;
use crate::findings::Findings;
use crate::pb;

/// The runtime said what ran out and why. Where the verdict names another
/// domain (a kernel kill, a cgroup limit), the text is a lesser witness.
pub fn runtime_text(f: &Findings, v: &DomainVerdict) -> Option<pb::Cause> {
    let m = f.text.as_ref()?;
    let kind = m.text.cause?;
    let confidence = if f.text_domain == Some(v.domain) {
        0.9
    } else {
        0.5
    };
    let evidence = vec![
        format!("{} said: {}", m.text.runtime, m.line),
        format!("{}: {}", m.text.runtime, m.text.meaning),
    ];
    Some(cause(kind, confidence, evidence, &[]))
}
