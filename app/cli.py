"""The `kvdepot` command: `serve` runs the sidecar, `status` summarizes a running one,
`directory` runs the fleet directory, `route` the reference router, `bench ...` the benchmarks.

Bad settings end the process with status 2 and one line on stderr that names the setting.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from app import malloc
from app.errors import ConfigError

if TYPE_CHECKING:
    from app.settings import LoggingSettings

BENCH_HELP = "benchmarks; each prints one JSON object"


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


def _directory_parser(sub: Any) -> None:
    dp = sub.add_parser("directory", help="run the fleet directory (registry, KV-event index, /v1/score)")
    dp.add_argument("--config", type=Path, help="TOML file with the directory's settings")
    dp.add_argument("--http-host", help="address to listen on (default 127.0.0.1)")
    dp.add_argument("--http-port", type=int, help="port (default 8090)")


def _route_parser(sub: Any) -> None:
    rp = sub.add_parser(
        "route", help="cache-aware OpenAI-compatible router in front of engines (asks the directory)"
    )
    rp.add_argument(
        "--config", type=Path, help="TOML file: engines, directory_url, timeouts (docs/fleet/router.md)"
    )
    rp.add_argument(
        "--engine", action="append", metavar="URL[=SIDECAR_ID]",
        help="an engine's URL and the id of its sidecar in the directory; repeat per engine "
        "(replaces the file's engines)",
    )  # fmt: skip
    rp.add_argument("--directory-url", help="the directory's URL (unset: route by load only)")
    rp.add_argument("--http-host", help="address to listen on (default 127.0.0.1)")
    rp.add_argument("--http-port", type=int, help="port (default 8100)")
    rp.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _bench_parser(sub: Any) -> None:
    bp = sub.add_parser("bench", help=BENCH_HELP)
    from bench import add_commands  # the benchmarks' table (bench/__init__.py), only for `bench`

    add_commands(bp.add_subparsers(dest="bench", required=True))


def build_parser(*, benches: bool = True) -> argparse.ArgumentParser:
    """The command line. `benches=False`: `bench` without its subcommands, whose modules import
    what only benchmarks need (redis-py, torch, ...): what `serve` and the others parse with."""
    parser = argparse.ArgumentParser(prog="kvdepot", description="KV-cache sidecar for LLM inference engines")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _directory_parser(sub)
    _route_parser(sub)
    if benches:
        _bench_parser(sub)
    else:
        sub.add_parser("bench", help=BENCH_HELP, add_help=False)
    from app import status_cli

    status_cli.add_arguments(sub.add_parser("status", help="a terminal summary of a running sidecar"))
    return parser


def _run_serve(args: argparse.Namespace) -> int:
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
    return _run_service(settings.logging, lambda: Service(settings))


def _run_directory(args: argparse.Namespace) -> int:
    from fleet.wiring.directory import DirectoryService, load_directory_settings

    settings = load_directory_settings({"host": args.http_host, "port": args.http_port}, args.config)
    return _run_service(settings.logging, lambda: DirectoryService(settings))


class _Service(Protocol):
    def build(self) -> None: ...

    async def run(self) -> int: ...


def _run_service(logging: LoggingSettings, make: Callable[[], _Service]) -> int:
    """Logging configured, the allocator tuned, then the service made, built and run on a uvloop
    event loop (a measurably shorter round trip on the data plane than the default loop)."""
    from app.logs import configure_logging

    configure_logging(logging)
    malloc.tune()

    async def main() -> int:
        service = make()
        service.build()
        return await service.run()

    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def _run_route(args: argparse.Namespace) -> int:
    from fleet.wiring.route import load_router_settings, parse_engine_flag, run_router

    engines = None if not args.engine else [parse_engine_flag(e) for e in args.engine]
    settings = load_router_settings(
        args.config,
        {
            "engines": engines,
            "directory_url": args.directory_url,
            "host": args.http_host,
            "port": args.http_port,
            "log_level": args.log_level,
        },
    )
    malloc.tune()
    return run_router(settings)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    benches = not words or words[0] not in ("serve", "directory", "route", "status")
    args = build_parser(benches=benches).parse_args(argv)
    try:
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "directory":
            return _run_directory(args)
        if args.command == "route":
            return _run_route(args)
        if args.command == "status":
            from app import status_cli

            return status_cli.run(args)
        from bench import run_bench

        return run_bench(args)
    except ConfigError as exc:
        print(f"kvdepot: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
