//! The `oomscope` binary as the Rust crates' tests run it: found beside the
//! test executable (or at `OOMSCOPE_BIN`), and its query verbs read as JSON.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The `oomscope` CLI: `OOMSCOPE_BIN`, else the one cargo built beside this
/// test (target/<profile>/deps/<test> -> target/<profile>/oomscope).
pub fn oomscope_bin() -> PathBuf {
    if let Ok(p) = std::env::var("OOMSCOPE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("oomscope");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p oomscope` first (scripts/test does)",
        bin.display()
    );
    bin
}

/// `oomscope ARGS --collector URL --json`, asked of the test's own collector
/// (never one named in the environment); panics with its stderr on failure.
pub fn query_json(url: &str, args: &[&str]) -> Value {
    let out = Command::new(oomscope_bin())
        .args(args)
        .args(["--collector", url, "--json"])
        .env_remove("OOMSCOPE_COLLECTOR")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "oomscope {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The test's own `oomscope collector` over the SQLite file `db` (never one
/// named in the environment), on a free port.
pub fn own_collector(db: &std::path::Path) -> crate::CollectorProcess {
    crate::CollectorProcess::start(
        || {
            let mut c = Command::new(oomscope_bin());
            c.env_remove("OOMSCOPE_COLLECTOR");
            c
        },
        db,
        None,
    )
}
