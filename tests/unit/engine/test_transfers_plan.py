"""A call's copy plan, expanded in the transfer executor: runs of consecutive engine blocks become
one copy, skipped blocks are left alone, and the bytes land where the chunk format says."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.transfers import _Plan
from gpu.device import CpuDevice
from gpu.transfer import TransferEngine
from kvdepot_connector.layout import ChunkFormat

BLOCKS, WIDTHS, BPC = 16, (8, 24), 4


def planes() -> list[torch.Tensor]:
    return [torch.arange(BLOCKS * w, dtype=torch.int64).to(torch.uint8).view(BLOCKS, w) + 100 * i
            for i, w in enumerate(WIDTHS)]  # fmt: skip


def run(plan: _Plan, batch: int = 2) -> int:
    with ThreadPoolExecutor(1, thread_name_prefix="test-transfer") as pool:
        return asyncio.run(TransferEngine(CpuDevice(), pool, batch=batch).run_lazy(plan.copies))


def test_a_save_plan_copies_each_block_to_its_place_in_the_chunk() -> None:
    fmt = ChunkFormat(WIDTHS, BPC)
    src = planes()
    arena = torch.zeros(3 * fmt.chunk_bytes, dtype=torch.uint8)
    ids = [[3, 4, 5, 9], [15, 0, 1, 2]]
    plan = _Plan(arena, src, fmt, [(0, ids[0], 0), (2 * fmt.chunk_bytes, ids[1], 0)], to_arena=True)
    assert len(list(plan.copies())) == 2 * 2 * 2  # two runs per chunk and plane
    assert run(plan) == 2 * fmt.chunk_bytes
    for c, offset in enumerate((0, 2 * fmt.chunk_bytes)):
        for (pos, n), plane, w in zip(fmt.spans(), src, WIDTHS, strict=True):
            got = arena[offset + pos : offset + pos + n].view(BPC, w)
            assert torch.equal(got, plane[ids[c]])
    assert not arena[fmt.chunk_bytes : 2 * fmt.chunk_bytes].any()  # the chunk between untouched


def test_a_load_plan_skips_the_blocks_before_skip_and_fills_the_rest() -> None:
    fmt = ChunkFormat(WIDTHS, BPC)
    arena = torch.randint(0, 256, (fmt.chunk_bytes,), dtype=torch.uint8)
    dst = [torch.zeros(BLOCKS, w, dtype=torch.uint8) for w in WIDTHS]
    ids = [7, 6, 5, 4]
    run(_Plan(arena, dst, fmt, [(0, ids, 2)], to_arena=False))
    for (pos, n), plane, w in zip(fmt.spans(), dst, WIDTHS, strict=True):
        rows = arena[pos : pos + n].view(BPC, w)
        assert torch.equal(plane[[5, 4]], rows[2:])
        assert not plane[[7, 6]].any()  # skipped: the engine computed these itself
