"""Benchmarks. Each prints ONE JSON object on stdout and compares against a baseline measured in
the same run, because a ratio survives a noisy machine and seconds do not."""

from __future__ import annotations

import argparse


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "server":
        from app.bench.server import run

        return run(args)
    if args.bench == "ttft":
        from app.bench.ttft import run as run_ttft

        return run_ttft(args)
    if args.bench == "l2":
        from app.bench.l2 import run as run_l2

        return run_l2(args)
    if args.bench == "fuzz":
        from app.bench.fuzz import run as run_fuzz

        return run_fuzz(args)
    if args.bench == "footprint":
        from app.bench.footprint import run as run_footprint

        return run_footprint(args)
    if args.bench == "events":
        from app.bench.events import run as run_events

        return run_events(args)
    if args.bench == "tracing":
        from app.bench.tracing import run as run_tracing

        return run_tracing(args)
    if args.bench == "directory":
        from app.bench.directory import run as run_directory

        return run_directory(args)
    if args.bench == "route":
        from app.bench.route import run as run_route

        return run_route(args)
    if args.bench == "engine":
        from app.bench.engine import run as run_engine

        return run_engine(args)
    if args.bench == "eviction":
        from app.bench.eviction import run as run_eviction

        return run_eviction(args)
    raise SystemExit(f"unknown benchmark {args.bench}")
