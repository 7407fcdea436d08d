"""Outputs of `kvdepot bench engine`: per-request CSV rows, the PNG plot, speed-ups vs the baseline.

Role: write what the run measured to files; the JSON object itself is assembled by the runner
(cli.py) from the pass summaries and hit counters and printed once.

State: none. Called once, on the benchmark's event loop, after the last pass (the plot is drawn
with matplotlib's Agg backend, no display needed).

Primitives, in call order: `speedups(passes)` adds `ttft_speedup_vs_baseline` to each pass that
ran on both servers; `write_csv(path, records)`; `write_plot(path, records, title)`;
`failure_lines(failures)` for the terminal (stderr) when requests failed.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engine.stats import RequestRecord

CSV_FIELDS = (
    "server", "pass", "index", "group", "start_s", "ttft_ms", "e2e_ms", "itl_ms_mean", "prompt_tokens",
    "output_tokens", "error",
)  # fmt: skip


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:.3f}"


def write_csv(path: Path, records: Sequence[RequestRecord]) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_FIELDS)
        for r in records:
            itl = sum(r.itl_s) / len(r.itl_s) if r.itl_s else None
            out.writerow([
                r.server, r.pass_name, r.index, r.group, f"{r.start_s:.4f}", _ms(r.ttft_s), _ms(r.e2e_s),
                _ms(itl), r.prompt_tokens, r.output_tokens, r.error or "",
            ])  # fmt: skip


def speedups(passes: list[dict[str, Any]]) -> None:
    """Per pass: baseline TTFT over target TTFT (p50 and mean; above 1: the target is faster)."""
    for p in passes:
        base = p.get("baseline")
        if not base:
            continue
        out: dict[str, float | None] = {}
        for stat in ("p50", "p90", "mean"):
            t, b = p["ttft_ms"][stat], base["ttft_ms"][stat]
            out[stat] = round(b / t, 3) if t and b else None
        p["ttft_speedup_vs_baseline"] = out


def failure_lines(failures: dict[str, dict[str, Any]]) -> list[str]:
    """Per server with failed requests: how many, by status, then each of the first few failures
    (the JSON's `failures`, as stats.failures made them)."""
    lines: list[str] = []
    for server, f in failures.items():
        if not f["errors"]:
            continue
        counts = ", ".join(f"{kind} x{n}" for kind, n in f["by_status"].items())
        lines.append(f"{server}: {f['errors']} requests failed ({counts}); the first {len(f['first'])}:")
        for one in f["first"]:
            head = one["kind"] if one["status"] is None else f"HTTP {one['status']}"
            where = " (in the stream)" if one["in_stream"] else ""
            lines.append(f"  {one['pass']} #{one['index']}: {head}{where}: {one['message']}")
    return lines


def write_plot(path: Path, records: Sequence[RequestRecord], title: str) -> None:
    """Two panels: the TTFT CDF of each (server, pass), and TTFT over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, timeline) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[tuple[str, str], list[RequestRecord]] = {}
    for r in records:
        if r.ok:
            series.setdefault((r.server, r.pass_name), []).append(r)
    for (server, name), rows in series.items():
        ttft = sorted(r.ttft_s * 1000 for r in rows if r.ttft_s is not None)
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        style = "--" if server == "baseline" else "-"
        cdf.step(ttft, ys, style, where="post", label=f"{server}: {name}")
        timeline.scatter(
            [r.start_s for r in rows], [(r.ttft_s or 0) * 1000 for r in rows], s=10,
            marker="x" if server == "baseline" else "o", label=f"{server}: {name}",
        )  # fmt: skip
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT CDF per pass")
    timeline.set_xlabel("request sent at (s since start)")
    timeline.set_ylabel("TTFT (ms)")
    timeline.set_title("TTFT over time")
    for ax in (cdf, timeline):
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
