"""fleet/router.py: the directory's answer checked, scores turned into a decision, the load and
health of engines honoured."""

from __future__ import annotations

from typing import Any

import pytest

from app.errors import ProtocolError
from fleet.router import Engines, Score, parse_scores
from fleet.router_config import EngineEntry, RouterSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int = 3, *, max_imbalance: int = 4) -> tuple[Engines, Clock]:
    clock = Clock()
    entries = [EngineEntry(url=f"http://e{i}:8000", sidecar_id=f"sc{i}") for i in range(n)]
    return Engines(entries, unhealthy_s=5.0, max_imbalance=max_imbalance, clock=clock), clock


def test_best_instance_holding_a_prefix_wins() -> None:
    engines, _ = fleet()
    d = engines.choose([Score("sc2", 512, 1.0), Score("sc0", 256, 0.5)], "")
    assert d is not None and (d.engine.url, d.reason, d.prefix_tokens) == ("http://e2:8000", "prefix", 512)
    assert d.routed


def test_no_prefix_unknown_instances_and_no_answer_fall_back_to_least_loaded() -> None:
    engines, _ = fleet()
    engines.acquire(engines.all[0])
    engines.acquire(engines.all[1])
    for scores, reason in (
        ([Score("sc0", 0, 0.0), Score("sc1", 0, 0.0)], "no_prefix"),
        ([], "no_prefix"),
        ([Score("other", 4096, 9.0)], "unknown_instance"),
        (None, "directory_down"),
    ):
        d = engines.choose(scores, "directory_down")
        assert d is not None and (d.engine.index, d.reason) == (2, reason)


def test_least_loaded_rotates_among_equals() -> None:
    engines, _ = fleet()
    order = []
    for _ in range(6):
        d = engines.choose(None, "no_directory")
        assert d is not None
        engines.acquire(d.engine)
        engines.release(d.engine)
        order.append(d.engine.index)
    assert order == [0, 1, 2, 0, 1, 2]


def test_an_unhealthy_or_excluded_engine_is_skipped_until_it_recovers() -> None:
    engines, clock = fleet()
    best = [Score("sc1", 1024, 1.0), Score("sc0", 256, 0.5)]
    engines.mark_failed(engines.all[1], "connect refused")
    d = engines.choose(best, "")
    assert d is not None and (d.engine.index, d.reason) == (0, "prefix")
    d = engines.choose(best, "", exclude=[engines.all[0]])
    assert d is not None and (d.engine.index, d.reason) == (2, "no_prefix")
    clock.now += 5.0
    d = engines.choose(best, "")
    assert d is not None and d.engine.index == 1
    # every engine failed: still tried (not refused), but never one already tried for the request
    for e in engines.all:
        engines.mark_failed(e, "down")
    d = engines.choose(best, "", exclude=[engines.all[1]])
    assert d is not None and d.engine.index == 0
    assert engines.choose(best, "", exclude=engines.all) is None


def test_an_overloaded_best_instance_yields_to_the_least_loaded() -> None:
    engines, _ = fleet(max_imbalance=4)
    for _ in range(4):
        engines.acquire(engines.all[0])
    d = engines.choose([Score("sc0", 2048, 1.0)], "")
    assert d is not None and (d.engine.index, d.reason) == (1, "imbalance")
    engines.release(engines.all[0])
    d = engines.choose([Score("sc0", 2048, 1.0)], "")
    assert d is not None and d.reason == "prefix"


@pytest.mark.parametrize(
    "answer",
    [
        [], "x", {"instances": "no"}, {"instances": [1]}, {"instances": [{"id": 1, "prefix_tokens": 1}]},
        {"instances": [{"id": "a", "prefix_tokens": -1, "score": 1}]},
        {"instances": [{"id": "a", "prefix_tokens": True, "score": 1}]},
        {"instances": [{"id": "a", "prefix_tokens": 1, "score": "high"}]},
        {"instances": [{"id": "a", "prefix_tokens": 1}] * 5000},
    ],
)
def test_a_malformed_directory_answer_is_a_protocol_error(answer: Any) -> None:
    with pytest.raises(ProtocolError):
        parse_scores(answer)


def test_scores_keep_the_directorys_order() -> None:
    answer = {"chunk_size": 256, "instances": [
        {"id": "b", "url": "u", "prefix_tokens": 512, "tiers": {"l1": 512}, "score": 2.0},
        {"id": "a", "url": "u", "prefix_tokens": 256, "tiers": {"l2": 256}, "score": 0.5},
    ]}  # fmt: skip
    assert parse_scores(answer) == [Score("b", 512, 2.0, "u"), Score("a", 256, 0.5, "u")]


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"engines": []}, "engines"),
        ({"engines": [{"url": "tcp://x:1"}]}, "http"),
        ({"engines": [{"url": "http://a:1"}, {"url": "http://a:1/"}]}, "twice"),
        ({"engines": [{"url": "http://a:1", "sidecar_id": "s"}, {"url": "http://b:1", "sidecar_id": "s"}]},
         "twice"),
        ({"engines": [{"url": "http://a:1"}], "directory_timeout_ms": 0}, "directory_timeout_ms"),
        ({"engines": [{"url": "http://a:1"}], "surprise": 1}, "surprise"),
    ],
)  # fmt: skip
def test_settings_refuse_what_cannot_work(values: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        RouterSettings(**values)


def test_instances_map_to_engines_by_id_then_sidecar_url_then_engine_url() -> None:
    entries = [
        EngineEntry(url="http://e0:8000", sidecar_id="sc0"),
        EngineEntry(url="http://e1:8000", sidecar_url="http://s1:8080"),
        EngineEntry(url="http://e2:8000"),
    ]
    engines = Engines(entries, unhealthy_s=5.0, max_imbalance=0)
    answer = {"instances": [
        {"id": "x", "url": "http://s1:8080/", "prefix_tokens": 256, "score": 3.0},
        {"id": "y", "url": "http://s9:8080", "engine_url": "http://e2:8000", "prefix_tokens": 256,
         "score": 2.0},
        {"id": "sc0", "url": "http://s0:8080", "prefix_tokens": 256, "score": 1.0},
    ]}  # fmt: skip
    got = [engines.engine_of(s) for s in parse_scores(answer)]
    assert [None if e is None else e.index for e in got] == [1, 2, 0]
    assert engines.engine_of(Score("z", 1, 1.0, "http://nowhere:1", "http://nowhere:2")) is None
