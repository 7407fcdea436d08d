"""The plain baselines of `bench l2` on real files, tiny sizes: they give back the bytes they
stored, say so only when it is true, and leave nothing behind; the verify-too baseline checks
every blob as a load does and says so only when every check passed. (Timings are not judged.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.l2_baselines import DiskBaseline, MemoryBaseline
from bench.l2_verify import BlobFile, VerifyBaseline
from storage import codec
from storage.auth import BlobKeys
from storage.codec import CodecOptions, blob_header

CHUNKS = [os.urandom(4096 + 512 * i) for i in range(5)]


def test_disk_baseline_reads_back_what_it_wrote_warm_and_cold(tmp_path: Path) -> None:
    baseline = DiskBaseline(tmp_path / "b", CHUNKS, threads=3)
    try:
        assert baseline.cold
        assert baseline.store() > 0
        assert sorted(p.stat().st_size for p in (tmp_path / "b").iterdir()) == sorted(len(c) for c in CHUNKS)
        assert baseline.load_warm() > 0
        baseline.drop()
        assert baseline.load_cold() > 0
        assert baseline.ok
    finally:
        baseline.close()
    assert list((tmp_path / "b").iterdir()) == []


def test_disk_baseline_notices_bytes_that_changed_on_disk(tmp_path: Path) -> None:
    baseline = DiskBaseline(tmp_path / "b", CHUNKS, threads=2)
    try:
        baseline.store()
        path = tmp_path / "b" / "baseline-3"
        data = bytearray(path.read_bytes())
        data[100] ^= 1
        path.write_bytes(data)
        baseline.load_warm()
        assert not baseline.ok
    finally:
        baseline.close()


def test_memory_baseline_copies_every_chunk() -> None:
    baseline = MemoryBaseline(CHUNKS)
    try:
        assert not baseline.cold
        baseline.store()
        baseline.load_warm()
        assert baseline.ok
    finally:
        baseline.close()


FP = b"layoutfp"


def blob_files(root: Path, keys: BlobKeys | None) -> list[BlobFile]:
    root.mkdir()
    files = []
    for i, chunk in enumerate(CHUNKS):
        key = f"chunk-{i}"
        path = root / key
        path.write_bytes(codec.encode(key, FP, chunk, CodecOptions(), keys).to_bytes())
        files.append(BlobFile(key, str(path)))
    return files


@pytest.mark.parametrize("keys", [BlobKeys([b"k" * 32]), None], ids=["mac", "checksum"])
def test_verify_baseline_checks_every_blob_as_a_load_does(tmp_path: Path, keys: BlobKeys | None) -> None:
    files = blob_files(tmp_path / "l2", keys)
    baseline = VerifyBaseline(files, CHUNKS, FP, keys, threads=3)
    try:
        assert ("MAC" in baseline.check) == (keys is not None)
        assert baseline.load() > 0
        assert baseline.ok
        path = files[2].path
        data = bytearray(Path(path).read_bytes())
        data[blob_header.header_size(files[2].key) + 9] ^= 1
        Path(path).write_bytes(data)
        baseline.load()
        assert not baseline.ok
    finally:
        baseline.close()


def test_verify_baseline_refuses_blobs_signed_with_another_key(tmp_path: Path) -> None:
    files = blob_files(tmp_path / "l2", BlobKeys([b"o" * 32]))
    baseline = VerifyBaseline(files, CHUNKS, FP, BlobKeys([b"k" * 32]), threads=2)
    try:
        baseline.load()
        assert not baseline.ok
    finally:
        baseline.close()
