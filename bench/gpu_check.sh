#!/usr/bin/env bash
# The device check of the sidecar's own copies, as one command on a CUDA machine (one GPU):
#   bench/gpu_check.sh     (from anywhere; within 5 minutes: per-run limits of 170 s and 100 s)
#
# Prints the environment (nvidia-smi, Python, torch and what it sees of CUDA), then runs
#   kvdepot bench copies --device cuda --check-cpu   (CUDA IPC on the sidecar's streams vs the
#                                                     client's copy_, and the CPU path's L1 bytes)
#   kvdepot bench copies --device cpu                (the CPU path alone, smaller)
# and writes each JSON object (and this run's log) into $OUT when it is set.
#
# Needs: a Python with the project's dependencies (pyproject.toml: torch built with CUDA, pyzmq,
# msgspec, uvicorn, ...) and nothing downloaded: PYTHON=... picks it (default: .venv/bin/python
# where it exists, else python3). Exit status: 0 when every run verified its bytes (the ratios
# are reported, never judged here); 3 when the Python lacks what the benchmark needs; 4 when torch
# sees no GPU (the CPU run still runs); 124 when a run ran past its limit; otherwise the first
# failing run's status.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT:$ROOT/connector${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR=${OUT:-}
# per run, in seconds: both together stay under 5 minutes
CUDA_LIMIT_S=${GPU_CHECK_CUDA_LIMIT_S:-170}
CPU_LIMIT_S=${GPU_CHECK_CPU_LIMIT_S:-100}
log() { echo "gpu_check: $*" >&2; }

save() {  # save NAME FILE: copy a result into $OUT when set
    if [ -n "$OUT_DIR" ]; then cp "$2" "$OUT_DIR/$1"; fi
}

echo "== environment"
date -u
nvidia-smi || log "nvidia-smi: not found or failed"
"$PY" --version || { log "no Python at $PY (set PYTHON=...)"; exit 3; }
if ! "$PY" -c "import torch, zmq, msgspec, uvicorn, structlog, pydantic_settings, blake3, uvloop" 2>&1; then
    log "$PY lacks the project's dependencies (pyproject.toml); set PYTHON to one that has them"
    exit 3
fi
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, built with CUDA {torch.version.cuda}, "
      f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
EOF

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
status=0

bench() {  # bench NAME LIMIT_S ARGS...: one run, its JSON kept as NAME.json
    local name=$1 limit=$2
    shift 2
    echo "== kvdepot bench copies $*"
    timeout "$limit" "$PY" -m app.cli bench copies "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"
    local rc=$?
    tail -n 5 "$TMP/$name.err" >&2
    tail -n 1 "$TMP/$name.out" >"$TMP/$name.json"
    cat "$TMP/$name.json"
    save "$name.json" "$TMP/$name.json"
    save "$name.stderr.txt" "$TMP/$name.err"
    log "$name: exit status $rc"
    return $rc
}

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    bench copies-cuda "$CUDA_LIMIT_S" --device cuda --check-cpu || status=$?
else
    log "torch sees no GPU: the CUDA run is skipped (kvdepot bench copies --device cuda says why below)"
    "$PY" -m app.cli bench copies --device cuda
    status=4
fi
bench copies-cpu "$CPU_LIMIT_S" --device cpu --layers 8 --chunks 16 --blocks 1024
rc=$?
if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
log "done, exit status $status"
exit "$status"
