"""What every L2 adapter's config is: the base model each family's config extends.

Role: `AdapterConfigBase` fixes what the engine, the control plane and the wiring may read of any
adapter's config (its `type`, `name`, `authenticate`) and what the config says of itself, so that
nobody outside a family looks at a family's own fields:
  redacted()          the config as answers and logs show it: without secrets (Redis: the URL's
                      credentials are ***); default: itself
  local_paths()       the files or directories of this machine it creates, writes and deletes
                      (checked against l2.allowed_roots); default: none
  shared_location()   which backend other sidecars share through it, canonical and without
                      credentials (the fleet directory fingerprints it); default: None, not shared
  transfer_threads()  how many threads move its bytes at once (`bench l2`'s baseline); default: 0
Each family's config (storage/<family>/config.py) is a frozen pydantic model with a `type` Literal;
storage/registry.py unites them, discriminated by `type`, into the `AdapterConfig` that
app/settings composes and the control plane parses. Every field is documented and bounded;
unknown keys are errors.

State: none (immutable models). Imports nothing else from the package.

Primitives: AdapterConfigBase; AdapterName (a name, never `l1`); FROZEN (the models' config).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

FROZEN = ConfigDict(frozen=True, extra="forbid")


def _adapter_name(name: str) -> str:
    if name == "l1":
        raise ValueError("'l1' is the name of the memory tier in quotas and metrics; choose another")
    return name


AdapterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$"), AfterValidator(_adapter_name)]
"""An L2 adapter's name: its tier in quotas and metrics, hence never `l1`."""


class AdapterConfigBase(BaseModel):
    """Base of every adapter's config. A family's config narrows `type` to its Literal, gives
    `name` its default and declares `authenticate` (last, with its family's default)."""

    model_config = FROZEN

    type: str
    name: AdapterName
    if TYPE_CHECKING:  # declared by each family (its own default, its place among its fields)
        authenticate: bool

    def redacted(self) -> Self:
        """The config as the control plane and the logs show it: without secrets."""
        return self

    def local_paths(self) -> list[Path]:
        """Files, directories or devices of this machine the adapter writes (l2.allowed_roots)."""
        return []

    def shared_location(self) -> str | None:
        """The backend other sidecars share through this adapter, as one canonical string without
        credentials; None when the adapter is this sidecar's own."""
        return None

    def transfer_threads(self) -> int:
        """How many threads move the adapter's bytes at once (stores and loads alike); 0: none of
        its own (the bytes move on the event loop)."""
        return 0
