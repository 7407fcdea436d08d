"""L2Settings: the L2 tiers and the controllers that feed them, defined beside the code that reads
them (engine/l2/); app/settings.py composes it as `l2`.

`adapters` is a list of adapter configs, each picked by its `type` among the types the registry
lists (storage/registry.py `AdapterConfig`); the store and prefetch fields are the controllers'
(engine/l2/store.py, engine/l2/prefetch.py); `auth_keys` the deployment's blob keys
(storage/auth.py). Frozen, unknown keys are errors, every field bounded. State: none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr

from storage.auth import parse_secret
from storage.registry import AdapterConfig, default_adapters


def _usable_key(key: SecretStr) -> SecretStr:
    parse_secret(key.get_secret_value())  # its ValueError says what is wrong, never the key
    return key


L2AuthKey = Annotated[SecretStr, AfterValidator(_usable_key)]
"""An L2 auth key: masked wherever settings are shown."""


class L2Settings(BaseModel):
    """The slower tiers behind L1 and the controllers that feed them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    adapters: list[AdapterConfig] = Field(
        default_factory=default_adapters,
        max_length=16,
        description="Adapters, in order (each `type` one of storage/registry.py's).",
    )
    store_policy: Literal["all", "first", "seen_twice"] = Field(
        "all", description="Which adapters a committed chunk is written to (seen_twice: only reused ones)."
    )
    store_queue_depth: int = Field(1024, ge=1, le=1 << 20, description="Pending write-behind chunks.")
    store_concurrency: int = Field(4, ge=1, le=256, description="Concurrent write-behind batches.")
    prefetch_deadline_ms: float = Field(
        500.0, gt=0, le=60_000, description="What has not arrived from L2 by then is a miss."
    )
    prefetch_max_inflight: int = Field(64, ge=1, le=1 << 16, description="Chunks being loaded at once.")
    fp8_values: bool = Field(False, description="Store V quantized to FP8 (e4m3) with scales; K exact.")
    allowed_roots: list[Path] = Field(
        default_factory=list,
        max_length=64,
        description="Directories a disk or slab adapter's paths must lie under (after symlinks and ..); "
        "empty = the data dir.",
    )
    lz4: bool = Field(False, description="Compress blobs with lz4.")
    auth_keys: list[L2AuthKey] = Field(
        default_factory=list,
        max_length=16,
        description="Secrets (hex or base64, 16+ bytes) that sign and check blobs of adapters with "
        "`authenticate`: the first signs, all verify (rotation). Empty: <data_dir>/l2.key, generated "
        "at the first start. Sidecars sharing a Redis must share them.",
    )
