//! Regenerates `src/generated` from `proto/` and fails when the committed code
//! was stale, in the manner of tokio-console's console-api.

use std::path::PathBuf;

#[test]
fn generated_code_is_up_to_date() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let protos = ["agent.proto", "memory.proto", "query.proto"]
        .map(|f| root.join("proto/oomscope/v1").join(f));
    let out = root.join("src/generated");

    let fds = protox::compile(&protos, [root.join("proto")]).expect("protos compile");
    let tmp = std::env::temp_dir().join(format!("oomscope-proto-gen-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // The generated `connect(dst)` constructor would clash with the
        // `Connect` rpc; clients are built from a Channel instead.
        .build_transport(false)
        .out_dir(&tmp)
        .compile_fds(fds)
        .expect("codegen");

    let fresh = std::fs::read_to_string(tmp.join("oomscope.v1.rs")).unwrap();
    let committed_path = out.join("oomscope.v1.rs");
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    if fresh != committed {
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(&committed_path, fresh).unwrap();
        panic!(
            "src/generated/oomscope.v1.rs was stale and has been regenerated; \
             review and commit it"
        );
    }
}
