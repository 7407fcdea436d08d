"""PinSettings: the bounds of prefix pins (engine/pins/), defined beside the code that reads them.

app/settings.py composes it as `pins`. Frozen, unknown keys are errors, every field bounded.
State: none. Imports nothing else from the package.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PinSettings(BaseModel):
    """Prefix pins: `PUT /pins/{cache_salt}` keeps a token prefix's chunks from eviction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_pins: int = Field(1024, ge=0, le=100_000, description="Pins of all tenants together (0: no pins).")
    max_chunks: int = Field(
        4096, ge=1, le=1 << 16, description="Full chunks one pin may hold (its token_ids / chunk_size)."
    )
    max_ttl_s: int = Field(30 * 86400, ge=1, le=365 * 86400, description="Longest ttl_s a pin may ask for.")
    max_share: float = Field(
        0.5, gt=0, le=1.0,
        description="Share of a tier's capacity that the pins of all tenants together may hold; a pin "
        "past it is refused (409), so pins never take a whole tier.",
    )  # fmt: skip
    sweep_s: float = Field(1.0, ge=0.01, le=60, description="How often expired pins are released.")
    max_namespaces: int = Field(
        16, ge=1, le=1024,
        description="Namespaces of one model (layouts, kv ranks, groups) a pin accounts for and checks: "
        "those of the engines registered now, the most recently used first, else those registered since "
        "the start; so data-plane clients registering many namespaces neither inflate a pin's size nor "
        "slow GET /pins.",
    )  # fmt: skip
