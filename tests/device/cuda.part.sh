# agent-cuda / rust-server GPU checks, sourced by tests/device/run.sh ($BIN, $URL, $OUT, record, latest_json).
# Build here first (the GPU machine has no Rust toolchain):
#   cargo build --release -p oomscope -p oomscope-rust-server && mkdir -p .device \
#     && cp target/release/{oomscope,oomscope-rust-server,oomscope-cuda-check} .device/
RS=.device/oomscope-rust-server; CHK=.device/oomscope-cuda-check
if [ ! -x "$RS" ] || [ ! -x "$CHK" ]; then
    record "cuda: binaries" FAIL "missing $RS or $CHK"
else
    # 1. A PTX kernel on a TrackedSlice; tracked pool vs raw cudarc alloc+free.
    out=$("$CHK" 2>&1); rc=$?; echo "$out" > "$OUT/cuda-check.txt"
    [[ $rc == 0 && $out == *"kernel_wrong=0"* ]] && record "cuda: kernel on TrackedSlice" PASS "$(echo "$out" | grep -o 'kernel_wrong=[0-9]*')" \
        || record "cuda: kernel on TrackedSlice" FAIL "rc=$rc $(echo "$out" | tail -1)"
    timing=$(echo "$out" | grep -o 'tracked_alloc_free_ns=.*')
    [[ -n $timing ]] && record "cuda: tracked vs raw alloc+free" PASS "$timing" || record "cuda: tracked vs raw alloc+free" FAIL "no timing"

    # 2. Weights too large on the real device: 1.5x the GPU's memory.
    total=$(python3 -c "import subprocess;print(int(subprocess.check_output(['nvidia-smi','--query-gpu=memory.total','--format=csv,noheader,nounits']).split()[0])<<20)" 2>/dev/null || echo $((140<<30)))
    "$RS" --device cuda --listen 127.0.0.1:0 --collector $URL --name dev-rs-weights --model-bytes $((total * 3 / 2)) --layers 12 >/dev/null 2>>"$OUT/rs.log"
    rc=$?; j=$(latest_json dev-rs-weights); echo "$j" > "$OUT/dev-rs-weights.json"
    got="rc=$rc domain=$(echo "$j" | field '["domain"]') cause=$(echo "$j" | field '["causes"][0]["kind"]')"
    [[ $got == "rc=1 domain=gpu_vram cause=weights_too_large" ]] && record "cuda: weights too large" PASS "$got" || record "cuda: weights too large" FAIL "$got"

    # 3. KV concurrency on the real device: weights take most of it, 48 staggered 2 GiB sequences.
    RSPORT=18480
    "$RS" --device cuda --listen 127.0.0.1:$RSPORT --collector $URL --name dev-rs-kv --model-bytes $((total - (12 << 30))) \
        --kv-bytes-per-token $((1 << 20)) --step-ms 10 >/dev/null 2>>"$OUT/rs.log" &
    RSPID=$!
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$RSPORT) 2>/dev/null && break; sleep 0.2; done
    for i in $(seq 12); do
        curl -s -m 60 -o /dev/null -X POST localhost:$RSPORT/generate -H 'content-type: application/json' -d '{"prompt_tokens":256,"max_tokens":1792}' & sleep 0.04
    done; wait $(jobs -p | grep -v "^$RSPID$") 2>/dev/null
    kill $RSPID 2>/dev/null; timeout 10 tail --pid=$RSPID -f /dev/null; kill -9 $RSPID 2>/dev/null
    j=$(latest_json dev-rs-kv); echo "$j" > "$OUT/dev-rs-kv.json"
    got="domain=$(echo "$j" | field '["domain"]') trigger=$(echo "$j" | field '["trigger"]') cause=$(echo "$j" | field '["causes"][0]["kind"]') bpt=$(echo "$j" | field '["causes"][0]["metrics"]["bytes_per_token"]')"
    [[ $got == "domain=gpu_vram trigger=concurrency_dependent cause=kv_growth bpt=1048576"* ]] && record "cuda: KV concurrency" PASS "$got" || record "cuda: KV concurrency" FAIL "$got"
fi
