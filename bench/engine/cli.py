"""`kvdepot bench engine`: options, and the runner that ties workload, sender, stats and outputs.

Role: parse the options into a workload (its token ids capped by the model's vocabulary, stated by
the options or asked of the servers: vocab.py), run its passes against `--url` (then, with the same
seed, against `--baseline-url`), read the servers' and the sidecar's `/metrics` before and after each
pass, show the live display, and print ONE JSON object (also to `--json`; with why requests failed,
per server), with `--csv` and `--plot` files beside it; failures are repeated on stderr.

State: the servers' HTTP clients, the aggregator, the display; all on one event loop
(`asyncio.run` in `run`).

Primitives, in call order: `add_arguments(parser)`, `run(args)` -> exit status (2 on bad options).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.engine import metrics, vocab
from bench.engine.display import Display
from bench.engine.report import failure_lines, speedups, write_csv, write_plot
from bench.engine.sender import Server, run_pass
from bench.engine.stats import Aggregator, failures, summarize
from bench.engine.vocab import TokenRange
from bench.engine.workloads import (
    ORDERS,
    WORKLOADS,
    Options,
    PassSpec,
    PrefixSuffixTuner,
    RequestSpec,
    WorkloadError,
    build,
)

DEFAULT_REQUESTS = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the OpenAI-compatible server under test")
    p.add_argument("--baseline-url", help="the same model without the connector: the same passes, after")
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--model", help="model name (default: the server's first model)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default 1)")
    load.add_argument("--qps", type=float, default=None, help="Poisson arrivals per second, no in-flight cap")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help=f"requests of a pooled measured pass ({DEFAULT_REQUESTS})")
    size.add_argument("--duration", type=float, help="seconds each measured pass runs (pooled: endless)")
    p.add_argument("--seed", type=int, default=0, help="every token stream is a function of the seed")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (exactly)")
    p.add_argument("--token-low", type=int, default=100, help="smallest token id in prompts")
    p.add_argument("--token-high", type=int, default=7999, help="largest token id in prompts")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="the model's vocabulary: ids up to vocab-size - 1 (the server is not asked)",
    )
    p.add_argument("--tokenizer", type=Path, help="model folder: vocab_size from config.json (not asked)")
    p.add_argument("--cache-salt", help="cache_salt sent with every request to --url")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-warmup", action="store_true", help="skip the one short request before timing")
    p.add_argument("--sidecar-url", help="the sidecar's HTTP base URL: its hits per pass, tier capacity")
    p.add_argument("--json", type=Path, help="also write the JSON object here")
    p.add_argument("--csv", type=Path, help="per-request rows")
    p.add_argument("--plot", type=Path, help="PNG: TTFT CDF per pass, TTFT over time")
    p.add_argument("--quiet", action="store_true", help="no live display")
    w = p.add_argument_group("workloads")
    w.add_argument("--reuse", default="uniform", help="pooled picks: uniform or zipf:S (e.g. zipf:1.1)")
    w.add_argument("--documents", type=int, default=8, help="long-doc-qa: documents")
    w.add_argument("--document-tokens", type=int, default=2048, help="long-doc-qa: tokens per document")
    w.add_argument("--questions", type=int, default=2, help="long-doc-qa: asks per document, measured")
    w.add_argument("--question-tokens", type=int, default=16, help="long-doc-qa, shared-system-prompt")
    w.add_argument("--order", default="tile", choices=ORDERS, help="long-doc-qa: measured order")
    w.add_argument("--users", type=int, default=4, help="multi-round-chat: users")
    w.add_argument("--rounds", type=int, default=3, help="multi-round-chat: rounds")
    w.add_argument("--user-tokens", type=int, default=64, help="multi-round-chat: tokens per message")
    w.add_argument("--system-tokens", type=int, default=1024, help="chat, shared-system-prompt")
    w.add_argument("--system-prompts", type=int, default=1, help="shared-system-prompt: how many")
    w.add_argument("--context-tokens", type=int, default=2048, help="prefix-suffix-tuner: tokens/request")
    w.add_argument("--suffix-tokens", type=int, default=128, help="prefix-suffix-tuner: unique tail")
    w.add_argument("--breaker-tokens", type=int, default=8, help="prefix-suffix-tuner: fixed separator")
    w.add_argument("--pool-size", type=int, help="prefix-suffix-tuner: prefixes (else from a capacity)")
    w.add_argument("--pool-multiple", type=float, default=1.05, help="pool = multiple x tier capacity")
    w.add_argument("--pool-tier", default="l1", help="l1 or an L2 adapter's name (read from --sidecar-url)")
    w.add_argument("--capacity-tokens", type=int, help="the tier's capacity in tokens (no sidecar needed)")
    w.add_argument("--prompt-tokens", type=int, default=2048, help="random-prefill: tokens per prompt")


async def _capacity(args: argparse.Namespace) -> int | None:
    if args.capacity_tokens is not None or args.workload != "prefix-suffix-tuner" or args.pool_size:
        return args.capacity_tokens  # type: ignore[no-any-return]
    if not args.sidecar_url:
        return None
    async with httpx.AsyncClient(base_url=args.sidecar_url, timeout=10) as client:
        resp = await client.get("/status")
        resp.raise_for_status()
        try:
            return metrics.tier_capacity_tokens(resp.json(), args.pool_tier)
        except (ValueError, KeyError) as exc:
            raise WorkloadError(f"--pool-tier {args.pool_tier}: {exc}") from exc


def _options(args: argparse.Namespace, capacity: int | None, largest_id: int | None) -> Options:
    high = args.token_high if largest_id is None else min(args.token_high, largest_id)
    low = min(args.token_low, high)
    requests = None if args.duration is not None else (args.requests or DEFAULT_REQUESTS)
    fields = {f.name for f in dataclasses.fields(Options)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    given |= {"token_low": low, "token_high": high, "requests": requests, "capacity_tokens": capacity}
    return Options(**given)


async def _scrape(server: Server | httpx.AsyncClient) -> metrics.Snapshot:
    if isinstance(server, Server):
        text = await server.metrics()
    else:
        try:
            resp = await server.get("/metrics")
            text = resp.text if resp.status_code == 200 else None
        except httpx.HTTPError:
            text = None
    return metrics.parse(text) if text else {}


async def _token_range(args: argparse.Namespace) -> TokenRange:
    """The options' vocabulary, else what every server (target, baseline) accepts."""
    stated = vocab.from_options(args.vocab_size, args.tokenizer)
    if stated is not None:
        return stated
    ranges: list[TokenRange] = []
    for url in (u for u in (args.url, args.baseline_url) if u):
        server = Server("probe", url, model=args.model, timeout=args.timeout, concurrency=1)
        try:
            ranges.append(await vocab.probe(server.client, await server.first_model(), args.token_high))
        finally:
            await server.close()
    return vocab.narrowest(ranges)


