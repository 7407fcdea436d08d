"""Sealed memory: the sidecar maps only memfds whose size nobody can change, and never a file
opened by name; the arena is one too, so no client can truncate it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from engine.l1.arena import SealedArena
from gpu.device import CpuDevice, HandleError
from gpu.sealed import F_ADD_SEALS, REQUIRED_SEALS, RegionLimits, SealedRegions, SealError, open_sealed
from kvdepot_connector.handles import SharedTensor, export_tensor
from kvdepot_connector.shm import ArenaMapping, identity

HOLDER = "instance-a"


@pytest.fixture
def shared() -> Iterator[SharedTensor]:
    t = SharedTensor((4, 1024), torch.float16)
    t.tensor.fill_(3)
    yield t
    t.close()


def shared_copy(shared: SharedTensor) -> int:
    """The descriptor as the sidecar receives it over the lifeline: its own duplicate."""
    return os.dup(shared.fd)


def test_a_region_that_is_not_sealed_is_refused() -> None:
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8192)
    regions = SealedRegions()
    with pytest.raises(SealError, match="sealed"):
        regions.add(HOLDER, "r", fd, 8192)  # closes fd either way
    assert len(regions) == 0


def test_a_foreign_file_is_refused(tmp_path: Path) -> None:
    private = tmp_path / "secret"
    private.write_bytes(b"x" * 8192)
    fd = os.open(private, os.O_RDWR)
    try:
        with pytest.raises(SealError, match="memfd"):
            open_sealed(fd, 8192)
    finally:
        os.close(fd)


def test_a_region_smaller_than_declared_is_refused(shared: SharedTensor) -> None:
    with pytest.raises(SealError, match="declared"):
        SealedRegions().add(HOLDER, shared.name, shared_copy(shared), shared.nbytes + 1)


def test_the_owner_cannot_shrink_a_sealed_region_and_reads_never_fault(shared: SharedTensor) -> None:
    device = CpuDevice(SealedRegions())
    device.regions.add(HOLDER, shared.name, shared_copy(shared), shared.nbytes)
    view = device.open(msgspec.structs.asdict(export_tensor(shared.tensor, shared)), HOLDER)
    with pytest.raises(PermissionError):
        os.ftruncate(shared.fd, 0)  # the owner "tries to shrink"
    with pytest.raises(PermissionError):
        os.ftruncate(shared.fd, shared.nbytes * 2)
    assert float(view.float().sum()) == 3 * 4 * 1024  # every page still there: no SIGBUS
    view[0, 0] = 7  # the same memory as the engine's
    assert float(shared.tensor[0, 0]) == 7


def test_names_in_dev_shm_are_never_opened(tmp_path: Path) -> None:
    """On main, a cpu-shm handle named any /dev/shm file (a mode-0600 file of another program)."""
    name = f"kvdepot-test-foreign-{os.getpid()}"
    path = Path("/dev/shm") / name
    path.write_bytes(b"secret" * 1000)
    try:
        handle = {"kind": "cpu-shm", "name": name, "dtype": "uint8", "shape": [6000], "stride": [1]}
        with pytest.raises(HandleError, match="lifeline"):
            CpuDevice().open(handle, HOLDER)
        with pytest.raises(HandleError, match="no region"):
            CpuDevice().open(handle | {"kind": "cpu-memfd"}, HOLDER)
    finally:
        path.unlink()


def test_a_region_name_is_never_replaced_and_goes_with_its_holder(shared: SharedTensor) -> None:
    regions = SealedRegions()
    regions.add(HOLDER, shared.name, shared_copy(shared), shared.nbytes)
    with pytest.raises(SealError, match="already"):
        regions.add(HOLDER, shared.name, shared_copy(shared), shared.nbytes)
    assert regions.drop(object()) == 0
    assert regions.drop(HOLDER) == 1
    with pytest.raises(SealError):
        regions.get(HOLDER, shared.name)
    assert regions.mapped_bytes == 0


def test_a_region_is_found_by_its_holder_and_name_only(shared: SharedTensor) -> None:
    """On main a region was found by its name alone: any instance could name another's."""
    regions = SealedRegions()
    regions.add(HOLDER, shared.name, shared_copy(shared), shared.nbytes)
    with pytest.raises(SealError, match="no region named"):
        regions.get("another-instance", shared.name)
    other = SharedTensor((4, 1024), torch.float16)
    try:
        regions.add("another-instance", shared.name, shared_copy(other), other.nbytes)  # its own
        assert regions.get("another-instance", shared.name) is not regions.get(HOLDER, shared.name)
    finally:
        other.close()


