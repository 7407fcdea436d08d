"""`kv_events` settings: the ZMQ publisher of KV events in vLLM's wire format (composed into
app/settings.py). Off unless `endpoint` is set; ipc:// or CURVE unless plain tcp is allowed
explicitly, loopback unless told otherwise."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from api.kvevents.wire import MEDIUM_CPU

_Z85_KEY = 40

TierKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
"""`l1` or an L2 adapter's name (its name may be one not configured yet: adapters come at runtime)."""
Medium = Annotated[str, Field(pattern=r"^[A-Z0-9_.-]{1,64}$")]
"""A `medium` as events carry it: upper case, as vLLM's (GPU, CPU) and NVIDIA Dynamo's (DISK)."""


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (brackets stripped), None for ipc://."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not port:
        raise ValueError(f"{endpoint}: tcp endpoints need host:port")
    return host.strip("[]")


def is_any_address(host: str) -> bool:
    if host in ("*", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


class KvEventsSettings(BaseModel):
    """KV events (BlockStored / BlockRemoved / AllBlocksCleared) on ZMQ, as vLLM publishes them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint: str | None = Field(
        None, max_length=200,
        description="PUB (XPUB) endpoint to bind, e.g. tcp://127.0.0.1:5557 or ipc://...; unset = off.",
    )  # fmt: skip
    replay_endpoint: str | None = Field(
        None, max_length=200, description="ROUTER endpoint serving replays of the last `buffer` batches."
    )
    topic: str = Field(
        "kv@{host}@{model}", max_length=200,
        description="Topic of each batch; {host} and {model} are replaced (one model's events per batch).",
    )  # fmt: skip
    host: str | None = Field(None, max_length=200, description="{host} in the topic; default: the host name.")
    buffer: int = Field(10000, ge=1, le=1_000_000, description="Batches kept for replay.")
    buffer_max_bytes: int = Field(
        64 << 20, ge=1 << 16, le=1 << 34, description="Bytes of batches kept for replay (oldest go first)."
    )
    max_batch_events: int = Field(64, ge=1, le=65536, description="Most events in one published batch.")
    sndhwm: int = Field(
        10000, ge=1, le=1 << 24,
        description="Messages queued per subscriber; past it new batches to that subscriber are dropped "
        "(counted) and the subscriber recovers them by replay.",
    )  # fmt: skip
    salt: Literal["hashed", "plain", "omit"] = Field(
        "hashed",
        description="How a tenant (cache_salt) appears: hashed with the deployment key (L2 auth key), "
        "as is, or not at all.",
    )
    curve_secret_key: SecretStr | None = Field(
        None, description="ZMQ CURVE server secret key (Z85, 40 characters): the sockets require CURVE."
    )
    curve_public_key: str | None = Field(
        None, min_length=_Z85_KEY, max_length=_Z85_KEY, description="The server's CURVE public key (Z85)."
    )
    curve_allowed_clients: list[str] = Field(
        default_factory=list, max_length=1024,
        description="CURVE public keys (Z85) of the subscribers allowed; empty = any client that knows "
        "the server key.",
    )  # fmt: skip
    allow_any_address: bool = Field(False, description="Allow binding 0.0.0.0, :: or *.")
    allow_plaintext_tcp: bool = Field(
        False,
        description="Allow a tcp:// endpoint without CURVE: any process that reaches the port (any "
        "local user on loopback) reads every tenant's token ids. Default: ipc:// (socket files 0600) "
        "or CURVE.",
    )
    max_subscriptions: int = Field(
        1024, ge=1, le=1 << 20,
        description="Distinct model-specific topic filters applied on the PUB socket; past it more are "
        "refused (counted). Filters that are a prefix of kv@<host>@ (\"\" included) are always applied.",
    )  # fmt: skip

    medium_names: dict[TierKey, Medium] = Field(
        default_factory=dict, max_length=64,
        description="The `medium` each tier's events and inventory name: `l1` or an L2 adapter's name "
        "-> a name. Unnamed: L1 is CPU (vLLM's name for blocks offloaded to host memory), an L2 tier "
        "its adapter's name upper-cased. NVIDIA Dynamo's router scores GPU (or no medium) by "
        "default, keeps CPU and DISK as tiers of their own and drops any other name: {l1 = \"GPU\"} "
        "makes L1 count where it scores. Names must differ (a consumer tells tiers apart by them).",
    )  # fmt: skip

    def medium(self, tier: str) -> str:
        """The medium of `tier` (`l1`/`L1`, or an adapter's name)."""
        if tier.lower() == "l1":
            return self.medium_names.get("l1", MEDIUM_CPU)
        return self.medium_names.get(tier, tier.upper())

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError("must start with tcp:// or ipc://")
        endpoint_host(endpoint)
        return endpoint

    @model_validator(mode="after")
    def _check(self) -> KvEventsSettings:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            host = endpoint_host(value) if value else None
            if host is not None and is_any_address(host) and not self.allow_any_address:
                raise ValueError(
                    f"{name} {value} binds every address: events show token ids and tenants; bind "
                    "loopback or the pod's own address, or set kv_events.allow_any_address=true"
                )
            if host is not None and self.curve_secret_key is None and not self.allow_plaintext_tcp:
                raise ValueError(
                    f"{name} {value} is plain tcp: any process reaching it (any local user on "
                    "loopback) reads every tenant's token ids; use ipc:// (0600), set CURVE keys "
                    "(kv_events.curve_secret_key), or set kv_events.allow_plaintext_tcp=true"
                )
        named = list(self.medium_names.values())
        if len(set(named)) != len(named):
            raise ValueError(
                "kv_events.medium_names: two tiers have one name (consumers could not tell them apart)"
            )
        if "L1" in self.medium_names:
            raise ValueError("kv_events.medium_names: name the memory tier `l1`")
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("replay_endpoint needs endpoint")
        if (self.curve_secret_key is None) != (self.curve_public_key is None):
            raise ValueError("curve_secret_key and curve_public_key go together")
        if self.curve_secret_key is not None and len(self.curve_secret_key.get_secret_value()) != _Z85_KEY:
            raise ValueError("curve_secret_key must be 40 Z85 characters")
        if self.curve_allowed_clients and self.curve_secret_key is None:
            raise ValueError("curve_allowed_clients needs curve_secret_key")
        if any(len(k) != _Z85_KEY for k in self.curve_allowed_clients):
            raise ValueError("curve_allowed_clients: each key must be 40 Z85 characters")
        return self
