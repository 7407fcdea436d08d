"""Signed blobs: checked with the deployment's keys before a byte is used; what someone without
the key can build (an unsigned blob, one signed with another key, a signed header over other
bytes) never passes. Old-format blobs are refused. The keys: settings or a private key file."""

from __future__ import annotations

import base64
import os
import stat
import struct
from pathlib import Path

import pytest
import xxhash

from app.errors import AuthenticationError, ConfigError, IntegrityError, UnknownKey
from storage import codec
from storage.auth import BlobKeys, load_or_create_key, parse_secret
from storage.codec import CodecOptions, blob_header

KEY = "kvd1/m=model/l=0011223344556677/r=0/g=0/s=/h=" + "ab" * 32
FP = bytes.fromhex("0011223344556677")
PAYLOAD = os.urandom(4096)
OURS = BlobKeys([b"o" * 32])
THEIRS = BlobKeys([b"t" * 32])


def in_place(blob: codec.EncodedBlob, keys: BlobKeys | None) -> bytearray:
    out = bytearray(blob.payload)
    codec.verify_in_place(blob.header, KEY, FP, out, keys)
    return out


def decoded(data: bytes, keys: BlobKeys | None, size: int = len(PAYLOAD)) -> bytes:
    out = bytearray(size)
    codec.decode_into(data, KEY, FP, out, keys)
    return bytes(out)


@pytest.mark.parametrize("options", [CodecOptions(), CodecOptions(lz4=True)], ids=["raw", "lz4"])
def test_a_signed_blob_passes_with_the_keys_and_without_them(options: CodecOptions) -> None:
    payload = bytes(4096) if options.lz4 else PAYLOAD
    blob = codec.encode(KEY, FP, payload, options, OURS)
    assert blob_header.read_header(blob.header).signed
    assert decoded(blob.to_bytes(), OURS, len(payload)) == payload
    assert decoded(blob.to_bytes(), None, len(payload)) == payload  # the checksum still holds
    if not options.lz4:
        assert blob_header.fits_in_place(blob.header, len(payload))
        assert in_place(blob, OURS) == payload


def test_an_unsigned_blob_is_refused_by_a_check_with_keys() -> None:
    blob = codec.encode(KEY, FP, PAYLOAD, CodecOptions())
    with pytest.raises(AuthenticationError, match="not signed"):
        decoded(blob.to_bytes(), OURS)
    with pytest.raises(AuthenticationError):
        in_place(blob, OURS)


def test_a_blob_signed_with_another_key_is_refused() -> None:
    blob = codec.encode(KEY, FP, PAYLOAD, CodecOptions(), THEIRS)
    with pytest.raises(UnknownKey, match="does not hold"):  # an AuthenticationError
        decoded(blob.to_bytes(), OURS)
    with pytest.raises(UnknownKey):
        in_place(blob, OURS)


def test_a_signed_header_over_other_bytes_with_a_fixed_up_checksum_is_refused() -> None:
    """The attacker copies a genuine header, puts its own payload under it and repairs both
    xxh3 checksums: only the MAC can tell."""
    genuine = codec.encode(KEY, FP, PAYLOAD, CodecOptions(), OURS)
    other = os.urandom(len(PAYLOAD))
    head = bytearray(genuine.header)
    digest_at = blob_header.HEADER_FIXED_SIZE - blob_header.MAC_SIZE - 8 - 16
    head[digest_at : digest_at + 16] = xxhash.xxh3_128_digest(other)
    body_end = len(head) - 8
    head[body_end:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head[:body_end])))
    assert decoded(bytes(head) + other, None) == other  # a checksum alone is fooled
    with pytest.raises(AuthenticationError, match="MAC mismatch"):
        decoded(bytes(head) + other, OURS)
    forged = codec.EncodedBlob(KEY, bytes(head), memoryview(other))
    with pytest.raises(AuthenticationError):
        in_place(forged, OURS)


def test_every_byte_flip_of_a_signed_blob_fails_the_check_with_keys() -> None:
    blob = codec.encode(KEY, FP, PAYLOAD[:256], CodecOptions(), OURS).to_bytes()
    for at in range(len(blob)):
        flipped = bytearray(blob)
        flipped[at] ^= 0x01
        with pytest.raises(IntegrityError):
            decoded(bytes(flipped), OURS, 256)