def test_bytes_are_bounded_per_region_per_holder_and_in_all(shared: SharedTensor) -> None:
    size = shared.nbytes  # 8 KiB
    regions = SealedRegions(RegionLimits(max_bytes=size, holder_bytes=2 * size, total_bytes=3 * size))
    with pytest.raises(SealError, match="max_region_bytes="):
        regions.add(HOLDER, "big", os.dup(shared.fd), size + 1)
    regions.add(HOLDER, "a", shared_copy(shared), size)
    regions.add(HOLDER, "b", shared_copy(shared), size)
    with pytest.raises(SealError, match="max_region_bytes_per_instance"):
        regions.add(HOLDER, "c", shared_copy(shared), size)
    regions.add("other", "a", shared_copy(shared), size)
    with pytest.raises(SealError, match="max_region_bytes_total"):
        regions.add("third", "a", shared_copy(shared), size)
    assert regions.mapped_bytes == 3 * size
    regions.drop(HOLDER)
    regions.add("third", "a", shared_copy(shared), size)  # room again once a holder went


def test_only_the_declared_bytes_are_mapped() -> None:
    """On main the whole memfd was mapped: a sparse one of 2^44 bytes cost 16 TiB of address space."""
    fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 44)
    fcntl.fcntl(fd, F_ADD_SEALS, REQUIRED_SEALS)
    try:
        mm = open_sealed(fd, 8192)
        assert len(mm) == 8192
        mm.close()
    finally:
        os.close(fd)


def test_the_planes_must_cover_their_region(shared: SharedTensor) -> None:
    regions = SealedRegions()
    regions.add(HOLDER, "r", shared_copy(shared), shared.nbytes)
    half = shared.nbytes // 2
    regions.check_covered(HOLDER, "r", [(half, 2 * half), (0, half)])
    with pytest.raises(SealError, match="what its planes need"):
        regions.check_covered(HOLDER, "r", [(0, half)])
    with pytest.raises(SealError, match="overlap"):
        regions.check_covered(HOLDER, "r", [(0, half + 8), (half, 2 * half)])
    with pytest.raises(SealError, match="no region"):
        regions.check_covered("another-instance", "r", [(0, 2 * half)])


def test_one_holder_cannot_fill_the_table(shared: SharedTensor) -> None:
    regions = SealedRegions(RegionLimits(max_regions=8, per_holder=2))
    for i in range(2):
        regions.add(HOLDER, f"r{i}", shared_copy(shared), shared.nbytes)
    with pytest.raises(SealError, match="at most 2"):
        regions.add(HOLDER, "r2", shared_copy(shared), shared.nbytes)
    regions.add(object(), "other", shared_copy(shared), shared.nbytes)  # another holder still may
    assert len(regions) == 3


def test_two_arenas_of_one_process_and_instance_have_other_names_and_files() -> None:
    """What a sidecar restarted in its container makes (same pid, same data directory): a client
    that still maps the old arena tells them apart by name and by the memfd itself."""
    first = SealedArena.create_sealed(1 << 20, "test", populate=False)
    second = SealedArena.create_sealed(1 << 20, "test", populate=False)
    try:
        assert first.name != second.name and first.name.startswith(f"kvdepot-test-{os.getpid()}-")
        assert identity(first.fd) != identity(second.fd)
    finally:
        first.close()
        second.close()


def test_the_sealed_arena_maps_in_a_client_that_cannot_truncate_it() -> None:
    arena = SealedArena.create_sealed(1 << 20, "test", populate=True)
    try:
        fd = os.dup(arena.fd)  # as received over the lifeline
        mapping = ArenaMapping.from_fd(fd, arena.size)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        mapping.region(4096, 16).fill_(9)
        assert bytes(arena.view(4096, 16)) == b"\x09" * 16
        mapping.close()
        os.close(fd)
        assert not Path(f"/dev/shm/{arena.name}").exists()  # nothing to open by name
    finally:
        arena.close()


def test_a_client_refuses_an_arena_descriptor_that_could_be_resized() -> None:
    fd = os.memfd_create("loose")
    os.ftruncate(fd, 1 << 16)
    try:
        with pytest.raises(ValueError, match="sealed"):
            ArenaMapping.from_fd(fd, 1 << 16)
    finally:
        os.close(fd)


def test_an_arena_larger_than_the_free_memory_is_refused_before_anything_is_reserved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from app.errors import ConfigError
    from engine.l1 import arena as arena_module

    free = arena_module.available_memory()
    assert free is not None and free > 0  # /proc/meminfo is read
    monkeypatch.setattr(arena_module, "available_memory", lambda: 1 << 20)
    with pytest.raises(ConfigError, match="memory"):
        SealedArena.create_sealed(2 << 20, "test", populate=True)
    SealedArena.create_sealed(1 << 20, "test", populate=True).close()  # what fits is made
    SealedArena.create_sealed(2 << 20, "test", populate=False).close()  # unpopulated: not checked
