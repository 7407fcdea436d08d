"""`kvdepot bench engine`: sustained load against an OpenAI-compatible server (vLLM with or
without the connector) with the workloads KV caches are judged by; a live display, ONE JSON object,
per-request CSV rows and a PNG plot.

Modules: workloads (token streams per seed), sender (streaming client and pacing), stats (records,
percentiles, summaries), metrics (hit counters from /metrics), display (rich, live), report (CSV,
plot, speed-ups), cli (options and the runner).
"""

from bench.engine.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
