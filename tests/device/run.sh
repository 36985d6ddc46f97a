#!/usr/bin/env bash
# The GPU-machine suite. That machine has no Rust toolchain: build everything here with
#   cargo build --release -p oomscope -p oomscope-rust-server && scripts/setup-python && rm -rf .device \
#     && mkdir .device && cp target/release/{oomscope,oomscope-rust-server,oomscope-cuda-check} .whl/oomscope-*.whl .device/
# and run `bash tests/device/run.sh` there with `.device` carried (about 30 MiB; the whole suite takes
# about 7 minutes). It prints a short table of checks and writes details to $OUT (when set).
# A dry run of the script itself here: see tests/device/cuda.part.sh.
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
trap 'kill $CPID 2>/dev/null' EXIT
for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done

latest_json() {  # NAME [INDEX]: the agent's latest (or INDEX-th, e.g. 0: first) incident, diagnosed
    local id; id=$("$BIN" incidents --agent "$1" --json --collector $URL | python3 -c 'import json,sys; l=json.load(sys.stdin); print(l[int(sys.argv[1])]["id"] if l else "")' "${2:--1}")
    if [ -n "$id" ]; then "$BIN" diagnose "$id" --json --collector $URL; else echo '{"domain": "no-incident", "cgroup": {}}'; fi; }
field() { python3 -c "import json,sys
d=json.load(sys.stdin)
try: print(eval('d'+sys.argv[1]))
except Exception: print('-')" "$1"; }

# Memory cgroups: pure v2 on the GPU machine (the point of running this there); v1 works too.
if grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    # Test cgroups go under our own (moving a process to the root's children is
    # refused there with EIO). v2 allows no processes in a cgroup that hands the
    # memory controller to children, so ours move to a leaf first.
    V=v2; PREFIX=$(sed -n 's/^0:://p' /proc/self/cgroup); PREFIX=${PREFIX%/}; BASE=/sys/fs/cgroup$PREFIX
    if ! grep -qw memory $BASE/cgroup.subtree_control; then
        mkdir -p $BASE/oomscope-init
        for p in $(cat $BASE/cgroup.procs); do echo $p > $BASE/oomscope-init/cgroup.procs 2>/dev/null; done
        echo "+memory" > $BASE/cgroup.subtree_control
    fi
    echo "cgroup v2 at $BASE: subtree_control [$(cat $BASE/cgroup.subtree_control)], procs left [$(cat $BASE/cgroup.procs | tr '\n' ' ')]"
    LIMITF=memory.max; SWAPF=memory.swap.max; SWAPV=0
else
    V=v1; own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup); own=${own%/}
    BASE=/sys/fs/cgroup/memory$own; PREFIX=$own
    LIMITF=memory.limit_in_bytes; SWAPF=memory.memsw.limit_in_bytes; SWAPV=$((64<<20))
fi
CLEAN="$BASE/oomscope-devp/leaf $BASE/oomscope-devp $BASE/oomscope-dev"
trap 'kill $CPID 2>/dev/null; for d in $CLEAN; do rmdir $d 2>/dev/null; done' EXIT
# mkcg NAME [LIMIT]: a v2 parent hands the memory controller to NAME (a leaf
# itself must not enable it, or it could hold no processes).
mkcg() { mkdir -p "$BASE/$1" || return 1; [ $V = v2 ] && [[ $1 == */* ]] && echo "+memory" > "$BASE/${1%/*}/cgroup.subtree_control"
         if [ -n "${2:-}" ]; then echo "$2" > "$BASE/$1/$LIMITF"; echo $SWAPV > "$BASE/$1/$SWAPF" 2>/dev/null; fi; return 0; }

# 1. A 64 MiB limit on the child's own cgroup level.
mkcg oomscope-dev $((64<<20))
echo "oomscope-dev: controllers [$(cat $BASE/oomscope-dev/cgroup.controllers)] max [$(cat $BASE/oomscope-dev/$LIMITF)] type [$(cat $BASE/oomscope-dev/cgroup.type 2>/dev/null)]"
sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$BASE/oomscope-dev" "$BIN" run --collector $URL --name dev-cg --interval 50ms -- python3 -c "bytearray(200<<20)" 2>>"$OUT/run.log"
rc=$?
j=$(latest_json dev-cg); echo "$j" > "$OUT/dev-cg.json"
got="rc=$rc domain=$(echo "$j" | field '["domain"]') limit=$(echo "$j" | field '["cgroup"]["limit_bytes"]') owner=$(echo "$j" | field '["cgroup"]["owner_level"]')"
[[ $rc == 137 && $got == *"domain=cgroup limit=67108864 owner=$PREFIX/oomscope-dev" ]] && record "cgroup $V, own level" PASS "$got" || record "cgroup $V, own level" FAIL "$got"

# 2. The limit on the parent level.
mkcg oomscope-devp $((64<<20)); mkcg oomscope-devp/leaf
sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$BASE/oomscope-devp/leaf" "$BIN" run --collector $URL --name dev-cgp --interval 50ms -- python3 -c "bytearray(200<<20)" 2>>"$OUT/run.log"
rc=$?
j=$(latest_json dev-cgp); echo "$j" > "$OUT/dev-cgp.json"
got="rc=$rc domain=$(echo "$j" | field '["domain"]') owner=$(echo "$j" | field '["cgroup"]["owner_level"]')"
[[ $rc == 137 && $got == *"domain=cgroup owner=$PREFIX/oomscope-devp" ]] && record "cgroup $V, parent level" PASS "$got" || record "cgroup $V, parent level" FAIL "$got"

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
echo "dev-gpu evidence:"; echo "$j" | python3 -c 'import json,sys; [print("  -", l) for l in json.load(sys.stdin)["evidence"]]'
"$BIN" timeline dev-gpu --json --collector $URL > "$OUT/dev-gpu-timeline.json" 2>/dev/null

# Each component adds its GPU checks as tests/device/<component>.part.sh, sourced
# here with $BIN, $URL, $OUT, record() and latest_json() in scope.
# OOMSCOPE_DEVICE_PARTS=cuda runs only the parts whose names it matches (a dry run).
for part in tests/device/*.part.sh; do
    [ -e "$part" ] || continue
    [[ $part == *"${OOMSCOPE_DEVICE_PARTS:-}"* ]] || continue
    echo "== $part"
    . "$part"
done

echo
printf '%-34s %-6s %s\n' CHECK RESULT DETAIL
printf '%s\n' "${results[@]}"
[[ "${results[*]}" != *FAIL* ]]
