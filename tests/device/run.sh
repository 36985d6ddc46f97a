#!/usr/bin/env bash
# The GPU-machine suite. That machine has no Rust toolchain: build here with
#   cargo build --release -p oomscope && mkdir -p .device && cp target/release/oomscope .device/
# and carry `.device` (and, once the Python agent exists, its abi3 wheel in .device/).
# It prints a short table of checks and writes details to $OUT (when set).
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${OOMSCOPE_BIN:-.device/oomscope}
OUT=${OUT:-$(mktemp -d)}
PORT=17433
URL=http://127.0.0.1:$PORT
results=()
record() { results+=("$(printf '%-34s %-6s %s' "$1" "$2" "$3")"); }

[ -x "$BIN" ] || { echo "no binary at $BIN"; exit 2; }
"$BIN" collector --listen 127.0.0.1:$PORT --db "$OUT/oomscope.db" --lost-grace 1s 2>"$OUT/collector.log" &
CPID=$!
trap 'kill $CPID 2>/dev/null; for d in /sys/fs/cgroup/oomscope-dev*/leaf /sys/fs/cgroup/oomscope-dev*; do rmdir $d 2>/dev/null; done' EXIT
for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done

latest_json() { "$BIN" diagnose "$("$BIN" incidents --agent "$1" --json --collector $URL | python3 -c 'import json,sys; print(json.load(sys.stdin)[-1]["id"])')" --json --collector $URL; }
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval('d'+sys.argv[1]))" "$1"; }

# 1. cgroup v2 limit on the child's own level (pure v2 with the memory controller).
echo "+memory" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
mkdir -p /sys/fs/cgroup/oomscope-dev && echo $((64<<20)) > /sys/fs/cgroup/oomscope-dev/memory.max && echo 0 > /sys/fs/cgroup/oomscope-dev/memory.swap.max 2>/dev/null
sh -c 'echo $$ > /sys/fs/cgroup/oomscope-dev/cgroup.procs; exec "$@"' sh "$BIN" run --collector $URL --name dev-cg --interval 50ms -- python3 -c "bytearray(200<<20)" 2>>"$OUT/run.log"
rc=$?
j=$(latest_json dev-cg); echo "$j" > "$OUT/dev-cg.json"
got="rc=$rc domain=$(echo "$j" | field '["domain"]') limit=$(echo "$j" | field '["cgroup"]["limit_bytes"]') owner=$(echo "$j" | field '["cgroup"]["owner_level"]')"
[[ $rc == 137 && $got == *"domain=cgroup limit=67108864 owner=/oomscope-dev"* ]] && record "cgroup v2, own level" PASS "$got" || record "cgroup v2, own level" FAIL "$got"

# 2. cgroup v2 limit on the parent level.
mkdir -p /sys/fs/cgroup/oomscope-devp && echo "+memory" > /sys/fs/cgroup/oomscope-devp/cgroup.subtree_control
echo $((64<<20)) > /sys/fs/cgroup/oomscope-devp/memory.max; echo 0 > /sys/fs/cgroup/oomscope-devp/memory.swap.max 2>/dev/null
mkdir -p /sys/fs/cgroup/oomscope-devp/leaf
sh -c 'echo $$ > /sys/fs/cgroup/oomscope-devp/leaf/cgroup.procs; exec "$@"' sh "$BIN" run --collector $URL --name dev-cgp --interval 50ms -- python3 -c "bytearray(200<<20)" 2>>"$OUT/run.log"
rc=$?
j=$(latest_json dev-cgp); echo "$j" > "$OUT/dev-cgp.json"
got="rc=$rc domain=$(echo "$j" | field '["domain"]') owner=$(echo "$j" | field '["cgroup"]["owner_level"]')"
[[ $rc == 137 && $got == *"domain=cgroup owner=/oomscope-devp" ]] && record "cgroup v2, parent level" PASS "$got" || record "cgroup v2, parent level" FAIL "$got"

# 3. Address space (RLIMIT_AS).
"$BIN" run --collector $URL --name dev-as -- prlimit --as=268435456 python3 -c "bytearray(300<<20)" 2>>"$OUT/run.log"
rc=$?
j=$(latest_json dev-as); echo "$j" > "$OUT/dev-as.json"
got="rc=$rc domain=$(echo "$j" | field '["domain"]')"
[[ $got == "rc=1 domain=address_space" ]] && record "address space (RLIMIT_AS)" PASS "$got" || record "address space (RLIMIT_AS)" FAIL "$got"

# 4. A real CUDA OOM under `oomscope run` (no in-process agent): the stderr text and NVML.
"$BIN" run --collector $URL --name dev-gpu -- python3 -c "
import torch
torch.cuda.set_per_process_memory_fraction(0.01)
x = torch.empty(8 << 30, dtype=torch.uint8, device='cuda')" 2>>"$OUT/run.log"
rc=$?
j=$(latest_json dev-gpu); echo "$j" > "$OUT/dev-gpu.json"
got="rc=$rc domain=$(echo "$j" | field '["domain"]')"
[[ $got == "rc=1 domain=gpu_vram" ]] && record "CUDA OOM text + NVML" PASS "$got" || record "CUDA OOM text + NVML" FAIL "$got"
"$BIN" timeline dev-gpu --json --collector $URL > "$OUT/dev-gpu-timeline.json" 2>/dev/null

echo
printf '%-34s %-6s %s\n' CHECK RESULT DETAIL
printf '%s\n' "${results[@]}"
cp "$OUT/oomscope.db" "$OUT/oomscope.db" 2>/dev/null
[[ "${results[*]}" != *FAIL* ]]
