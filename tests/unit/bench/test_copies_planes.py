"""The engine side of `bench copies` on CPU (a real sealed memfd region): the checks it reports catch
a wrong byte, the baseline copies move the chunks' bytes plane-major as the sidecar lays them out,
and the CUDA mode says what it needs where torch sees no GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bench.copies_planes import CUDA_NEEDS, Planes, Shape, cuda_missing

SHAPE = Shape(layers=2, blocks=16, block_tokens=4, kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=8)
CHUNKS = 2
SRC = list(range(CHUNKS * SHAPE.blocks_per_chunk))
DST = [b + len(SRC) for b in SRC]


@pytest.fixture
def planes() -> Iterator[Planes]:
    made = Planes(SHAPE, "cpu", CHUNKS)
    made.fill(SRC, seed=3)
    yield made
    made.close()


def test_the_shape_is_vllms_paged_layout() -> None:
    assert (SHAPE.block_bytes, SHAPE.blocks_per_chunk, SHAPE.planes) == (4 * 8 * 2, 2, 4)
    assert SHAPE.chunk_bytes == 4 * 2 * 64


def test_a_baseline_round_trip_loads_the_known_bytes_and_a_wrong_byte_is_caught(planes: Planes) -> None:
    assert not planes.loaded_equal(SRC, DST)  # zero-filled blocks are not the known bytes
    planes.baseline_save(CHUNKS, SRC)
    planes.baseline_load(CHUNKS, DST)
    assert planes.loaded_equal(SRC, DST)
    planes.planes[3].view(torch.uint8).view(SHAPE.blocks, -1)[DST[-1], 5] ^= 1
    assert not planes.loaded_equal(SRC, DST)
    planes.clear(DST)
    assert not planes.loaded_equal(SRC, DST)


def test_the_host_buffer_holds_chunks_plane_major_and_the_l1_check_catches_a_wrong_byte(
    planes: Planes,
) -> None:
    planes.baseline_save(CHUNKS, SRC)
    views = [planes.host[c] for c in range(CHUNKS)]
    equal, digest = planes.l1_digest(views)
    assert equal and len(digest) == 64
    k_of_layer_0 = planes.planes[0].view(torch.uint8).view(SHAPE.blocks, -1)
    assert torch.equal(planes.host[1, : 2 * SHAPE.block_bytes].view(2, -1), k_of_layer_0[2:4])
    planes.host[1, -1] ^= 1
    wrong, other = planes.l1_digest(views)
    assert not wrong and other != digest


def test_the_cpu_planes_lie_in_one_sealed_region_the_handles_name(planes: Planes) -> None:
    region = planes.region()
    assert region is not None
    name, _, nbytes = region
    handles = planes.handles()
    assert [h.kind for h in handles] == ["cpu-memfd"] * SHAPE.planes
    assert {h.name for h in handles} == {name}
    assert nbytes == SHAPE.planes * SHAPE.blocks * SHAPE.block_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_without_a_gpu_the_cuda_mode_says_what_it_needs() -> None:
    missing = cuda_missing()
    assert missing is not None and missing.endswith(CUDA_NEEDS)
