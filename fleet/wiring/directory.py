"""`kvdepot directory`: the fleet directory's process. Settings, wiring, one event loop.

Settings (`DirectorySettings`): `http` (as the sidecar's; port 8090; `admin_token` guards
registration), `directory` (fleet/spec.py DirectoryConfig), `logging`. Sources: the flags, then
the TOML file (`--config`), then the defaults; no environment variables (the sidecar's `KVDEPOT_`
names stay the sidecar's).

`DirectoryService.build()` binds the HTTP port and derives the tenant key from
`directory.deployment_keys` (ConfigError on bad settings); `run()` registers the static instances,
starts their subscriptions, serves HTTP on the same loop, sweeps the registered instances silent
`forget_after` timeouts (every `instance_timeout_s`), and on SIGTERM/SIGINT stops accepting,
cancels the subscriptions and returns 0.

Primitives in call order: load_directory_settings(overrides, file) -> DirectoryService(settings)
-> build() -> await run() (-> request_stop()).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import uvicorn
from prometheus_client import CollectorRegistry
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app import __version__
from app.errors import ConfigError
from app.serving import QuietUvicorn, bind_listener, guarded_http
from app.settings import HttpSettings, LoggingSettings
from app.settings_load import settings_errors, sourced_settings
from fleet.directory import Directory
from fleet.http.directory_app import DirectoryContext, create_directory_app, registration_secret
from fleet.http.directory_metrics import DirectoryCollector
from fleet.http.subscriptions import Subscriptions
from fleet.spec import DirectoryConfig
from storage.auth import BlobKeys, parse_secret

log = structlog.get_logger("kvdepot.directory")

DEFAULT_PORT = 8090


class DirectorySettings(BaseSettings):
    """Everything `kvdepot directory` can be told. Frozen once built."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    http: HttpSettings = Field(
        default_factory=lambda: HttpSettings(port=DEFAULT_PORT, max_body_bytes=8 << 20)
    )
    directory: DirectoryConfig = Field(default_factory=DirectoryConfig)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)


def load_directory_settings(overrides: Mapping[str, Any], config_file: Path | None) -> DirectorySettings:
    sourced = sourced_settings(DirectorySettings, config_file, environment=False)
    with settings_errors(config_file):
        built = sourced()
        http = built.http
        changes = {k: v for k, v in overrides.items() if v is not None}
        if changes:
            http = HttpSettings(**{**http.model_dump(), **changes})
    return DirectorySettings.model_construct(http=http, directory=built.directory, logging=built.logging)


def tenant_key(config: DirectoryConfig) -> tuple[bytes | None, str | None]:
    """The MAC key the sidecars hash tenants with (`l2.auth_keys`' first), and its key id."""
    if not config.deployment_keys:
        return None, None
    try:
        secret = parse_secret(config.deployment_keys[0].get_secret_value())
    except ValueError as exc:
        raise ConfigError(f"directory.deployment_keys: {exc}") from None
    keys = BlobKeys([secret])
    return keys.signer.key, keys.signer.key_id.hex()


class DirectoryService:
    def __init__(self, settings: DirectorySettings) -> None:
        self.settings = settings
        self._stop = asyncio.Event()
        self.sock: socket.socket | None = None
        self.directory: Directory | None = None

    def build(self) -> None:
        s = self.settings
        key, key_id = tenant_key(s.directory)
        self.directory = Directory(s.directory, key, key_id)
        host, port = s.http.host, s.http.port
        sock = bind_listener(host, port)
        self.sock = sock

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        if self.directory is None or self.sock is None:
            raise RuntimeError("build() first")
        s = self.settings
        d = self.directory
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per inventory fetch
        subs = Subscriptions(d, s.directory, registration_secret(s.http, s.directory))
        metrics = CollectorRegistry()
        metrics.register(DirectoryCollector(d))
        ctx = DirectoryContext(http=s.http, directory=d, subscriptions=subs, metrics=metrics)
        config = uvicorn.Config(
            create_directory_app(ctx), log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=2, http=guarded_http(s.http),
        )  # fmt: skip
        server = QuietUvicorn(config)
        now = time.monotonic()
        for spec in s.directory.static_instances:
            d.registry.register(spec, now, static=True)
            subs.start(spec.id)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        serving = loop.create_task(server.serve(sockets=[self.sock]), name="http")
        sweeper = loop.create_task(_sweep(d, subs), name="sweeper")
        port = self.sock.getsockname()[1]
        log.info(
            "kvdepot_directory_started", version=__version__, http=f"http://{s.http.host}:{port}",
            static_instances=len(s.directory.static_instances),
            tenant_key="set" if d.scorer.key_id else "none",
        )  # fmt: skip
        try:
            stop = loop.create_task(self._stop.wait())
            done, _ = await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)
            if serving in done and serving.exception() is not None:
                raise serving.exception()  # type: ignore[misc]
            stop.cancel()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            server.should_exit = True
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(serving, 5)
            await subs.close()
            self.sock.close()
            log.info("kvdepot_directory_stopped")
        return 0


async def _sweep(d: Directory, subs: Subscriptions) -> None:
    """Forget the registered instances silent too long, every instance_timeout_s."""
    while True:
        await asyncio.sleep(d.registry.timeout_s)
        for gone in d.registry.sweep(time.monotonic()):
            subs.stop(gone)
            log.info("directory_instance_forgotten", instance=gone, why="silent")
