# agent-python on the GPU: the reference PyTorch server with the oomscope
# wheel. Sourced by tests/device/run.sh ($BIN, $URL, $OUT, record, latest_json).
# It needs .device/oomscope-*.whl: the build command is at the top of run.sh.
PYWHEEL=$(ls .device/oomscope-*.whl 2>/dev/null | head -1)
if [ -z "$PYWHEEL" ]; then
    record "py: wheel" FAIL "no .device/oomscope-*.whl (see the top of $BASH_SOURCE)"
else
    rm -rf /tmp/oomscope-py
    if pip install -q --no-index --no-deps --target /tmp/oomscope-py "$PYWHEEL" >"$OUT/py-install.log" 2>&1; then
        record "py: wheel" PASS "$(basename "$PYWHEEL") into $(python3 --version 2>&1)"
        mkdir -p "$OUT/python" "$OUT/python-devices"
        # py_checks FILE.jsonl: one recorded row per {"check", "pass", "detail"} line.
        py_checks() {
            while IFS= read -r line; do
                name=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["check"])' 2>/dev/null) || continue
                res=$(echo "$line" | python3 -c 'import json,sys; print("PASS" if json.load(sys.stdin)["pass"] else "FAIL")')
                detail=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["detail"])')
                record "$name" "$res" "$detail"
            done < "$1"
            local dir=${1%/*}
            [ -s "$1" ] || record "py: ${dir##*/} checks" FAIL "no output: $(tail -c 300 "${1%.jsonl}.err")"
        }
        PYTHONPATH=/tmp/oomscope-py${PYTHONPATH:+:$PYTHONPATH} timeout 240 python3 runtimes/pytorch-server/device_checks.py \
            --bin "$BIN" --collector "$URL" --out "$OUT/python" > "$OUT/python/checks.jsonl" 2>"$OUT/python/checks.err"
        py_checks "$OUT/python/checks.jsonl"
        # The devices the agent reads, cudaMallocAsync, memory outside PyTorch, NVML's cost (#29).
        PYTHONPATH=/tmp/oomscope-py${PYTHONPATH:+:$PYTHONPATH} timeout 300 python3 tests/device/python_devices.py \
            --bin "$BIN" --collector "$URL" --out "$OUT/python-devices" > "$OUT/python-devices/checks.jsonl" \
            2>"$OUT/python-devices/checks.err"
        py_checks "$OUT/python-devices/checks.jsonl"
    else
        record "py: wheel" FAIL "pip install failed: $(tail -c 300 "$OUT/py-install.log")"
    fi
fi
