"""The event loop's lag, as the sidecar measures it: a callback that holds the loop shows up in the
histogram as a wake-up that late."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from app.loop_lag import LoopLag


def samples(registry: CollectorRegistry) -> dict[str, float]:
    """The histogram's cumulative bucket counts by upper bound, and its count."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == "kvdepot_event_loop_lag_seconds_bucket":
                out[s.labels["le"]] = s.value
            elif s.name == "kvdepot_event_loop_lag_seconds_count":
                out["count"] = s.value
    return out


async def _measure(lag: LoopLag, hold_s: float) -> None:
    """Three measurements; a handler holds the loop for `hold_s` during the first."""
    asyncio.get_running_loop().call_later(0.02, time.sleep, hold_s)
    await lag.run(samples=3)


def test_a_loop_held_by_a_handler_is_recorded_as_late_as_it_was_held() -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry, interval_s=0.1)
    asyncio.run(_measure(lag, hold_s=0.4))
    counts = samples(registry)
    assert counts["count"] == 3
    assert counts["0.25"] < counts["+Inf"]  # one wake-up came at least 0.25 s late


def test_the_help_text_names_the_interval() -> None:
    registry = CollectorRegistry()
    LoopLag(registry, interval_s=0.1)
    (family,) = [m for m in registry.collect() if m.name == "kvdepot_event_loop_lag_seconds"]
    assert "0.1 s" in family.documentation
