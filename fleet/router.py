"""The router's decision: which engine serves a request, from the directory's scores and the load.

Role: pure logic. `Engines` holds what the router knows of each engine (requests in flight through
this router, health); `parse_scores` checks the directory's `/v1/score` answer; `Engines.choose`
turns scores into a decision:

1. the directory's instances, best first, each mapped to its configured engine: by the engine's
   `sidecar_id` (the instance's `id`), else its `sidecar_url` (the instance's `url`), else its `url`
   (the instance's `engine_url`, when the sidecar advertises one); the first one that holds a
   prefix (`prefix_tokens > 0`), is healthy and not excluded is chosen (reason `prefix`), unless
   it has `max_imbalance` more requests in flight than the least loaded engine (then `imbalance`);
2. otherwise the least loaded healthy engine (fewest in flight; ties to the one used least
   recently), with the reason a metric counts: `no_prefix`, `unknown_instance` (the directory names
   only sidecars no configured engine has), `imbalance`, or the reason the caller gives
   (`directory_down`, `directory_timeout`, `no_directory`, `no_model`, `tokenize_failed`, an
   Unscorable's `why`; `retry` for a retry without scores).

Unhealthy engines (a failed request or health poll marks one for `unhealthy_s`) are avoided unless
every engine is; `exclude` (those already tried for this request) always wins.

State: `Engines` (per-engine counters and health). Touched only by the router's event loop.

Primitives in call order: parse_scores(answer) -> list[Score]; Engines.choose(scores, reason,
exclude) -> Decision; Engines.acquire(engine) ... Engines.release(engine); Engines.mark_failed /
mark_healthy.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.errors import ProtocolError
from app.redact import redact_text, redact_url
from fleet.router_config import EngineEntry

__all__ = ["Decision", "Engine", "Engines", "Score", "parse_scores"]

MAX_INSTANCES = 4096


@dataclass(frozen=True, slots=True)
class Score:
    """One instance of the directory's answer."""

    id: str
    prefix_tokens: int
    score: float
    url: str | None = None
    engine_url: str | None = None


def parse_scores(answer: Any) -> list[Score]:
    """The instances of a `/v1/score` answer, best first as the directory sent them. A malformed
    answer raises ProtocolError (the caller routes by load)."""
    if not isinstance(answer, Mapping):
        raise ProtocolError("directory answer is not a JSON object")
    instances = answer.get("instances")
    if not isinstance(instances, list) or len(instances) > MAX_INSTANCES:
        raise ProtocolError("directory answer: `instances` is not a list (or is too long)")
    out: list[Score] = []
    for item in instances:
        if not isinstance(item, Mapping):
            raise ProtocolError("directory answer: an instance is not an object")
        ident, prefix, score = item.get("id"), item.get("prefix_tokens"), item.get("score")
        if not isinstance(ident, str) or type(prefix) is not int or prefix < 0:
            raise ProtocolError("directory answer: an instance lacks a string `id` or int `prefix_tokens`")
        if not isinstance(score, (int, float)) or isinstance(score, bool):
            raise ProtocolError("directory answer: an instance's `score` is not a number")
        url, engine_url = item.get("url"), item.get("engine_url")
        out.append(Score(
            ident, prefix, float(score),
            url.rstrip("/") if isinstance(url, str) else None,
            engine_url.rstrip("/") if isinstance(engine_url, str) else None,
        ))  # fmt: skip
    return out


@dataclass(slots=True)
class Engine:
    """One engine and the router's view of it."""

    index: int
    url: str
    sidecar_id: str | None
    sidecar_url: str | None = None
    in_flight: int = 0
    served: int = 0
    unhealthy_until: float = 0.0
    last_error: str | None = None
    last_used: int = 0
    shown: str = ""
    """The URL as metrics, headers, logs and /status show it: credentials masked (app/redact.py)."""

    def __post_init__(self) -> None:
        self.shown = redact_url(self.url)

    def healthy(self, now: float) -> bool:
        return now >= self.unhealthy_until


