"""`kvdepot bench eviction`: the hit rate of each L1 eviction policy (and of L2 admission) on the
token stream of `bench engine --workload prefix-suffix-tuner`, through a real sidecar, no model.

For each variant a sidecar is started (its own data dir, `l1.eviction` and L2 settings set through
its environment), a client registers a small layout (`--layers`, one KV head, `--head-dim`, 256-
token chunks) and replays the workload exactly as the connector would drive it: LOOKUP (waiting for
L2 loads, as vLLM's scheduler asks again until they are in), STORE of the chunks after the hit
(reserve, copy, commit), END_REQUEST. The stream is `bench engine`'s own (bench/engine/
workloads.py: same seed, same options -> same tokens): a warm pass (every prefix once, in pool
order), then `--requests` requests picking a prefix by `--reuse`; the pool is `--pool-multiple` x
L1's capacity in tokens, read from the sidecar's /status.

Variants (`--variants`, comma-separated):
  lru, s3fifo, arc             L1 only (no L2), `l1.eviction` = that policy
  l2-all, l2-seen_twice        L1 lru + one disk adapter of `--l2-multiple` x L1 bytes, written
                               behind with `l2.store_policy` all, or seen_twice (a chunk is written
                               only once it was seen a second time)
  <policy>+l2-<admission>      the same with another L1 policy (e.g. s3fifo+l2-seen_twice)

Per variant, over the measured pass only: hit rate (hit chunks / chunks looked up, as the client
saw them), the part of it that L1 served (the sidecar's L1 hit counter) and that L2 served (the
rest), L1 evictions, L2 chunks written, not admitted (seen_twice) and loaded, and the
lookup+store round trip p50/p99 in ms; L2 chunks written and not admitted over the whole run
(warm pass included) as `run_l2_written` / `run_l2_not_admitted`.
The baseline is the first variant (lru by default): each variant's hit rate is also given as a
ratio to it (`hit_rate_vs_first`). `policy_costs`: each policy's cost per lookup hit (on_access)
and per insert + eviction, in ns and as a ratio to lru's, measured in this process on real
L1Objects (bench/eviction_costs.py). Prints ONE JSON object.
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

from bench.engine.workloads import Options, PrefixSuffixTuner, RequestSpec

POLICIES = ("lru", "s3fifo", "arc")
CHUNK = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="lru,s3fifo,arc,l2-all,l2-seen_twice")
    p.add_argument("--l1-mib", type=float, default=64.0, help="L1 arena of every sidecar (MiB)")
    p.add_argument("--l2-multiple", type=float, default=0.5, help="disk L2 capacity, x L1 bytes")
    p.add_argument("--layers", type=int, default=2, help="chunk bytes = 2 x layers x head_dim x 256 x 2")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--requests", type=int, default=3000, help="measured requests (after the warm pass)")
    p.add_argument("--reuse", default="zipf:1.1")
    p.add_argument("--pool-multiple", type=float, default=1.5)
    p.add_argument("--context-tokens", type=int, default=1152)
    p.add_argument("--suffix-tokens", type=int, default=120)
    p.add_argument("--breaker-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="data dirs of the sidecars (default: a temp dir)")


def parse_variant(name: str) -> tuple[str, str | None]:
    """(L1 policy, L2 store policy or None for L1 only)."""
    policy, _, l2 = name.partition("+")
    if policy.startswith("l2-"):
        policy, l2 = "lru", policy
    if policy not in POLICIES or (l2 and l2 not in ("l2-all", "l2-seen_twice")):
        raise ValueError(
            f"unknown variant {name!r}: a policy ({', '.join(POLICIES)}), l2-all, l2-seen_twice, "
            "or policy+l2-..."
        )
    return policy, (l2[3:] if l2 else None)


def _env(policy: str, admission: str | None, l2_bytes: int, data_dir: Path) -> dict[str, str]:
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK), "KVDEPOT_L1__EVICTION": policy}
    if admission is None:
        env["KVDEPOT_L2__ADAPTERS"] = "[]"
    else:
        adapter = {"type": "disk", "paths": [str(data_dir / "l2-disk")], "capacity_gb": l2_bytes / (1 << 30),
                   "fsync": "never"}  # fmt: skip
        env["KVDEPOT_L2__ADAPTERS"] = json.dumps([adapter])
        env["KVDEPOT_L2__STORE_POLICY"] = admission
    return env


def _ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)


def run_variant(args: argparse.Namespace, name: str, out: Path) -> dict[str, Any]:
    import torch

    from bench.sidecar import start_sidecar
    from kvdepot_connector.client import KVDepotClient
    from kvdepot_connector.protocol import Layout, encode_tokens

    policy, admission = parse_variant(name)
    l1_bytes = int(args.l1_mib * (1 << 20))
    data_dir = out / name.replace("+", "_")
    env = _env(policy, admission, int(l1_bytes * args.l2_multiple), data_dir)
    sidecar = start_sidecar(data_dir, env=env, l1_size_gb=l1_bytes / (1 << 30))
    try:
        layout = Layout(
            dtype="float16", num_layers=args.layers, num_kv_heads=1, head_dim=args.head_dim,
            block_size=CHUNK, kind="bench", chunk_size=CHUNK,
        )  # fmt: skip
        client = KVDepotClient(sidecar.url, model="bench-eviction", layout=layout, timeout_s=30).connect()
        status = sidecar.get_json("/status")
        capacity = int(status["l1"]["capacity_bytes"])
        capacity_tokens = capacity // layout.chunk_bytes * CHUNK
        options = Options(
            workload="prefix-suffix-tuner", seed=args.seed, requests=args.requests, reuse=args.reuse,
            context_tokens=args.context_tokens, suffix_tokens=args.suffix_tokens,
            breaker_tokens=args.breaker_tokens, pool_multiple=args.pool_multiple,
            capacity_tokens=capacity_tokens,
        )  # fmt: skip
        workload = PrefixSuffixTuner(options)
        chunk = torch.zeros(layout.chunk_bytes, dtype=torch.uint8)
        result: dict[str, Any] = {
            "variant": name, "l1_eviction": policy, "l2_store_policy": admission,
            "pool_prefixes": workload.pool, "l1_capacity_chunks": capacity // layout.chunk_bytes,
        }  # fmt: skip
        first = sidecar.get_json("/status")
        for spec in workload.passes():
            before = sidecar.get_json("/status")
            hits = looked = 0
            times: list[float] = []
            for req in spec.requests:
                h, n, dt = _replay(client, req, chunk, encode_tokens)
                hits += h
                looked += n
                times.append(dt)
            if admission is not None:
                client_wait_idle(sidecar)
            after = sidecar.get_json("/status")
            if spec.measured:
                result |= _figures(before, after, hits, looked, times, l2=admission is not None)
                result["requests"] = len(times)
                if admission is not None:  # the warm pass included: what admission saves
                    whole = _figures(first, after, 0, 0, [0.0], l2=True)
                    result["run_l2_written"] = whole["l2_written"]
                    result["run_l2_not_admitted"] = whole["l2_not_admitted"]
        client.close()
    finally:
        sidecar.stop(timeout=30)
    return result


def _replay(client: Any, req: RequestSpec, chunk: Any, encode: Any) -> tuple[int, int, float]:
    """LOOKUP, STORE of what missed, END_REQUEST: (hit chunks, chunks, seconds)."""
    tokens = encode(req.prompt)
    rid = f"{req.pass_name}-{req.index}"
    start = time.perf_counter()
    reply = client.lookup(tokens, request_id=rid, wait=True)
    n = len(req.prompt) // CHUNK  # a waited reply's total_chunks counts only what was found
    if reply.hit_chunks < n:
        client.store(tokens, [chunk] * (n - reply.hit_chunks), request_id=rid, first_chunk=reply.hit_chunks)
    client.end_request(rid)
    return reply.hit_chunks, n, time.perf_counter() - start


def client_wait_idle(sidecar: Any, timeout_s: float = 30.0) -> None:
    """Until the write-behind queue is empty (`kvdepot_l2_store_queue_depth`), so that a pass's
    figures hold all of its writes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{sidecar.http}/metrics", timeout=10).text
        depth = [line for line in text.splitlines() if line.startswith("kvdepot_l2_store_queue_depth ")]
        if not depth or float(depth[0].split()[1]) == 0:
            return
        time.sleep(0.05)


