"""L2Parts: the engine's L2 machinery as one value, built by app/main (absent without any L2)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.l2.prefetch import PrefetchController
from engine.l2.store import StoreController
from engine.l2.tiers import L2Tiers


@dataclass(frozen=True, slots=True)
class L2Parts:
    tiers: L2Tiers
    store: StoreController
    prefetch: PrefetchController
