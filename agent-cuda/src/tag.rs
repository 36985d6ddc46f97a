//! What a live block is for: the tag every allocation carries.

use std::fmt;
use std::sync::Arc;

/// The owner of a block, reported as `live_by_tag` in the snapshot summary.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Tag {
    Weights,
    KvCache,
    Activation,
    Workspace,
    /// Memory that belongs to one request (by its id).
    Request(u64),
    /// Anything else, named by the caller.
    Label(Arc<str>),
}

impl Tag {
    pub fn label(name: &str) -> Tag {
        Tag::Label(Arc::from(name))
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tag::Weights => f.write_str("weights"),
            Tag::KvCache => f.write_str("kv_cache"),
            Tag::Activation => f.write_str("activation"),
            Tag::Workspace => f.write_str("workspace"),
            Tag::Request(id) => write!(f, "request:{id}"),
            Tag::Label(s) => f.write_str(s),
        }
    }
}
