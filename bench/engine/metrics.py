"""Hit counters of `kvdepot bench engine`, read from Prometheus text before and after each pass.

Role: parse a `/metrics` page into totals per metric (and per label value for the labelled ones we
report), and turn two snapshots into a pass's hits: vLLM's own prefix cache
(`vllm:prefix_cache_{hits,queries}_total`), its connector's (`vllm:external_prefix_cache_...`),
prompt tokens by source where the engine has them, and the sidecar's lookups, L1 hits and L2
loads per adapter (`--sidecar-url`).

State: none; snapshots are plain dicts. Touched by the benchmark's event loop (the HTTP reads are
awaited through the sender's client).

Primitives, in call order: `parse(text)` -> `Snapshot`; `vllm_hits(before, after)`,
`sidecar_hits(before, after)` -> dicts for the report; `tier_capacity_tokens(status, tier)` reads a
tier's size in tokens from the sidecar's `/status`.
"""

from __future__ import annotations

from typing import Any

Snapshot = dict[str, float]
"""Metric name (without `_total`) -> sum of its samples; `name{label=value}` -> that label's sum."""

LABELLED = {
    "vllm:prompt_tokens_by_source": "source",
    "vllm:prompt_tokens_cached_by_source": "source",
    "kvdepot_l2_loads": "adapter",
    "kvdepot_l2_misses": "adapter",
    "kvdepot_l2_stores": "adapter",
}


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split('",'):
        if "=" in part:
            key, _, value = part.partition("=")
            out[key.strip()] = value.strip().strip('"')
    return out


def parse(text: str) -> Snapshot:
    """Totals of every counter and gauge of a Prometheus text page (comments and `_created`
    samples skipped; a malformed line is skipped, not fatal)."""
    snap: Snapshot = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value_text = line.rpartition(" ")
        try:
            value = float(value_text)
        except ValueError:
            continue
        name, _, rest = head.partition("{")
        name = name.strip()
        if name.endswith("_created"):
            continue
        name = name.removesuffix("_total")
        snap[name] = snap.get(name, 0.0) + value
        label = LABELLED.get(name)
        if label and rest:
            got = _labels(rest.rstrip("}"))
            if label in got:
                key = f"{name}{{{label}={got[label]}}}"
                snap[key] = snap.get(key, 0.0) + value
    return snap


def _delta(before: Snapshot, after: Snapshot, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _by_label(before: Snapshot, after: Snapshot, name: str) -> dict[str, float]:
    prefix = name + "{"
    return {
        key[len(prefix) :].split("=", 1)[1].rstrip("}"): _delta(before, after, key)
        for key in sorted(set(before) | set(after))
        if key.startswith(prefix)
    }


def _rate(hits: float, queries: float) -> float | None:
    return round(hits / queries, 4) if queries > 0 else None


def vllm_hits(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """Token counts of the engine's caches over a pass; absent metrics read as 0."""
    ext_hits = _delta(before, after, "vllm:external_prefix_cache_hits")
    ext_queries = _delta(before, after, "vllm:external_prefix_cache_queries")
    hits = _delta(before, after, "vllm:prefix_cache_hits")
    queries = _delta(before, after, "vllm:prefix_cache_queries")
    out: dict[str, Any] = {
        "external_hit_tokens": ext_hits,
        "external_query_tokens": ext_queries,
        "external_hit_rate": _rate(ext_hits, ext_queries),
        "native_hit_tokens": hits,
        "native_query_tokens": queries,
        "native_hit_rate": _rate(hits, queries),
        "prompt_tokens": _delta(before, after, "vllm:prompt_tokens"),
    }
    for name in ("vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached_by_source"):
        by = _by_label(before, after, name)
        if by:
            out[name.split(":", 1)[1]] = by
    return out


def hit_rate(before: Snapshot, after: Snapshot) -> float | None:
    """The share of queried prompt tokens found by either cache (what the display shows)."""
    hits = _delta(before, after, "vllm:external_prefix_cache_hits") + _delta(
        before, after, "vllm:prefix_cache_hits"
    )
    queries = max(
        _delta(before, after, "vllm:external_prefix_cache_queries"),
        _delta(before, after, "vllm:prefix_cache_queries"),
    )
    return _rate(hits, queries)


def sidecar_hits(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """The sidecar's view of a pass: lookups, L1 hits at lookup time, chunks prefetched from L2,
    loads and misses per adapter, L1 evictions."""
    d = {
        name: _delta(before, after, f"kvdepot_{name}")
        for name in (
            "lookups", "lookup_hit_chunks", "lookup_miss_chunks", "lookup_hit_tokens", "lookup_miss_tokens",
            "stored_chunks", "evictions", "l2_prefetch_loaded_chunks", "l2_store_written",
        )
    }  # fmt: skip
    looked = d["lookup_hit_chunks"] + d["lookup_miss_chunks"]
    return d | {
        "l1_hit_rate_chunks": _rate(d["lookup_hit_chunks"], looked),
        "l2_loads": _by_label(before, after, "kvdepot_l2_loads"),
        "l2_misses": _by_label(before, after, "kvdepot_l2_misses"),
    }


def tier_capacity_tokens(status: dict[str, Any], tier: str) -> int:
    """How many tokens `tier` (`l1` or an L2 adapter's name) holds, from the sidecar's /status:
    bytes / the registered engine's chunk bytes x tokens per chunk."""
    l1 = status.get("l1") or {}
    engines = l1.get("engines") or []
    chunk_tokens = int(l1.get("chunk_size") or 0)
    if not engines or chunk_tokens <= 0:
        raise ValueError("the sidecar has no engine registered yet: its chunk size in bytes is unknown")
    chunk_bytes = int(engines[0]["chunk_bytes"])
    if tier == "l1":
        capacity = int(l1["capacity_bytes"])
    else:
        adapters = {a["name"]: a for a in (status.get("l2") or {}).get("adapters") or []}
        if tier not in adapters:
            raise ValueError(f"no tier {tier!r}: l1 or one of {sorted(adapters)}")
        capacity = int(adapters[tier]["usage"]["capacity_bytes"])
        if capacity <= 0:
            raise ValueError(f"the adapter {tier!r} reports no capacity")
    return capacity // chunk_bytes * chunk_tokens
