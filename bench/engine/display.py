"""The live terminal display of `kvdepot bench engine` (rich).

Role: about once a second, redraw one panel: server and pass, progress (done / total, a bar when
the total is known), requests in flight, rolling TTFT p50/p90/p99 of the last requests, output
tokens/s, hit rate of the last finished pass, errors. Off when stdout is not a terminal or with
`--quiet`: then nothing but the final JSON object reaches stdout.

State: a `rich.live.Live` and the redraw task. The task runs on the benchmark's event loop and
reads the aggregator there (rich's own refresh thread is not used: `auto_refresh=False`).

Primitives, in call order: `Display.enabled(quiet)`, `await display.start()`, `display.note(text)`,
`await display.stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from bench.engine.stats import Aggregator

REDRAW_S = 1.0


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.1f}{unit}"


class Display:
    def __init__(self, agg: Aggregator, title: str, t0: float) -> None:
        self.agg = agg
        self.title = title
        self.t0 = t0
        self.notes: list[str] = []
        self.console = Console(file=sys.stdout)
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def enabled(quiet: bool) -> bool:
        return not quiet and sys.stdout.isatty()

    def render(self) -> Group:
        s = self.agg.live(time.perf_counter() - self.t0)
        table = Table(title=self.title, show_header=False, expand=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        total = "?" if s.total is None else str(s.total)
        table.add_row("server / pass", f"{s.server} / {s.pass_name}")
        table.add_row("progress", f"{s.done}/{total} done, {s.in_flight} in flight, {s.elapsed_s:.0f} s")
        table.add_row(
            "TTFT ms (rolling)",
            f"p50 {_fmt(s.ttft_p50_ms)}  p90 {_fmt(s.ttft_p90_ms)}  p99 {_fmt(s.ttft_p99_ms)}",
        )
        table.add_row("output tok/s", _fmt(s.output_tokens_per_s))
        table.add_row("hit rate (last pass)", "-" if s.hit_rate is None else f"{s.hit_rate:.1%}")
        table.add_row("errors", Text(str(s.errors), style="red" if s.errors else ""))
        parts: list[Table | ProgressBar | Text] = [table]
        if s.total:
            parts.append(ProgressBar(total=s.total, completed=s.done, width=60))
        parts.extend(Text(n) for n in self.notes[-4:])
        return Group(*parts)

    def note(self, text: str) -> None:
        self.notes.append(text)

    async def _redraw(self) -> None:
        while True:
            self.live.update(self.render(), refresh=True)
            await asyncio.sleep(REDRAW_S)

    async def start(self) -> None:
        self.live.start(refresh=False)
        self._task = asyncio.create_task(self._redraw())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.live.update(self.render(), refresh=True)
        self.live.stop()
