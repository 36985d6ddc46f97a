# agent-cuda / rust-server GPU checks, sourced by tests/device/run.sh ($BIN, $URL, $OUT, record, latest_json).
# It needs .device/oomscope-rust-server and .device/oomscope-cuda-check: the build command is at the top of run.sh.
# A dry run here, on the simulated device, checks the script itself before device time is spent:
#   OOMSCOPE_BIN=target/debug/oomscope OOMSCOPE_DEVICE_PARTS=cuda OOMSCOPE_RS_DIR=target/debug \
#   OOMSCOPE_RS_DEVICE=sim OOMSCOPE_GPU_BYTES=$((16<<30)) bash tests/device/run.sh
RS=${OOMSCOPE_RS_DIR:-.device}/oomscope-rust-server; CHK=${OOMSCOPE_RS_DIR:-.device}/oomscope-cuda-check
RSDEV=(--device "${OOMSCOPE_RS_DEVICE:-cuda}"); [[ ${OOMSCOPE_RS_DEVICE:-cuda} == sim ]] && RSDEV+=(--capacity "$OOMSCOPE_GPU_BYTES")
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
    total=${OOMSCOPE_GPU_BYTES:-}
    [ -n "$total" ] || total=$(python3 -c "import subprocess;print(int(subprocess.check_output(['nvidia-smi','--query-gpu=memory.total','--format=csv,noheader,nounits']).split()[0])<<20)" 2>/dev/null || echo $((140<<30)))
    "$RS" "${RSDEV[@]}" --listen 127.0.0.1:0 --collector $URL --name dev-rs-weights --model-bytes $((total * 3 / 2)) --layers 12 >/dev/null 2>>"$OUT/rs.log"
    rc=$?; j=$(latest_json dev-rs-weights); echo "$j" > "$OUT/dev-rs-weights.json"
    got="rc=$rc domain=$(echo "$j" | field '["domain"]') cause=$(echo "$j" | field '["causes"][0]["kind"]')"
    [[ $got == "rc=1 domain=gpu_vram cause=weights_too_large" ]] && record "cuda: weights too large" PASS "$got" || record "cuda: weights too large" FAIL "$got"

    # rs_start PORT NAME ARGS...: the server in the background, up when its port answers.
    rs_start() { local port=$1 name=$2; shift 2
        "$RS" "${RSDEV[@]}" --listen 127.0.0.1:$port --collector $URL --name $name "$@" >/dev/null 2>>"$OUT/rs.log" &
        RSPID=$!; RSPORT=$port
        for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && return; sleep 0.2; done; }
    rs_stop() { kill $RSPID 2>/dev/null; timeout 10 tail --pid=$RSPID -f /dev/null; kill -9 $RSPID 2>/dev/null; }
    generate() { curl -s -m 60 -o "${2:-/dev/null}" -w '%{http_code}' -X POST localhost:$RSPORT/generate -H 'content-type: application/json' -d "$1"; }

    # 3. KV concurrency on the real device: weights leave 12 GiB, 12 staggered 2 GiB sequences.
    rs_start 18480 dev-rs-kv --model-bytes $((total - (12 << 30))) --kv-bytes-per-token $((1 << 20)) --step-ms 50
    # One sequence alone fits (so size alone is not the trigger), then 12 at once do not.
    one=$(generate '{"prompt_tokens":256,"max_tokens":1792}')
    # Wait for the requests only: `jobs -p` also lists the server and run.sh's collector.
    reqs=(); for i in $(seq 12); do generate '{"prompt_tokens":256,"max_tokens":1792}' >/dev/null & reqs+=($!); sleep 0.02; done
    wait "${reqs[@]}"
    rs_stop
    # The first OOM of the burst: later ones come as failed sequences leave.
    j=$(latest_json dev-rs-kv 0); echo "$j" > "$OUT/dev-rs-kv.json"
    got="alone=$one domain=$(echo "$j" | field '["domain"]') trigger=$(echo "$j" | field '["trigger"]') cause=$(echo "$j" | field '["causes"][0]["kind"]') bpt=$(echo "$j" | field '["causes"][0]["metrics"]["bytes_per_token"]')"
    [[ $got == "alone=200 domain=gpu_vram trigger=concurrency_dependent cause=kv_growth bpt=1048576"* ]] && record "cuda: KV concurrency" PASS "$got" || record "cuda: KV concurrency" FAIL "$got"

    # 4. Fragmentation on the real device: weights leave 4 GiB, the prefix cache fills it and keeps
    # every other 6 MiB entry; a decode step's 24 MiB workspace then fits no hole.
    rs_start 18481 dev-rs-frag --model-bytes $((total - (4 << 30))) --fragment
    code=$(generate '{"prompt_tokens":256,"max_tokens":256}' "$OUT/dev-rs-frag-response.json")
    rs_stop
    j=$(latest_json dev-rs-frag); echo "$j" > "$OUT/dev-rs-frag.json"
    got="http=$code domain=$(echo "$j" | field '["domain"]') cause=$(echo "$j" | field '["causes"][0]["kind"]')"
    [[ $got == "http=507 domain=gpu_vram cause=fragmentation" ]] && record "cuda: fragmentation" PASS "$got" || record "cuda: fragmentation" FAIL "$got"
fi
