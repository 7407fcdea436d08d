"""TransferLimits: the bounds on the sidecar's own copies and on the sealed regions engines share
for them (gpu/sealed.py), composed into the settings.

Its own small module so that the settings import no torch. No state.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TransferLimits(BaseModel):
    """Bounds on the sidecar's own copies (REGISTER_KV_CACHE, LOAD_BLOCKS, SAVE_BLOCKS)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_planes: int = Field(1024, ge=1, le=4096, description="KV planes (tensor handles) per registration.")
    max_blocks_per_call: int = Field(
        1 << 16, ge=1, le=1 << 20, description="Engine block ids in one LOAD_BLOCKS or SAVE_BLOCKS."
    )
    max_chunks_per_call: int = Field(4096, ge=1, le=1 << 16, description="Chunks one call may copy.")
    max_copies_per_call: int = Field(
        1 << 21, ge=1, le=1 << 26, description="Block copies (planes x blocks) one call may make."
    )
    max_region_bytes: int = Field(
        64 << 30, ge=4096, le=1 << 44,
        description="Bytes of one sealed region an engine shares over its lifeline (its KV cache).",
    )  # fmt: skip
    max_region_bytes_per_instance: int = Field(
        256 << 30, ge=4096, le=1 << 46, description="Bytes of sealed regions one engine instance may share."
    )
    max_region_bytes_total: int = Field(
        1 << 40, ge=4096, le=1 << 46, description="Bytes of sealed regions all engines together may share."
    )
