//! A collector's SQLite file read by the test itself, through a connection
//! of its own: what was stored, not what the collector says it stored.

use std::path::Path;

/// The seqs stored for `agent_id`, ascending (each once: the key is
/// `(agent_id, seq)`).
pub fn stored_seqs(db: &Path, agent_id: &str) -> Vec<u64> {
    let conn = rusqlite::Connection::open(db).unwrap();
    let mut stmt = conn
        .prepare("SELECT seq FROM messages WHERE agent_id = ?1 ORDER BY seq")
        .unwrap();
    stmt.query_map([agent_id], |r| r.get::<_, i64>(0))
        .unwrap()
        .map(|s| s.unwrap() as u64)
        .collect()
}
