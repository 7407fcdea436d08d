"""Engine registrations: per instance, bounded, idle ones dropped to make room."""

from __future__ import annotations

import pytest

from app.errors import Overloaded
from engine.keys import KVLayout
from engine.registry import EngineRegistry

LAYOUT = KVLayout(dtype="float16", num_layers=2, num_kv_heads=1, head_dim=32, block_size=16, kind="t",
                  chunk_size=16)  # fmt: skip


def test_two_instances_of_one_model_get_different_ids_and_the_same_namespace() -> None:
    reg = EngineRegistry(chunk_size=16, capacity=1 << 20)
    a = reg.register("m", LAYOUT, instance="a" * 32)
    b = reg.register("m", LAYOUT, instance="b" * 32)
    assert a.engine_id != b.engine_id and a.namespace == b.namespace
    assert reg.register("m", LAYOUT, instance="a" * 32) == a  # idempotent per instance


def test_fifty_thousand_registers_stay_bounded() -> None:
    reg = EngineRegistry(chunk_size=16, capacity=1 << 20, max_total=100, max_per_instance=4, idle_s=60)
    dropped: list[int] = []
    reg.on_drop.append(dropped.append)
    refused = 0
    for i in range(50_000):
        try:
            reg.register(f"m{i % 7}", LAYOUT, instance=f"{i // 7:032x}", now=i / 100)
        except Overloaded:
            refused += 1
    assert len(reg) == 100 and len(reg.all()) == 100
    assert refused > 0 and dropped  # full: idle ones (older than 60 s) made room, the rest refused
    last = len(reg.all())
    for i in range(4):
        reg.register(f"x{i}", LAYOUT, instance="c" * 32, now=1000.0)  # the idle ones make room
    with pytest.raises(Overloaded):  # but one instance has at most max_per_instance
        reg.register("x4", LAYOUT, instance="c" * 32, now=1000.0)
    assert len(reg.all()) == last