def _figures(
    before: dict[str, Any], after: dict[str, Any], hits: int, looked: int, times: list[float], *, l2: bool
) -> dict[str, Any]:
    c0, c1 = before["l1"]["counters"], after["l1"]["counters"]
    l1_hits = c1["hit_chunks"] - c0["hit_chunks"]

    def l2_delta(part: str, field: str) -> int | None:
        if not l2:
            return None
        p0, p1 = (before.get("l2") or {}).get(part) or {}, (after.get("l2") or {}).get(part) or {}
        return int(p1.get(field, 0)) - int(p0.get(field, 0))

    return {
        "chunks_looked_up": looked,
        "hit_rate": round(hits / looked, 4) if looked else 0.0,
        "l1_hit_rate": round(l1_hits / looked, 4) if looked else 0.0,
        "l2_hit_rate": round((hits - l1_hits) / looked, 4) if looked else 0.0,
        "l1_evicted": c1["evicted"] - c0["evicted"],
        "l2_written": l2_delta("store", "written"),
        "l2_not_admitted": l2_delta("store", "not_admitted"),
        "l2_loaded": l2_delta("prefetch", "chunks_loaded"),
        "request_p50_ms": _ms(times, 0.5),
        "request_p99_ms": _ms(times, 0.99),
        "request_mean_ms": round(statistics.fmean(times) * 1000, 3),
    }


