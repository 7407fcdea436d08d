"""Helpers of the slab adapter tests: blobs whose bytes are a function of their key, what a
reader is served (load_into and the caller's checks), file surgery, and the type of the `make_slab`
fixture (conftest: adapters on real files under tmp_path, closed at teardown)."""

from __future__ import annotations

import mmap
import random
from collections.abc import Callable
from pathlib import Path

from app.errors import IntegrityError
from storage import codec
from storage.base import Status
from storage.codec import CodecOptions, EncodedBlob
from storage.slab.adapter import SlabAdapter

FP = b"layoutfp"
KiB = 1 << 10
SLOT = 64 * KiB
PAYLOAD = 48 * KiB  # a raw blob of this payload fits a slot with its headers

MakeSlab = Callable[..., SlabAdapter]


def payload_for(key: str, size: int = PAYLOAD) -> bytes:
    return random.Random(key).randbytes(size)


def blob(key: str, size: int = PAYLOAD) -> EncodedBlob:
    return codec.encode(key, FP, payload_for(key, size), CodecOptions())


def aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


def decoded(data: bytes | memoryview | None, key: str, size: int = PAYLOAD) -> bytes:
    assert data is not None
    out = bytearray(size)
    codec.decode_into(data, key, FP, out)
    return bytes(out)


async def served(slab: SlabAdapter, key: str, size: int = PAYLOAD) -> bytes | None:
    """What a reader gets for `key` through load_into and the caller's checks: the payload, or None
    for a miss (a failed check included). Never anything else."""
    out = aligned(size)
    (result,) = await slab.load_into([key], [memoryview(out)])
    if result.status is not Status.OK:
        return None
    try:
        if result.in_place:
            assert result.data is not None
            codec.verify_in_place(result.data, key, FP, memoryview(out))
            return bytes(out)
        return decoded(result.data, key, size)
    except IntegrityError:
        await slab.delete([key])
        return None


def patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def read_at(path: Path, at: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(at)
        return f.read(length)


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))

