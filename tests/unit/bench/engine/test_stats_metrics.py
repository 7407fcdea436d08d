"""Percentiles, summaries and the /metrics parsing against hand-computed values."""

from __future__ import annotations

import math

import pytest

from bench.engine import metrics
from bench.engine.stats import Aggregator, Failure, RequestRecord, percentile, summarize


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0.5) == pytest.approx(2.5)
    assert percentile(values, 0.9) == pytest.approx(3.7)  # 3 + 0.7 * (4 - 3)
    assert percentile(values, 0.99) == pytest.approx(3.97)
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 4.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 0.9) == pytest.approx(90.1)
    assert percentile(hundred, 0.99) == pytest.approx(99.01)


def rec(
    ttft: float | None, e2e: float, itl: list[float], out: int, failure: Failure | None = None
) -> RequestRecord:
    return RequestRecord("target", "p", 0, "g", 0.0, 100, ttft, e2e, itl, out, failure)


def test_summary_of_a_pass() -> None:
    records = [
        rec(0.010, 0.050, [0.01, 0.02], 3),
        rec(0.020, 0.060, [0.03], 2),
        rec(0.030, 0.070, [], 1),
        rec(0.040, 0.080, [0.04], 2),
        rec(None, 0.5, [], 0, Failure("500", 500, "boom")),
    ]
    s = summarize(records, wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"]) == (5, 4, 1) and s["errors_by_status"] == {"500": 1}
    assert s["prompt_tokens"] == 400 and s["output_tokens"] == 8
    assert s["ttft_ms"] == {"p50": 25.0, "p90": 37.0, "p99": 39.7, "mean": 25.0}
    assert s["e2e_ms"]["p50"] == 65.0
    assert s["itl_ms"]["p50"] == 25.0  # gaps 10, 20, 30, 40
    assert s["output_tokens_per_s"] == 4.0 and s["requests_per_s"] == 2.0
    empty = summarize([], 0.0)
    assert empty["ttft_ms"]["p50"] is None and empty["requests_per_s"] is None


def test_aggregator_live_view_covers_the_current_pass() -> None:
    agg = Aggregator()
    agg.begin_pass("target", "warm", 2, 0.0)
    for r in (rec(0.1, 0.2, [], 4), rec(0.3, 0.4, [], 4)):
        agg.started()
        agg.add(r)
    agg.begin_pass("target", "measured", 3, 10.0)
    agg.started()
    agg.started()
    agg.add(rec(0.002, 0.01, [], 2))
    agg.add(rec(None, 0.01, [], 0, Failure("ReadTimeout", None, "boom")))
    live = agg.live(12.0)
    assert (live.pass_name, live.done, live.total, live.in_flight, live.errors) == ("measured", 2, 3, 0, 1)
    assert live.ttft_p50_ms == 2.0 and live.output_tokens_per_s == 1.0


PAGE = """# HELP vllm:prefix_cache_hits Prefix cache hits.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:external_prefix_cache_hits_total{engine="0"} 256.0
vllm:external_prefix_cache_queries_total{engine="0"} 512.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 64.0
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 256.0
kvdepot_l2_loads_total{adapter="disk"} 4.0
kvdepot_l2_loads_total{adapter="redis"} 1.0
not a metric line
"""


def test_parse_sums_samples_and_keeps_the_labels_we_report() -> None:
    snap = metrics.parse(PAGE)
    assert snap["vllm:prefix_cache_hits"] == 40.0
    assert "vllm:prefix_cache_hits_created" not in snap
    assert snap["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == 256.0
    assert snap["kvdepot_l2_loads{adapter=disk}"] == 4.0 and snap["kvdepot_l2_loads"] == 5.0


def test_hits_are_deltas_between_snapshots() -> None:
    before = metrics.parse(PAGE)
    after = metrics.parse(PAGE.replace("256.0", "768.0").replace("512.0", "1024.0").replace("100.0", "200.0"))
    hits = metrics.vllm_hits(before, after)
    assert hits["external_hit_tokens"] == 512.0 and hits["external_query_tokens"] == 512.0
    assert hits["external_hit_rate"] == 1.0
    assert hits["native_hit_tokens"] == 0.0 and hits["native_hit_rate"] == 0.0
    assert hits["prompt_tokens_by_source"] == {"external_kv_transfer": 512.0, "local_compute": 0.0}
    assert metrics.vllm_hits({}, {})["external_hit_rate"] is None


def test_sidecar_hits() -> None:
    before = {"kvdepot_lookup_hit_chunks": 2.0, "kvdepot_lookup_miss_chunks": 2.0}
    after = {
        "kvdepot_lookup_hit_chunks": 8.0, "kvdepot_lookup_miss_chunks": 4.0,
        "kvdepot_l2_loads{adapter=disk}": 3.0, "kvdepot_l2_prefetch_loaded_chunks": 3.0,
    }  # fmt: skip
    side = metrics.sidecar_hits(before, after)
    assert side["lookup_hit_chunks"] == 6.0 and side["l1_hit_rate_chunks"] == 0.75
    assert side["l2_loads"] == {"disk": 3.0} and side["l2_prefetch_loaded_chunks"] == 3.0


def test_tier_capacity_from_status() -> None:
    status = {
        "l1": {"capacity_bytes": 10 * 4096 + 100, "chunk_size": 256, "engines": [{"chunk_bytes": 4096}]},
        "l2": {"adapters": [{"name": "disk", "usage": {"capacity_bytes": 3 * 4096}}]},
    }
    assert metrics.tier_capacity_tokens(status, "l1") == 10 * 256
    assert metrics.tier_capacity_tokens(status, "disk") == 3 * 256
    with pytest.raises(ValueError, match="no tier"):
        metrics.tier_capacity_tokens(status, "redis")
    with pytest.raises(ValueError, match="no engine"):
        metrics.tier_capacity_tokens({"l1": {"engines": []}}, "l1")