@dataclass(frozen=True, slots=True)
class Decision:
    """The engine chosen, why, and the prefix the directory said it holds (0 for a fallback)."""

    engine: Engine
    reason: str
    prefix_tokens: int = 0

    @property
    def routed(self) -> bool:
        return self.reason == "prefix"


@dataclass
class Engines:
    entries: Sequence[EngineEntry]
    unhealthy_s: float
    max_imbalance: int
    clock: Callable[[], float] = time.monotonic
    all: list[Engine] = field(init=False)
    _by_sidecar: dict[str, Engine] = field(init=False)
    _by_sidecar_url: dict[str, Engine] = field(init=False)
    _by_url: dict[str, Engine] = field(init=False)
    _ticks: itertools.count[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all = [Engine(i, e.url, e.sidecar_id, e.sidecar_url) for i, e in enumerate(self.entries)]
        self._by_sidecar = {e.sidecar_id: e for e in self.all if e.sidecar_id is not None}
        self._by_sidecar_url = {e.sidecar_url: e for e in self.all if e.sidecar_url is not None}
        self._by_url = {e.url: e for e in self.all}
        self._ticks = itertools.count(1)

    def engine_of(self, score: Score) -> Engine | None:
        """The configured engine an instance of the directory's answer stands for, if any."""
        engine = self._by_sidecar.get(score.id)
        if engine is None and score.url is not None:
            engine = self._by_sidecar_url.get(score.url)
        if engine is None and score.engine_url is not None:
            engine = self._by_url.get(score.engine_url)
        return engine

    def candidates(self, exclude: Iterable[Engine] = ()) -> list[Engine]:
        """Engines not excluded, the healthy ones if any is, else all of them (a fleet that failed
        everywhere is retried rather than refused)."""
        skip = {e.index for e in exclude}
        left = [e for e in self.all if e.index not in skip]
        now = self.clock()
        healthy = [e for e in left if e.healthy(now)]
        return healthy or left

    def least_loaded(self, exclude: Iterable[Engine] = ()) -> Engine | None:
        pool = self.candidates(exclude)
        if not pool:
            return None
        return min(pool, key=lambda e: (e.in_flight, e.last_used, e.index))

    def choose(
        self, scores: Sequence[Score] | None, reason: str, exclude: Iterable[Engine] = ()
    ) -> Decision | None:
        """The engine for a request; None when every engine is excluded. `scores` None means the
        directory was not asked or did not answer; `reason` is then the fallback's reason."""
        excluded = list(exclude)
        fallback = self.least_loaded(excluded)
        if fallback is None:
            return None
        if scores is None:
            return Decision(fallback, reason)
        pool = {e.index for e in self.candidates(excluded)}
        named = False
        for score in scores:
            engine = self.engine_of(score)
            if engine is None:
                continue
            named = True
            if score.prefix_tokens <= 0 or engine.index not in pool:
                continue
            if self.max_imbalance and engine.in_flight - fallback.in_flight >= self.max_imbalance:
                return Decision(fallback, "imbalance")
            return Decision(engine, "prefix", score.prefix_tokens)
        return Decision(fallback, "no_prefix" if named or not scores else "unknown_instance")

    def acquire(self, engine: Engine) -> None:
        engine.in_flight += 1
        engine.served += 1
        engine.last_used = next(self._ticks)

    def release(self, engine: Engine) -> None:
        engine.in_flight -= 1

    def mark_failed(self, engine: Engine, error: str) -> None:
        engine.unhealthy_until = self.clock() + self.unhealthy_s
        engine.last_error = error[:300]

    def mark_healthy(self, engine: Engine) -> None:
        engine.unhealthy_until = 0.0

    def status(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [
            {
                "url": e.shown,
                "sidecar_id": e.sidecar_id,
                "in_flight": e.in_flight,
                "served": e.served,
                "healthy": e.healthy(now),
                "last_error": None if e.last_error is None else redact_text(e.last_error),
            }
            for e in self.all
        ]