def test_rotation_the_first_key_signs_and_every_key_verifies() -> None:
    rotated = BlobKeys([b"n" * 32, b"o" * 32])
    old = codec.encode(KEY, FP, PAYLOAD, CodecOptions(), OURS)
    new = codec.encode(KEY, FP, PAYLOAD, CodecOptions(), rotated)
    assert decoded(old.to_bytes(), rotated) == PAYLOAD
    assert decoded(new.to_bytes(), rotated) == PAYLOAD
    with pytest.raises(AuthenticationError):
        decoded(new.to_bytes(), OURS)  # a sidecar not given the new key yet


def test_a_blob_of_the_previous_format_is_refused_as_an_old_version() -> None:
    key_bytes = KEY.encode()
    fixed = struct.pack(
        "<4sHH8sBxHIQQ16s", b"KVD2", 1, 0, FP, 0, len(key_bytes), 0, len(PAYLOAD), len(PAYLOAD),
        xxhash.xxh3_128_digest(PAYLOAD),
    )  # fmt: skip
    head = fixed + key_bytes
    v1 = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + PAYLOAD
    for keys in (None, OURS):
        with pytest.raises(IntegrityError, match="unsupported blob version 1"):
            decoded(v1, keys)
    assert not blob_header.fits_in_place(v1, len(PAYLOAD))


def test_an_encoding_that_would_grow_the_payload_is_not_kept() -> None:
    raw = bytes(2 * 2 * 1024)  # float16 K/V runs of one element: FP8 with scales would be longer
    blob = codec.encode(KEY, FP, raw, CodecOptions(fp8_values=True, dtype="float16", run_elems=1))
    assert not blob_header.read_header(blob.header).fp8_values
    assert blob.nbytes == blob_header.header_size(KEY) + len(raw)


def test_secrets_are_hex_or_base64_of_16_bytes_or_more() -> None:
    secret = os.urandom(32)
    assert parse_secret(secret.hex()) == secret
    assert parse_secret(base64.b64encode(secret).decode()) == secret
    assert parse_secret(base64.urlsafe_b64encode(secret).decode().rstrip("=")) == secret
    for bad in ("", "zz!", "00" * 15):
        with pytest.raises(ValueError, match="L2 auth key"):
            parse_secret(bad)
    assert secret.hex() not in repr(BlobKeys([secret]))


def test_the_key_file_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "l2.key"
    first = load_or_create_key(path)
    assert len(first) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(path) == first
    signed = codec.encode(KEY, FP, PAYLOAD, CodecOptions(), BlobKeys.from_settings([], path))
    assert decoded(signed.to_bytes(), BlobKeys([first])) == PAYLOAD


def test_a_key_file_others_can_read_or_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "l2.key"
    load_or_create_key(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_or_create_key(path)
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match="holds 5 bytes"):
        load_or_create_key(path)


def test_configured_secrets_take_the_place_of_the_key_file(tmp_path: Path) -> None:
    keys = BlobKeys.from_settings(["11" * 32], tmp_path / "l2.key")
    assert not (tmp_path / "l2.key").exists()
    assert keys.signer == BlobKeys([bytes.fromhex("11" * 32)]).signer


@pytest.mark.parametrize("threads", [None, 1, 2, 3])
def test_a_large_mac_is_the_same_on_any_number_of_threads(threads: int | None) -> None:
    """A payload past MAC_THREADS_MIN is MACed on BLAKE3's threads (as many as a check is given):
    the same MAC whatever their number; one changed byte still fails, in place and decoded."""
    payload = os.urandom(codec.MAC_THREADS_MIN + 12345)
    blob = codec.encode(KEY, FP, payload, CodecOptions(), OURS)
    check = codec.BlobCheck(FP, OURS, threads)
    out = bytearray(blob.payload)
    check(KEY, blob.header, memoryview(out), True)
    whole = bytearray(len(payload))
    check(KEY, blob.to_bytes(), memoryview(whole), False)
    assert whole == payload
    out[len(payload) // 3] ^= 1
    with pytest.raises(AuthenticationError):
        check(KEY, blob.header, memoryview(out), True)


def test_checks_beside_others_share_the_cores_out() -> None:
    cores = len(os.sched_getaffinity(0))
    assert codec.mac_threads_beside(1) == cores
    assert codec.mac_threads_beside(cores * 4) == 1
    assert codec.BlobCheck(FP, OURS).beside(2).mac_threads == max(1, cores // 2)
