from __future__ import annotations

import subprocess
import sys

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.keys import SEED, KVLayout, Namespace, ObjectKey, TokenHasher, salt_of
from kvdepot_connector.protocol import encode_tokens

# Pinned: these values must never change, or every cache in every tier silently misses after an
# upgrade (and sidecars of different versions sharing a Redis would disagree).
GOLDEN_FIRST = "3215aa71ca0fb548fa93e77eeac24d37f45996aa890265b7576e0aa52a7f818e"
GOLDEN_FP = "2f3ba29bc2789d78"


def test_hashes_are_pinned() -> None:
    hashes = TokenHasher(256).chunk_hashes(encode_tokens(list(range(4096))))
    assert len(hashes) == 16
    assert hashes[0].hex() == GOLDEN_FIRST
    layout = KVLayout("bfloat16", 8, 8, 64, 128, "vllm-cpu", 256)
    assert layout.fingerprint.hex() == GOLDEN_FP


def test_hashes_are_equal_in_another_process() -> None:
    code = (
        "from engine.keys import TokenHasher;"
        "from kvdepot_connector.protocol import encode_tokens;"
        "print(','.join(h.hex() for h in TokenHasher(256).chunk_hashes("
        "encode_tokens(list(range(4096))))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    local = [h.hex() for h in TokenHasher(256).chunk_hashes(encode_tokens(list(range(4096))))]
    assert out.stdout.strip().split(",") == local


def test_every_hash_of_the_chain_follows_its_definition_on_every_path() -> None:
    tokens = encode_tokens(list(range(7, 7 + 4 * 50 + 3)))  # 50 full chunks of 4, and 3 tokens
    expected, prev = [], SEED
    for i in range(50):
        prev = blake3.blake3(prev + tokens[16 * i : 16 * (i + 1)]).digest()
        expected.append(prev)
    h = TokenHasher(4)
    assert h.chunk_hashes(tokens) == expected
    assert h.chunk_hashes(memoryview(bytearray(tokens))) == expected
    assert h.chunk_hashes(tokens, extras=[b""] * 50) == expected  # empty extra keys are no keys
    assert h.chunk_hashes(tokens, limit=7) == expected[:7]
    with_extra = h.chunk_hashes(tokens, extras=[b""] * 49 + [b"\x02" * 32])
    assert with_extra[:49] == expected[:49] and with_extra[49] != expected[49]


def test_only_full_chunks_and_chaining() -> None:
    h = TokenHasher(4)
    a = h.chunk_hashes(encode_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert len(a) == 2
    b = h.chunk_hashes(encode_tokens([0, 2, 3, 4, 5, 6, 7, 8]))
    assert a[0] != b[0] and a[1] != b[1], "a change in chunk 0 must change every later hash"
    c = h.chunk_hashes(encode_tokens([1, 2, 3, 4, 0, 0, 0, 0]))
    assert c[0] == a[0] and c[1] != a[1]


names = st.text(min_size=0, max_size=40)


@given(
    model=names.filter(bool), salt=names, rank=st.integers(0, 65535), group=st.integers(0, 1023),
    fp=st.binary(min_size=8, max_size=8), h=st.binary(min_size=32, max_size=32),
)  # fmt: skip
def test_serialized_key_round_trips(
    model: str, salt: str, rank: int, group: int, fp: bytes, h: bytes
) -> None:
    k = ObjectKey(Namespace(model, fp, rank, group), salt, h)
    text = k.serialize()
    assert "\n" not in text and " " not in text
    assert ObjectKey.parse(text) == k


def test_keys_differing_in_any_field_never_alias() -> None:
    base = ObjectKey(Namespace("m", b"12345678", 0, 0), "", b"\x01" * 32)
    variants = [
        ObjectKey(Namespace("m2", b"12345678", 0, 0), "", b"\x01" * 32),
        ObjectKey(Namespace("m", b"12345679", 0, 0), "", b"\x01" * 32),
        ObjectKey(Namespace("m", b"12345678", 1, 0), "", b"\x01" * 32),
        ObjectKey(Namespace("m", b"12345678", 0, 1), "", b"\x01" * 32),
        ObjectKey(Namespace("m", b"12345678", 0, 0), "tenant", b"\x01" * 32),
        ObjectKey(Namespace("m", b"12345678", 0, 0), "", b"\x02" * 32),
    ]
    serialized = {base.serialize()} | {v.serialize() for v in variants}
    assert len(serialized) == 7
    assert all(v != base for v in variants)


@pytest.mark.parametrize(
    "text", ["", "kvd1", "kvd0/m=a/l=00/r=0/g=0/s=/h=00", "kvd1/m=a/l=zz/r=0/g=0/s=/h=00"]
)
def test_parse_rejects_malformed_keys(text: str) -> None:
    with pytest.raises(ValueError, match="key"):
        ObjectKey.parse(text)


def test_layout_refuses_chunk_not_multiple_of_block() -> None:
    with pytest.raises(ValueError, match="multiple"):
        KVLayout("bfloat16", 8, 8, 64, 128, "vllm-cpu", 200)


@given(model=st.text(min_size=1, max_size=40), salt=st.text(max_size=60))
def test_salt_of_reads_the_tenant_of_any_serialized_key(model: str, salt: str) -> None:
    key = ObjectKey(Namespace(model, b"\x01" * 8, 3, 1), salt, b"\x02" * 32)
    assert salt_of(key.serialize()) == salt


def test_salt_of_a_string_that_is_not_a_key_is_the_default_tenant() -> None:
    for text in ("", "k0", "a:1", "kvd0/m=x/l=00/r=0/g=0/s=a/h=00", "s=a/h=00"):
        assert salt_of(text) == ""


def test_extra_keys_change_their_chunk_and_every_later_one_only() -> None:
    hasher = TokenHasher(4)
    tokens = encode_tokens(list(range(16)))
    plain = hasher.chunk_hashes(tokens)
    x, y = b"x" * 32, b"y" * 32
    # No extra key, or empty ones: the plain keys (a request without adapter/image is unchanged).
    assert hasher.chunk_hashes(tokens, extras=[b"", b""]) == plain
    assert hasher.chunk_hashes(tokens, extras=[b"", b"", b"", b"", x]) == plain  # past the end
    with_x = hasher.chunk_hashes(tokens, extras=[b"", x])
    assert with_x[0] == plain[0]
    assert all(a != b for a, b in zip(with_x[1:], plain[1:], strict=True))
    with_y = hasher.chunk_hashes(tokens, extras=[b"", y])
    assert with_y[0] == plain[0] and all(a != b for a, b in zip(with_x[1:], with_y[1:], strict=True))
    # Deterministic, and pinned like the plain chain.
    assert hasher.chunk_hashes(tokens, extras=[b"", x]) == with_x
    tokens = encode_tokens(list(range(4096)))
    first = TokenHasher(256).chunk_hashes(tokens, extras=[b"\x01" * 32])[0]
    assert first.hex() == blake3.blake3(SEED + tokens[:1024] + b"\x01" * 32).hexdigest()


@pytest.mark.parametrize("bad", [b"x", b"x" * 31, b"x" * 33])
def test_extra_keys_of_another_length_are_refused(bad: bytes) -> None:
    with pytest.raises(ValueError, match="extra key of chunk 1"):
        TokenHasher(4).chunk_hashes(encode_tokens(list(range(8))), extras=[b"", bad])
