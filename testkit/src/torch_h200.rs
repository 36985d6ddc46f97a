//! The real H200 captures of tests/fixtures/torch-h200, read independently of
//! the code under test, for the tests of agent-core and of the cli.

use std::io::Read;
use std::path::{Path, PathBuf};

use oomscope_proto::v1 as pb;
use serde_json::Value;

/// How many captures the folder holds (tests/fixtures/README.md lists them).
pub const COUNT: usize = 14;

pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/torch-h200")
}

/// A capture by its file name, e.g. "fragmentation_oom.json".
pub fn file(name: &str) -> PathBuf {
    dir().join(name)
}

/// A capture by its scenario, whether it is stored plain or gzipped.
pub fn scenario(name: &str) -> PathBuf {
    let plain = file(&format!("{name}.json"));
    if plain.exists() {
        plain
    } else {
        file(&format!("{name}.json.gz"))
    }
}

/// Every capture, sorted by file name.
pub fn paths() -> Vec<PathBuf> {
    let dir = dir();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    assert_eq!(
        paths.len(),
        COUNT,
        "every capture of tests/fixtures/torch-h200"
    );
    paths
}

/// A capture file's JSON (.json or .json.gz).
pub fn read(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut text = String::new();
    if path.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_string(&mut text)
            .unwrap();
    } else {
        text = String::from_utf8(bytes).unwrap();
    }
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every capture as (file name, JSON), sorted by file name.
pub fn captures() -> Vec<(String, Value)> {
    paths()
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, read(&p))
        })
        .collect()
}

/// Where a capture's context key must land in a RequestContext: its field
/// (same value), `numbers` or `labels`.
pub fn assert_context_key(ctx: &pb::RequestContext, key: &str, val: &Value, origin: &str) {
    let field = match key {
        "phase" => Some(Value::from(ctx.phase.clone())),
        "request_id" => Some(Value::from(ctx.request_id.clone())),
        "prompt_tokens" => Some(ctx.prompt_tokens.into()),
        "output_tokens" => Some(ctx.output_tokens.into()),
        "active_sequences" => Some(ctx.active_sequences.into()),
        "active_tokens" => Some(ctx.active_tokens.into()),
        "queued" => Some(ctx.queued.into()),
        "batch_size" => Some(ctx.batch_size.into()),
        "kv_bytes" | "kv_cache_bytes" => Some(ctx.kv_cache_bytes.into()),
        "kv_cache_capacity_bytes" => Some(ctx.kv_cache_capacity_bytes.into()),
        "requests_done" => Some(ctx.requests_done.into()),
        "live_tensors" => Some(ctx.live_tensors.into()),
        "live_tensor_bytes" => Some(ctx.live_tensor_bytes.into()),
        "weight_bytes" => Some(ctx.weight_bytes.into()),
        "loaded_bytes" => Some(ctx.loaded_bytes.into()),
        _ => None,
    };
    if field.as_ref() == Some(val) {
        return;
    }
    if let (Some(f), Some(want)) = (field.as_ref().and_then(Value::as_f64), val.as_f64()) {
        if f == want && !ctx.numbers.contains_key(key) {
            return;
        }
    }
    if let (Some(n), Some(want)) = (ctx.numbers.get(key), val.as_f64()) {
        assert_eq!(*n, want, "{origin}: numbers[{key}]");
        return;
    }
    let text = match val {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    assert_eq!(
        ctx.labels.get(key),
        Some(&text),
        "{origin}: context key {key} = {val} landed nowhere"
    );
}
