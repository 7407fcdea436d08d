"""LoopLag: how late the sidecar's event loop runs what is due. A task of its own asks to be woken
every `interval_s` and records how much later than asked it ran, in
`kvdepot_event_loop_lag_seconds` (a histogram). The lag is whatever kept the loop from running a
ready callback: a handler or a garbage collection holding it, or the process not getting a core
on a busy host; every data-plane reply waits out the same lag, so this is where to look when the
engine's calls are slow and the sidecar's own handling times (`kvdepot_dataplane_request_seconds`)
are not.

State: the histogram. Event loop only (the task); read at scrape time.

Primitives: LoopLag(registry) once, then the supervisor runs `run()` until the service stops
(`run(samples)`: that many measurements, then it returns).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

#: how often the loop is asked to wake the task
INTERVAL_S = 0.1
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLag:
    def __init__(self, registry: CollectorRegistry, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.lag = Histogram(
            "kvdepot_event_loop_lag_seconds",
            f"How much later than due the event loop woke a task asking to sleep {interval_s} s "
            "(a handler or a collection holding the loop, or no core for the process).",
            buckets=BUCKETS,
            registry=registry,
        )

    async def run(self, samples: int | None = None) -> None:
        """Measure until cancelled (or `samples` times)."""
        loop = asyncio.get_running_loop()
        taken = 0
        while samples is None or taken < samples:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lag.observe(max(0.0, loop.time() - due))
            taken += 1
