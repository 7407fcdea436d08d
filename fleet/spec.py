"""What a sidecar tells the directory about itself, and the directory's own settings.

`InstanceSpec` is the body of a registration (`POST /v1/instances`, sent again as each heartbeat)
and the form of a static instance in the directory's configuration: the sidecar's id, HTTP URL,
KV-event PUB and replay endpoints, the key namespaces its engines registered (model, layout
fingerprint, rank, group, block and chunk size), how tenants appear in its events (salt mode and
the id of the deployment key that hashes them), which of its L2 tiers are shared (by a fingerprint
of the tier's address, never its credentials), and its load. `DirectoryConfig` holds the
directory's knobs (timeouts, tier weights, load weights, the static instances, the secret that
derives each sidecar's credential, the bounds on what one registrant may make it hold).

State: none; frozen pydantic models, safe from any thread.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator

_FROZEN = ConfigDict(frozen=True, extra="forbid")

_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")
_HEX8 = re.compile(r"^[0-9a-f]{16}$")
_ENDPOINT = re.compile(r"^(tcp://[^\s]{1,240}|ipc://[^\s]{1,240})$")


def _check_id(value: str) -> str:
    if not _ID.match(value):
        raise ValueError("must be 1..128 characters of letters, digits and ._:@/-")
    return value


def _check_hex8(value: str) -> str:
    if not _HEX8.match(value):
        raise ValueError("must be 16 lowercase hex digits (8 bytes)")
    return value


def _check_endpoint(value: str) -> str:
    if not _ENDPOINT.match(value):
        raise ValueError("must be a tcp:// or ipc:// ZMQ endpoint")
    return value


def _check_url(value: str) -> str:
    if not re.match(r"^https?://[^\s/]{1,253}(/[^\s]*)?$", value) or len(value) > 1024:
        raise ValueError("must be an http:// or https:// URL")
    return value.rstrip("/")


InstanceId = Annotated[str, AfterValidator(_check_id)]
Hex8 = Annotated[str, AfterValidator(_check_hex8)]
Endpoint = Annotated[str, AfterValidator(_check_endpoint)]
HttpUrl = Annotated[str, AfterValidator(_check_url)]
SaltMode = Literal["hashed", "plain", "omit"]


class NamespaceSpec(BaseModel):
    """One key namespace an engine registered with the sidecar (engine/keys.py `Namespace`)."""

    model_config = _FROZEN

    model: str = Field(min_length=1, max_length=256, description="kvdepot model id of the engine")
    layout_fp: Hex8 = Field(description="KV layout fingerprint, hex")
    kv_rank: int = Field(0, ge=0, le=1 << 16)
    group: int = Field(0, ge=0, le=1 << 16)
    block_size: int = Field(ge=1, le=1 << 20, description="engine block size, tokens")
    chunk_size: int = Field(ge=1, le=1 << 20, description="sidecar chunk size, tokens")


class TierSpec(BaseModel):
    """One L2 tier of the sidecar, as its events name it (`medium`: the adapter name upper-cased)."""

    model_config = _FROZEN

    medium: str = Field(min_length=1, max_length=64, pattern=r"^[A-Z0-9_.-]+$")
    shared: Hex8 | None = Field(
        None, description="fingerprint of a tier several sidecars reach (e.g. one Redis); None: local"
    )


class InstanceSpec(BaseModel):
    """A sidecar, as it registers (and heartbeats) or as the configuration lists it."""

    model_config = _FROZEN

    id: InstanceId
    url: HttpUrl = Field(description="the sidecar's HTTP control plane (GET /inventory)")
    events_endpoint: Endpoint = Field(description="its KV-event PUB endpoint")
    replay_endpoint: Endpoint | None = Field(None, description="its replay ROUTER endpoint")
    namespaces: list[NamespaceSpec] = Field(default_factory=list, max_length=64)
    salt_mode: SaltMode = "hashed"
    salt_key_id: Hex8 | None = Field(
        None, description="id of the deployment key hashing tenants (salt_mode=hashed)"
    )
    tiers: list[TierSpec] = Field(default_factory=list, max_length=32)
    l1_medium: str = Field(
        "CPU", min_length=1, max_length=64, pattern=r"^[A-Z0-9_.-]+$",
        description="the medium its events give L1 (kv_events.medium_names; an event without one is L1's)",
    )  # fmt: skip
    engine_url: HttpUrl | None = Field(None, description="the engine this sidecar serves, for routers")
    l1_usage: float = Field(0.0, ge=0.0, le=1.0, description="fraction of L1 in use")
    queue_depth: int = Field(0, ge=0, le=1 << 30, description="requests in flight on the data plane")
    incarnation: str | None = Field(None, max_length=64, description="KV-event incarnation id")
    events_seq: int | None = Field(None, ge=-1, le=1 << 62, description="last KV-event batch sent")


class TierWeights(BaseModel):
    model_config = _FROZEN

    l1: float = Field(1.0, ge=0, le=1000, description="weight of a prefix token in the instance's L1")
    local_l2: float = Field(0.5, ge=0, le=1000, description="... in one of its own L2 tiers")
    shared_l2: float = Field(0.25, ge=0, le=1000, description="... in a shared L2 it is attached to")


class DirectoryConfig(BaseModel):
    """The directory's knobs (the `[directory]` table of its TOML file)."""

    model_config = _FROZEN

    instance_timeout_s: float = Field(
        15.0, gt=0, le=86400, description="a registered sidecar silent this long leaves the scores"
    )
    max_instances: int = Field(256, ge=1, le=4096)
    weights: TierWeights = Field(default_factory=TierWeights)
    load_weight_l1: float = Field(
        0.0, ge=0, le=100, description="score minus this times the instance's L1 usage (0..1)"
    )
    load_weight_queue: float = Field(
        0.0, ge=0, le=100, description="score minus this times queue_depth / (queue_depth + 8)"
    )
    static_instances: list[InstanceSpec] = Field(default_factory=list, max_length=4096)
    sidecar_token: SecretStr | None = Field(
        None, description="the sidecars' admin token, for GET /inventory of the static instances only "
        "(a registered one is sent its own credential)",
    )  # fmt: skip
    instance_secret: SecretStr | None = Field(
        None, description="derives each sidecar's credential, HMAC-SHA256(secret, instance id) "
        "(fleet/credentials.py); unset: http.admin_token derives them",
    )  # fmt: skip
    max_chunks_per_instance: int = Field(
        1 << 20, ge=1, le=1 << 26, description="chunks indexed per instance, all its media together "
        "(more are dropped, counted)",
    )  # fmt: skip
    max_event_bytes: int = Field(
        2 << 20, ge=1 << 16, le=1 << 30,
        description="largest KV-event or replay frame taken (ZMQ MAXMSGSIZE: a larger one drops the "
        "connection unread); libzmq holds at most max_queued_event_bytes / this of them per instance",
    )  # fmt: skip
    max_queued_event_bytes: int = Field(
        32 << 20, ge=1 << 20, le=1 << 32,
        description="bytes of received KV-event messages waiting, all instances together (at least "
        "max_event_bytes); one that does not fit is dropped, counted, and its instance resynced",
    )  # fmt: skip
    forget_after: float = Field(
        4.0, ge=1, le=1000,
        description="a registered instance silent this many times instance_timeout_s is forgotten",
    )  # fmt: skip
    deployment_keys: list[SecretStr] = Field(
        default_factory=list, max_length=8,
        description="the sidecars' l2.auth_keys (the first hashes tenants, as theirs does); "
        "unset: salted requests count only instances publishing salt_mode=plain",
    )  # fmt: skip
    replay_timeout_s: float = Field(2.0, gt=0, le=600, description="a replay answer's deadline")
    inventory_timeout_s: float = Field(60.0, gt=0, le=3600, description="a listing's deadline")
    catchup_grace_s: float = Field(
        2.0, gt=0, le=600,
        description="a heartbeat's sequence ahead of what arrived this long: ask the replay socket",
    )  # fmt: skip
    probe_s: float = Field(
        10.0, gt=0, le=3600, description="a stream quiet this long: ask the replay socket what came after"
    )
    match: bool = Field(
        False, description="keep the non-prefix matcher's tables (/v1/match): decodes the token ids "
        "of every store (ingest costs more)",
    )
    match_slots: int = Field(1 << 15, ge=1 << 8, le=1 << 24, description="slots per matcher scope (2^n)")
    match_max_scopes: int = Field(64, ge=1, le=4096, description="(model, tenant, adapter) scopes kept")
    max_tokens: int = Field(1 << 20, ge=1, le=1 << 24, description="longest request scored")
    max_lora_candidates: int = Field(4, ge=1, le=64, description="extra keys tried per adapter name")

    @model_validator(mode="after")
    def _queue_takes_a_frame(self) -> DirectoryConfig:
        if self.max_queued_event_bytes < self.max_event_bytes:
            raise ValueError("max_queued_event_bytes must be at least max_event_bytes (one frame fits)")
        return self
