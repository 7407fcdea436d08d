"""The router's settings (`kvdepot route`): engines, the directory, timeouts, limits.

Role: one frozen object built once at start-up by fleet/wiring/route.py from a TOML file and flags; every
field documented and bounded, unknown keys refused. The router is its own process: these settings
are not part of the sidecar's `Settings` (and take no `KVDEPOT_` environment variables).

State: the models only; immutable once built, safe from any thread.

Primitives: RouterSettings(...) (validated), EngineEntry(...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

__all__ = ["EngineEntry", "RouterSettings"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def _http_url(value: str, name: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{name} must be an http:// or https:// URL")
    return value.rstrip("/")


class EngineEntry(BaseModel):
    """One engine behind the router: its OpenAI server's URL and how the directory names the sidecar
    beside it: its `id` (`sidecar_id`), or its HTTP URL (`sidecar_url`); with neither, an instance
    is matched to it only when the directory's answer carries the engine's URL (`engine_url`,
    advertised by the sidecar's `fleet.engine_url`)."""

    model_config = _FROZEN

    url: str = Field(..., min_length=8, max_length=2048, description="The engine's base URL.")
    sidecar_id: str | None = Field(
        None, min_length=1, max_length=256, description="Id of the engine's sidecar in the directory."
    )
    sidecar_url: str | None = Field(
        None, min_length=8, max_length=2048,
        description="The sidecar's HTTP URL as the directory lists it (matched when no id is given).",
    )  # fmt: skip

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value, "url")

    @field_validator("sidecar_url")
    @classmethod
    def _sidecar_url(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value, "sidecar_url")


class RouterSettings(BaseModel):
    """Everything `kvdepot route` can be told."""

    model_config = _FROZEN

    host: str = Field("127.0.0.1", min_length=1, max_length=255, description="Address to listen on.")
    port: int = Field(8100, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    engines: tuple[EngineEntry, ...] = Field(
        ..., min_length=1, max_length=1024, description="The engines requests are spread over."
    )
    directory_url: str | None = Field(
        None, max_length=2048, description="The directory (`kvdepot directory`); unset = load only."
    )
    directory_timeout_ms: float = Field(
        50.0, gt=0, le=10_000,
        description="Deadline of one /v1/score call; past it the request is routed by load.",
    )  # fmt: skip
    tokenize_timeout_s: float = Field(
        2.0, gt=0, le=600, description="Deadline of one /tokenize call to an engine; past it: by load."
    )
    connect_timeout_s: float = Field(
        2.0, gt=0, le=600, description="Connecting to an engine; a refusal or this deadline: next engine."
    )
    read_timeout_s: float = Field(
        300.0, gt=0, le=86_400,
        description="Longest silence of an engine between two reads (the first byte after a long "
        "prefill included); an engine that hangs mid-stream is cut off after it.",
    )  # fmt: skip
    retries: int = Field(
        1, ge=0, le=16, description="Other engines tried when one fails before any byte was sent back."
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, le=1 << 30, description="Largest request body accepted (413 past it)."
    )
    max_response_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, le=1 << 32,
        description="Largest non-streamed engine answer kept to be relayed (502 past it).",
    )  # fmt: skip
    max_imbalance: int = Field(
        32, ge=0, le=1_000_000,
        description="The directory's choice is skipped for the least loaded engine when it has this "
        "many more requests in flight than that engine (0 = never skip).",
    )  # fmt: skip
    unhealthy_s: float = Field(
        5.0, ge=0, le=3600, description="An engine that failed is avoided this long (unless all are)."
    )
    health_interval_s: float = Field(
        2.0, gt=0, le=3600, description="How often each engine's /health is polled."
    )
    models_ttl_s: float = Field(
        10.0, gt=0, le=3600, description="How long the engines' /v1/models list (LoRA parents) is kept."
    )
    engine_api_key: SecretStr | None = Field(
        None, min_length=1,
        description="Bearer token of the router's own calls to the engines (/tokenize, /v1/models, "
        "/health) when they run with vLLM's --api-key; requests relayed carry the client's own header.",
    )  # fmt: skip
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600,
        description="A request's headers must all arrive within this long of the connection's opening "
        "(or of the first byte of a kept-alive connection's next request); past it: 408, closed.",
    )  # fmt: skip
    body_timeout_s: float = Field(
        60.0, gt=0, le=86_400,
        description="A request's body must all arrive within this long of its headers; past it: 408, "
        "the connection closed.",
    )  # fmt: skip
    idle_timeout_s: int = Field(
        5, ge=1, le=3600, description="A kept-alive client connection idle this long is closed."
    )
    max_connections: int = Field(
        1024, ge=1, le=1_000_000,
        description="Client connections open at once; past it a new one is answered 503 and closed.",
    )  # fmt: skip
    admin_token: SecretStr | None = Field(
        None, min_length=1,
        description="Bearer token `GET /status` needs (the engines' URLs and errors); unset: /status "
        "answers loopback clients only.",
    )  # fmt: skip
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    @field_validator("directory_url")
    @classmethod
    def _directory(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value, "directory_url")

    @model_validator(mode="after")
    def _distinct(self) -> RouterSettings:
        _listed_once("url", [e.url for e in self.engines])
        _listed_once("sidecar_id", [e.sidecar_id for e in self.engines if e.sidecar_id is not None])
        return self


def _listed_once(name: str, values: list[str]) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"engines: the same {name} is listed twice")
