//! A runtime launched as a Python module (`python3 -m llama_cpp.server
//! --n_ctx N`), under `oomscope run` in a memory cgroup of the test's own:
//! the kernel kills it filling its KV pool at start-up, and the verdict
//! names the runtime's own context flag with a value computed from the
//! measured figures, and the victim by its command line.

mod common;

use common::*;

const MIB: u64 = 1 << 20;

/// A stand-in for llama-cpp-python's server, as a package of the same
/// module path: it logs its KV buffer as llama.cpp does (32 KiB a token),
/// holds the rest of a server for a moment, then fills the pool 16 MiB at a
/// time, every page touched (as llama.cpp clears its buffer) by the kernel
/// (MAP_POPULATE): a fill that keeps climbing between the 50 ms readings
/// even when a busy host leaves the process little CPU.
const SERVER: &str = r#"
import mmap, sys, time

args = sys.argv[1:]

def flag(name, default):
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default

n_ctx = int(flag("--n_ctx", "512"))
pool = n_ctx * 32 * 1024
sys.stderr.write("llama_context: n_ctx         = %d\n" % n_ctx)
sys.stderr.write("llama_kv_cache_unified:        CPU KV buffer size = %8.2f MiB\n" % (pool / 2**20))
sys.stderr.flush()
time.sleep(1.0)
held = []
chunk = 16 << 20
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
while len(held) * chunk < pool:
    held.append(mmap.mmap(-1, chunk, flags=flags))
print("the pool fit", flush=True)
"#;

fn f64_at(v: &serde_json::Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .unwrap_or_else(|| panic!("no number at {path:?}: {v:#}"))
}

#[test]
fn a_python_m_runtime_killed_filling_its_pool_gets_its_own_context_flag_computed() {
    let tmp = tempdir();
    let pkg = tmp.path().join("llama_cpp");
    std::fs::create_dir(&pkg).unwrap();
    std::fs::write(pkg.join("__init__.py"), "").unwrap();
    std::fs::write(pkg.join("server.py"), SERVER).unwrap();
    let col = Collector::start(&tmp.path().join("db"));
    // 512 MiB: the 1 GiB pool does not fit, and what does fit (less the
    // rest and its warm-up allowance) is a proposal above zero.
    let cg = TestCgroup::create(None, "oomscope-runtime-module", Some(512 * MIB));
    let name = "llama-module";
    let mut argv = vec![bin()];
    argv.extend(run_args(&col.url, name));
    argv.extend([
        "--",
        "python3",
        "-m",
        "llama_cpp.server",
        "--model",
        "/models/tiny-q4.gguf",
        "--n_ctx",
        "32768",
    ]);
    // `python3 -m` finds the package in its working directory.
    let out = cg
        .command(&argv)
        .current_dir(tmp.path())
        .output()
        .expect("oomscope run in a cgroup");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "killed: {stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("the pool fit"));

    let d = col.json(&["diagnose"]);
    assert_eq!(d["domain"], "cgroup", "{d:#}");
    // The victim by the command line read while it lived, not `[python3]`.
    let victim = d["victim"]["command"].as_str().unwrap_or_default();
    assert!(
        victim.contains("python3 -m llama_cpp.server --model /models/tiny-q4.gguf --n_ctx 32768"),
        "{d:#}"
    );
    let causes = d["causes"].as_array().unwrap();
    let c = causes
        .iter()
        .find(|c| c["kind"] == "kv_reservation")
        .unwrap_or_else(|| panic!("no kv_reservation: {d:#}"));
    // The cgroup's readings, for a failure's message.
    let t = timeline(&col.url, name);
    let usage: Vec<(i64, u64)> = t
        .samples
        .iter()
        .filter_map(|s| {
            let s = s.sample.as_ref()?;
            let l = s.cgroup.iter().find(|l| l.path == cg.path)?;
            Some((s.time_ns / 1_000_000, l.usage_bytes >> 20))
        })
        .collect();
    eprintln!("cgroup usage (ms, MiB): {usage:?}");
    let limit = f64_at(c, &["metrics", "limit_bytes"]);
    assert_eq!(limit, (512 * MIB) as f64, "{c:#}");
    let proposed = f64_at(c, &["metrics", "proposed_kv_bytes"]);
    let rest = f64_at(c, &["metrics", "rest_bytes"]);
    assert!(proposed > 0.0 && rest + proposed < limit, "{c:#}");
    // The pool the server logged: 32768 tokens × 32 KiB.
    let pool = 32768.0 * 32.0 * 1024.0;
    let want = ((32768.0 * proposed / pool) / 256.0).floor() as u64 * 256;
    assert!(want > 0 && want < 32768);
    let fixes: Vec<&str> = d["fixes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["action"].as_str())
        .collect();
    assert!(
        fixes.iter().any(|a| a.starts_with(&format!(
            "Lower the KV reservation to what fits: `--n_ctx {want}` (now 32768; the 1.0 GiB pool llama-cpp-python logged scales with it)"
        ))),
        "{fixes:#?}"
    );
    // Python's own `-m` is no setting of the runtime's.
    assert!(fixes.iter().all(|a| !a.contains("`-m")), "{fixes:#?}");
}