class Runner:
    def __init__(self, args: argparse.Namespace, options: Options, token_range: TokenRange) -> None:
        self.args = args
        self.options = options
        self.token_range = token_range
        self.agg = Aggregator()
        self.t0 = time.perf_counter()
        concurrency = args.concurrency or (1024 if args.qps else 1)
        self.concurrency = concurrency
        common = {"model": args.model, "timeout": args.timeout, "concurrency": concurrency}
        self.servers = [Server("target", args.url, cache_salt=args.cache_salt, **common)]
        if args.baseline_url:
            self.servers.append(Server("baseline", args.baseline_url, **common))
        self.sidecar = httpx.AsyncClient(base_url=args.sidecar_url, timeout=10) if args.sidecar_url else None
        self.display: Display | None = None
        if Display.enabled(args.quiet):
            self.display = Display(self.agg, f"kvdepot bench engine: {args.workload}", self.t0)

    async def close(self) -> None:
        for s in self.servers:
            await s.close()
        if self.sidecar is not None:
            await self.sidecar.aclose()

    async def _pass(self, server: Server, spec: PassSpec) -> dict[str, Any]:
        before = await _scrape(server)
        side_before = await _scrape(self.sidecar) if self.sidecar and server.name == "target" else None
        self.agg.begin_pass(server.name, spec.name, spec.total, time.perf_counter() - self.t0)
        deadline = time.perf_counter() + self.args.duration if self.args.duration and spec.measured else None
        rng = random.Random(f"{self.options.seed}/arrivals/{spec.name}")
        wall = await run_pass(
            server, spec, self.agg, t0=self.t0, concurrency=self.concurrency, qps=self.args.qps, rng=rng,
            deadline=deadline,
        )  # fmt: skip
        after = await _scrape(server)
        out: dict[str, Any] = {"name": spec.name, "measured": spec.measured} | summarize(
            self.agg.pass_records(), wall
        )
        out["hits"] = metrics.vllm_hits(before, after)
        self.agg.hit_rate = metrics.hit_rate(before, after)
        if side_before is not None and self.sidecar is not None:
            out["sidecar"] = metrics.sidecar_hits(side_before, await _scrape(self.sidecar))
        if self.display is not None:
            p50 = out["ttft_ms"]["p50"]
            rate = self.agg.hit_rate
            first = next((r.failure for r in self.agg.pass_records() if r.failure is not None), None)
            self.display.note(
                f"{server.name} {spec.name}: {out['ok']} ok, {out['errors']} errors, TTFT p50 {p50} ms, "
                f"hit rate {'-' if rate is None else f'{rate:.1%}'}"
                + (f"; first error {first}" if first else "")
            )
        return out

    async def _server(self, server: Server) -> list[dict[str, Any]]:
        await server.first_model()
        if not self.args.no_warmup:  # the first request after a start is slow once
            warm = RequestSpec("startup", 0, list(range(11, 27)), 1, "startup")
            rec = await server.send(warm, self.t0)
            if rec.error:
                raise RuntimeError(f"{server.name} ({server.url}): {rec.error}")
        return [await self._pass(server, spec) for spec in build(self.options).passes()]

    async def run(self) -> dict[str, Any]:
        load_before = os.getloadavg()[0]
        if self.display is not None:
            await self.display.start()
        try:
            results = [await self._server(s) for s in self.servers]
        finally:
            if self.display is not None:
                await self.display.stop()
        passes = results[0]
        if len(results) > 1:
            base = {p["name"]: p for p in results[1]}
            for p in passes:
                if p["name"] in base:
                    p["baseline"] = base[p["name"]]
            speedups(passes)
        first = passes[0]["ttft_ms"]["p50"] if passes else None
        for p in passes:
            p50 = p["ttft_ms"]["p50"]
            p["ttft_speedup_vs_first_pass"] = round(first / p50, 3) if first and p50 else None
        target = [r for r in self.agg.records if r.server == "target"]
        measured = {p["name"] for p in passes if p["measured"]}
        span = [r for r in target if r.pass_name in measured]
        wall = sum(p["wall_s"] for p in passes if p["measured"])
        options = {k: v for k, v in dataclasses.asdict(self.options).items() if k not in ("workload", "seed")}
        result: dict[str, Any] = {
            "bench": "engine", "workload": self.options.workload, "seed": self.options.seed,
            "url": self.args.url, "baseline_url": self.args.baseline_url, "model": self.servers[0].model,
            "concurrency": None if self.args.qps else self.concurrency, "qps": self.args.qps,
            "duration_s": self.args.duration, "options": options,
            "token_range": {"low": self.options.token_low, "high": self.options.token_high}
            | self.token_range.as_json(),
            "measured": summarize(span, wall), "passes": passes,
            "errors": sum(1 for r in self.agg.records if not r.ok),
            "failures": {s.name: failures([r for r in self.agg.records if r.server == s.name])
                         for s in self.servers},
            "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        }  # fmt: skip
        if self.options.workload == "prefix-suffix-tuner":
            tuner = build(self.options)
            assert isinstance(tuner, PrefixSuffixTuner)
            result["pool_size"] = tuner.pool
            result["pool_tier"] = self.args.pool_tier
            result["capacity_tokens"] = self.options.capacity_tokens
        if self.options.workload == "multi-round-chat":
            result["answer_ids_source"] = self.servers[0].ids_source
        self._outputs(result)
        return result

    def _outputs(self, result: dict[str, Any]) -> None:
        a = self.args
        if a.csv:
            write_csv(a.csv, self.agg.records)
        if a.plot:
            write_plot(a.plot, self.agg.records, f"{a.workload} (seed {a.seed})")
            result["plot"] = str(a.plot)


def run(args: argparse.Namespace) -> int:
    for name in ("concurrency", "requests"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"kvdepot bench engine: --{name} must be at least 1", file=sys.stderr)
            return 2
    if (args.qps is not None and not args.qps > 0) or (args.duration is not None and not args.duration > 0):
        print("kvdepot bench engine: --qps and --duration must be above 0", file=sys.stderr)
        return 2

    async def main() -> dict[str, Any]:
        capacity = await _capacity(args)
        build(_options(args, capacity, None))  # bad options fail here, before any request
        token_range = await _token_range(args)
        options = _options(args, capacity, token_range.largest_id)
        build(options)
        runner = Runner(args, options, token_range)
        try:
            return await runner.run()
        finally:
            await runner.close()

    try:
        result = asyncio.run(main())
    except WorkloadError as exc:
        print(f"kvdepot bench engine: {exc}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"kvdepot bench engine: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(result)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    for line in failure_lines(result["failures"]):
        print(f"kvdepot bench engine: {line}", file=sys.stderr)
    return 1 if result["errors"] else 0
