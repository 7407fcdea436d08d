"""The `kvdepot` command: `serve` runs the sidecar, `bench ...` runs the benchmarks.

Bad settings end the process with status 2 and one line on stderr that names the setting.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from app.errors import ConfigError


def _serve_parser(sub: Any) -> None:
    sp = sub.add_parser("serve", help="run the sidecar (HTTP control plane + ZMQ data plane)")
    sp.add_argument("--config", type=Path, help="TOML file with settings (lowest precedence above defaults)")
    sp.add_argument("--http-host", help="control-plane address (default 127.0.0.1)")
    sp.add_argument("--http-port", type=int, help="control-plane port (default 8080)")
    sp.add_argument("--data-dir", type=Path, help="data directory (default ./kvdepot-data)")
    sp.add_argument("--l1-size-gb", type=float, help="L1 shared-memory arena size in GiB (default 1)")
    sp.add_argument("--data-plane", help="ZMQ URL (default ipc://<data-dir>/dataplane.sock)")
    sp.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    sp.add_argument("--kv-events-endpoint", help="publish KV events (vLLM's format) on this ZMQ endpoint")


def _bench_parser(sub: Any) -> None:
    bp = sub.add_parser("bench", help="benchmarks; each prints one JSON object")
    bsub = bp.add_subparsers(dest="bench", required=True)
    from app.bench import server as bench_server

    bench_server.add_arguments(bsub.add_parser("server", help="data-plane store/retrieve/lookup vs memcpy"))
    from app.bench import l2 as bench_l2

    bench_l2.add_arguments(bsub.add_parser("l2", help="write-behind and prefetch through an L2 adapter"))
    from app.bench import fuzz as bench_fuzz

    bench_fuzz.add_arguments(
        bsub.add_parser("fuzz", help="hostile frames at a live sidecar while another client pings it")
    )
    from app.bench import ttft as bench_ttft

    bench_ttft.add_arguments(
        bsub.add_parser("ttft", help="time to first token, cold then warm, of an OpenAI server")
    )
    from app.bench import footprint as bench_footprint

    bench_footprint.add_arguments(
        bsub.add_parser("footprint", help="sidecar memory beyond its arena, idle and loaded; start-up time")
    )
    from app.bench import engine as bench_engine

    bench_engine.add_arguments(
        bsub.add_parser("engine", help="sustained load with cache workloads against an OpenAI server")
    )
    from app.bench import events as bench_events

    bench_events.add_arguments(
        bsub.add_parser("events", help="the event bus's cost on store/lookup cycles; a flood never blocks")
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdepot", description="KV-cache sidecar for LLM inference engines")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _bench_parser(sub)
    return parser


def _run_serve(args: argparse.Namespace) -> int:
    from app.logs import configure_logging
    from app.main import Service
    from app.settings_load import load_settings

    settings = load_settings(
        {
            "http.host": args.http_host,
            "http.port": args.http_port,
            "data_dir": args.data_dir,
            "l1.size_gb": args.l1_size_gb,
            "data_plane.url": args.data_plane,
            "logging.level": args.log_level,
            "kv_events.endpoint": args.kv_events_endpoint,
        },
        config_file=args.config,
    )
    configure_logging(settings.logging)

    async def main() -> int:
        service = Service(settings)
        service.build()
        return await service.run()

    import uvloop

    # uvloop: a measurably shorter round trip on the data plane than the default loop.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _run_serve(args)
        from app.bench import run_bench

        return run_bench(args)
    except ConfigError as exc:
        print(f"kvdepot: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
