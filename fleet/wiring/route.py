"""`kvdepot route`: builds the router's settings from a TOML file and flags, binds, serves.

Sources, highest precedence first: flags (`--engine URL[=SIDECAR_ID]` repeated, `--directory-url`,
`--http-host`, `--http-port`, `--log-level`), then the TOML file (`--config`; the keys of
fleet/router_config.RouterSettings at its top level, engines as `[[engines]]` tables), then the
defaults. Bad settings and a port in use raise ConfigError with one line naming the setting.

Client connections are bounded (httpkit/connections.py): headers within `header_timeout_s`,
`max_connections` open at once, idle kept-alive ones closed after `idle_timeout_s`; bodies within
`body_timeout_s` (the app's RequestGuard).

State: none past start-up; the app owns its state. SIGTERM/SIGINT: stop accepting, finish the
requests in flight (5 s at most), stop the background task, exit 0.

Primitives in call order: load_router_settings(config_file, overrides) -> RouterSettings;
run_router(settings) -> exit status.
"""

from __future__ import annotations

import asyncio
import signal
import tomllib
from pathlib import Path
from typing import Any

import structlog
import uvicorn
from pydantic import ValidationError

from app.errors import ConfigError
from app.logs import configure_logging
from app.serving import QuietUvicorn, bind_listener
from app.settings import LoggingSettings
from app.settings_load import describe_validation_error
from app.supervisor import Supervisor
from fleet.http.router_app import RouterState, create_router_app
from fleet.router_config import RouterSettings
from httpkit.connections import ConnectionLimits, GuardedH11Protocol

__all__ = ["load_router_settings", "parse_engine_flag", "run_router"]

log = structlog.get_logger("kvdepot.route")


def parse_engine_flag(value: str) -> dict[str, str]:
    """`URL` or `URL=SIDECAR_ID` (the sidecar id the directory names the engine's sidecar by)."""
    url, sep, sidecar = value.partition("=")
    return {"url": url, "sidecar_id": sidecar} if sep else {"url": url}


def load_router_settings(config_file: Path | None, overrides: dict[str, Any]) -> RouterSettings:
    values: dict[str, Any] = {}
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config: file {config_file} does not exist")
        try:
            values = tomllib.loads(config_file.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config: {config_file}: {exc}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RouterSettings(**values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def run_router(settings: RouterSettings) -> int:
    configure_logging(LoggingSettings(level=settings.log_level))
    sock = bind_listener(settings.host, settings.port, keys="")
    app = create_router_app(settings, Supervisor())
    state: RouterState = app.state.router

    def cut(kind: str) -> None:  # header_timeout, body_timeout, connection_limit
        state.metrics.errors.labels(kind).inc()

    limits = ConnectionLimits(
        settings.header_timeout_s, settings.max_connections, cut, settings.body_timeout_s
    )
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5,
        http=GuardedH11Protocol.with_limits(limits), timeout_keep_alive=settings.idle_timeout_s,
    )  # fmt: skip
    server = QuietUvicorn(config)
    host, port = sock.getsockname()[:2]
    log.info(
        "route_listening", host=host, port=port, engines=[e.url for e in settings.engines],
        directory=settings.directory_url,
    )  # fmt: skip

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_exit)
        await server.serve(sockets=[sock])

    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve())
    log.info("route_stopped")
    return 0
