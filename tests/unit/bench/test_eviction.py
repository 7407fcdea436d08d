"""`kvdepot bench eviction`: its variants, and a bad one is a usage error before anything starts.
(The measurement itself starts sidecars: docs/benchmarks/eviction.md has the commands and figures.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from bench.eviction import _env, parse_variant


def test_variants_name_an_l1_policy_and_an_optional_l2_admission() -> None:
    assert parse_variant("lru") == ("lru", None)
    assert parse_variant("s3fifo") == ("s3fifo", None)
    assert parse_variant("l2-seen_twice") == ("lru", "seen_twice")
    assert parse_variant("arc+l2-all") == ("arc", "all")
    for bad in ("lfu", "l2-never", "arc+s3fifo", ""):
        with pytest.raises(ValueError, match="unknown variant"):
            parse_variant(bad)


def test_l1_only_variants_have_no_l2_and_l2_variants_one_bounded_disk(tmp_path: Path) -> None:
    env = _env("arc", None, 0, tmp_path)
    assert env["KVDEPOT_L1__EVICTION"] == "arc" and env["KVDEPOT_L2__ADAPTERS"] == "[]"
    env = _env("lru", "seen_twice", 1 << 30, tmp_path)
    (adapter,) = json.loads(env["KVDEPOT_L2__ADAPTERS"])
    assert adapter["type"] == "disk" and adapter["capacity_gb"] == 1.0
    assert env["KVDEPOT_L2__STORE_POLICY"] == "seen_twice"


def test_an_unknown_variant_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "eviction", "--variants", "lru,mru"]) == 2
    assert "unknown variant 'mru'" in capsys.readouterr().err


def test_policy_costs_are_measured_for_every_policy_against_lru() -> None:
    import random

    from bench.eviction import POLICIES
    from bench.eviction_costs import measure

    for name in POLICIES:
        got = measure(name, 200, 2000, random.Random(1))
        assert got["access_ns"] > 0 and got["churn_ns"] > 0
