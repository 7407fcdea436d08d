"""The slab adapter across restarts and damage: the index rebuilt from the slots (with, without and
with a stale checkpoint), torn, flipped and damaged slots as misses, never wrong bytes, deletes
that stay deleted, checkpoints, and files it must refuse."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.errors import ConfigError
from storage.slab import headers as slab_headers
from tests.integration.storage.slab_helpers import (
    PAYLOAD,
    SLOT,
    KiB,
    MakeSlab,
    blob,
    flip,
    patch,
    payload_for,
    read_at,
    served,
)

pytestmark = pytest.mark.anyio

async def test_restart_rebuilds_the_index_and_keeps_recency(make_slab: MakeSlab, tmp_path: Path) -> None:
    slab = make_slab()
    keys = [f"k{i}" for i in range(10)]
    for key in keys:
        await slab.store([(key, blob(key))])
    await served(slab, "k0")
    await slab.delete(["k5"])
    order = slab.keys_lru()
    await slab.close()
    assert (tmp_path / "slab.index").exists()

    again = make_slab()
    await again.start()
    assert again.startup is not None
    assert again.startup.checkpoint_used and again.startup.stale_checkpoint_entries == 0
    assert (again.startup.blobs, again.startup.empty_slots) == (9, 7)
    assert again.keys_lru() == order
    for key in keys:
        assert await served(again, key) == (None if key == "k5" else payload_for(key))


async def test_without_a_checkpoint_the_scan_alone_rebuilds_in_write_order(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    slab = make_slab()
    for key in ["a", "b", "c"]:
        await slab.store([(key, blob(key))])
    where = slab.slot_of("a")
    assert where is not None
    older = read_at(tmp_path / "slab0", where[1], SLOT)
    await slab.store([("a", blob("a"))])  # rewritten: newest; its older slot is zeroed
    await slab.close()
    assert read_at(tmp_path / "slab0", where[1], 4096) == bytes(4096)
    patch(tmp_path / "slab0", where[1], older)  # as if the process died before the zeroing
    (tmp_path / "slab.index").unlink()
    again = make_slab()
    await again.start()
    assert again.startup is not None and not again.startup.checkpoint_used
    assert again.keys_lru() == ["b", "c", "a"]
    assert again.startup.superseded == 1  # a's older generation: not indexed, zeroed now
    assert await served(again, "a") == payload_for("a")
    await again.wait_io()
    assert read_at(tmp_path / "slab0", where[1], 4096) == bytes(4096)


async def test_a_stale_checkpoint_is_checked_against_the_slots(make_slab: MakeSlab, tmp_path: Path) -> None:
    slab = make_slab()
    for key in ["a", "b", "c", "d"]:
        await slab.store([(key, blob(key))])
    await slab.close()
    old = (tmp_path / "slab.index").read_bytes()

    second = make_slab()
    await second.delete(["a"])  # its slot is zeroed
    await second.store([("c", blob("c", 2000))])  # c moves to another slot
    await second.store([("e", blob("e"))])  # e may take a's old slot
    await second.close()
    (tmp_path / "slab.index").write_bytes(old)  # the index as it was before those changes

    third = make_slab()
    await third.start()
    assert third.startup is not None and third.startup.stale_checkpoint_entries >= 2
    assert sorted(third.keys_lru()) == ["b", "c", "d", "e"]
    assert await served(third, "a") is None
    assert await served(third, "c", 2000) == payload_for("c", 2000)
    assert await served(third, "e") == payload_for("e")


async def test_a_torn_or_flipped_slot_is_a_miss_never_wrong_bytes(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    slab = make_slab()
    for key in ["flip", "garbage", "head", "fine"]:
        await slab.store([(key, blob(key))])
    places = {k: where for k in ["flip", "garbage", "head"] if (where := slab.slot_of(k)) is not None}
    path = tmp_path / "slab0"
    _, at, payload_at = places["flip"]
    flip(path, at + payload_at + 777)
    _, at, payload_at = places["garbage"]  # a torn write: the second half of the payload is other bytes
    patch(path, at + payload_at + 4096, os.urandom(PAYLOAD - 4096))
    _, at, _ = places["head"]
    flip(path, at + 20)  # inside the slot header
    assert await served(slab, "flip") is None
    assert await served(slab, "garbage") is None
    assert await served(slab, "head") is None  # the header no longer matches: stale, a miss
    assert await served(slab, "fine") == payload_for("fine")
    assert slab.stats.integrity_failures >= 1  # the stale head; the payload checks are the caller's
    await slab.close()
    again = make_slab()
    await again.start()
    assert again.startup is not None
    assert sorted(again.keys_lru()) == ["fine"]  # the damaged ones were deleted (zeroed) or fail the scan
    assert await served(again, "fine") == payload_for("fine")


async def test_a_damaged_slot_found_at_start_is_invalid_not_indexed(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    slab = make_slab()
    await slab.store([("a", blob("a")), ("b", blob("b"))])
    where = slab.slot_of("a")
    assert where is not None
    await slab.close()
    (tmp_path / "slab.index").unlink()
    flip(tmp_path / "slab0", where[1] + slab_headers.SLOT_HEADER_SIZE + 3)  # inside the blob header
    again = make_slab()
    await again.start()
    assert again.startup is not None and again.startup.invalid_slots == 1
    assert again.keys_lru() == ["b"]
    assert again.stats.integrity_failures == 1


async def test_foreign_and_wrongly_sized_files_are_refused(make_slab: MakeSlab, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"my precious data" * 70_000)
    with pytest.raises(ConfigError, match=r"not a kvdepot slab.*refusing to overwrite"):
        await make_slab(paths=[foreign], size_bytes=4096 + 17 * SLOT).start()
    assert foreign.read_bytes() == b"my precious data" * 70_000

    slab = make_slab()
    await slab.store([("k", blob("k"))])
    await slab.close()
    with pytest.raises(ConfigError, match="size_bytes says"):
        await make_slab(size_bytes=4 * KiB + 32 * SLOT).start()
    with pytest.raises(ConfigError, match="formatted with slot_bytes 65536; the config says 131072"):
        await make_slab(slot_bytes=2 * SLOT).start()
    again = make_slab()
    assert await served(again, "k") == payload_for("k")


async def test_a_file_has_one_owner(make_slab: MakeSlab) -> None:
    first = make_slab()
    await first.start()
    with pytest.raises(ConfigError, match="in use by another adapter"):
        await make_slab().start()


async def test_o_direct_is_required(make_slab: MakeSlab) -> None:
    path = Path("/dev/shm") / f"kvdepot-slab-test-{os.getpid()}"
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        path.unlink(missing_ok=True)
    else:
        path.unlink()
        pytest.skip("this kernel's tmpfs does O_DIRECT (Linux 6.6 and later)")
    try:
        with pytest.raises(ConfigError, match="does not support O_DIRECT"):
            await make_slab(paths=[path]).start()
    finally:
        path.unlink(missing_ok=True)


async def test_the_index_is_checkpointed_periodically_not_only_at_close(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    now = [0.0]
    slab = make_slab(clock=lambda: now[0], checkpoint_s=10)
    index = tmp_path / "slab.index"
    await slab.store([("a", blob("a"))])
    assert not index.exists() and slab.checkpoints == 0  # too soon after start
    now[0] = 11.0
    await slab.store([("b", blob("b"))])
    await slab.wait_io()  # the checkpoint is written in the executor
    assert slab.checkpoints == 1
    assert [e[0] for e in json.loads(index.read_bytes())["entries"]] == ["a", "b"]
    now[0] = 12.0
    await slab.store([("c", blob("c"))])  # within checkpoint_s of the last one: not written
    await slab.close()  # but at close it is
    assert slab.checkpoints == 2
    assert [e[0] for e in json.loads(index.read_bytes())["entries"]] == ["a", "b", "c"]


async def test_a_deleted_key_stays_deleted_after_restart_even_when_it_was_rewritten(
    make_slab: MakeSlab,
) -> None:
    slab = make_slab()
    await slab.store([("k", blob("k", 1000))])
    await slab.store([("k", blob("k", 2000))])  # the first slot still held k's older generation
    await slab.store([("other", blob("other"))])
    await slab.evict_salt("", 1)  # the oldest entry: k
    await slab.delete(["other"])
    await slab.close()
    again = make_slab()
    await again.start()
    assert again.keys_lru() == []
    assert await served(again, "k", 2000) is None and await served(again, "k", 1000) is None
