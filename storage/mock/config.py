"""The mock adapter's config: capacity, simulated bandwidth and latency, fault injection.

Read by storage/mock/adapter.py; listed in storage/registry.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from storage.config import AdapterConfigBase, AdapterName


class MockAdapterConfig(AdapterConfigBase):
    """In-memory L2 with capacity, simulated bandwidth/latency and fault injection."""

    type: Literal["mock"] = "mock"
    name: AdapterName = "mock"
    capacity_gb: float = Field(1.0, gt=0, le=1024)
    bandwidth_gbps: float | None = Field(None, gt=0, description="Simulated transfer rate.")
    latency_ms: float = Field(0.0, ge=0, le=60_000, description="Simulated latency per batch.")
    error_rate: float = Field(0.0, ge=0, le=1, description="Probability an operation fails.")
    hang: bool = Field(False, description="Operations never complete (until detached).")
    corrupt_rate: float = Field(0.0, ge=0, le=1, description="Probability a load returns flipped bytes.")
    seed: int = Field(0, ge=0, description="Seed of the fault injector.")
    authenticate: bool = Field(False, description="Sign blobs and load only signed ones, as Redis does.")