def policy_costs(objects: int = 20_000, accesses: int = 200_000) -> dict[str, dict[str, float]]:
    """In this process: ns per on_access (the lookup hot path) and per on_insert + eviction of one
    object through candidates() (the room's walk), per policy over `objects` live objects, and
    each as a ratio to lru's, measured alternately (lru, s3fifo, arc, lru, ...) three times; the
    best of three is kept."""
    import random

    from bench.eviction_costs import measure

    best: dict[str, dict[str, float]] = {}
    for _ in range(3):
        for name in POLICIES:
            got = measure(name, objects, accesses, random.Random(0))
            mine = best.setdefault(name, dict(got))
            for k, v in got.items():
                mine[k] = min(mine[k], v)
    base = best["lru"]
    for got in best.values():
        for k in ("access_ns", "churn_ns"):
            got[f"{k[:-3]}_vs_lru"] = round(got[k] / base[k], 2)
    return best


def run(args: argparse.Namespace) -> int:
    try:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        for v in variants:
            parse_variant(v)
    except ValueError as exc:
        print(f"kvdepot bench eviction: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-eviction-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    costs = policy_costs()
    results = [run_variant(args, v, out) for v in variants]
    first = results[0]["hit_rate"]
    for r in results:
        r["hit_rate_vs_first"] = round(r["hit_rate"] / first, 3) if first else None
    print(json.dumps({
        "bench": "eviction", "workload": "prefix-suffix-tuner", "reuse": args.reuse,
        "pool_multiple": args.pool_multiple, "requests": args.requests, "seed": args.seed,
        "l1_mib": args.l1_mib, "l2_multiple": args.l2_multiple, "seconds": round(time.monotonic() - t0, 1),
        "variants": results, "policy_costs": costs,
    }))  # fmt: skip
    return 0
