"""Benchmarks (`kvdepot bench <name>`). Each prints ONE JSON object on stdout and compares against a
baseline measured in the same run, because a ratio survives a noisy machine and seconds do not.

Role: a package of its own beside the sidecar's, outside its import graph: nothing in app/, api/,
engine/, storage/, gpu/ or fleet/ imports it but the command line (app/cli.py), and only once the
command is `bench` (tests/check_layering.py). The benchmarks play the engine: they may use the
connector's client, the wiring (app.main, fleet.serve) and every layer.

`COMMANDS` is the one table of them: the subcommand's name, its module (which defines
`add_arguments(parser)`, the argument builder, and `run(args) -> exit status`) and its help line.
A module is imported when the command line is built with the benchmarks' arguments, never by the
other commands (`serve`, `directory`, `route`, `status`).

Primitives: add_commands(subparsers) (one subparser per row, dest `bench`); run_bench(args).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    """`kvdepot bench <name>`."""
    module: str
    """Its module: `add_arguments(parser)` and `run(args) -> int`."""
    help: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        builder: Callable[[argparse.ArgumentParser], None] = import_module(self.module).add_arguments
        builder(parser)

    def run(self, args: argparse.Namespace) -> int:
        runner: Callable[[argparse.Namespace], int] = import_module(self.module).run
        return runner(args)


COMMANDS: tuple[Command, ...] = (
    Command("server", "bench.server", "data-plane store/retrieve/lookup vs memcpy"),
    Command("l2", "bench.l2", "write-behind and prefetch through an L2 adapter"),
    Command("fuzz", "bench.fuzz", "hostile frames at a live sidecar while another client pings it"),
    Command("ttft", "bench.ttft", "time to first token, cold then warm, of an OpenAI server"),
    Command(
        "footprint", "bench.footprint", "sidecar memory beyond its arena, idle and loaded; start-up time"
    ),
    Command("directory", "bench.directory", "the directory's index: score, ingest, rebuild, memory"),
    Command("route", "bench.route", "what `kvdepot route` adds to a request, against the engine directly"),
    Command("engine", "bench.engine", "sustained load with cache workloads against an OpenAI server"),
    Command("eviction", "bench.eviction", "hit rate per L1 eviction policy and L2 admission, no model"),
    Command("tracing", "bench.tracing", "CPU a span costs (loop and process) against the SDK's own path"),
    Command(
        "copies", "bench.copies", "the sidecar's own KV block copies (CUDA IPC or CPU) vs the client's copy_"
    ),
    Command("events", "bench.events", "the event bus's cost on store/lookup cycles; a flood never blocks"),
)
_BY_NAME = {c.name: c for c in COMMANDS}


def add_commands(sub: Any) -> None:
    """One subparser per row of `COMMANDS` under `sub` (`add_subparsers(dest="bench")`)."""
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.name, help=command.help))


def run_bench(args: argparse.Namespace) -> int:
    command = _BY_NAME.get(args.bench)
    if command is None:
        raise SystemExit(f"unknown benchmark {args.bench}")
    return command.run(args)
