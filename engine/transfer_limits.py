"""TransferLimits: the bounds on the sidecar's own copies, composed into the settings.

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
