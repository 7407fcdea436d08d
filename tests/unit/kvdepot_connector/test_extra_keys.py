"""Extra keys from a request's inputs (stand-in request objects; vLLM's own ones are driven through
the connector in tests/e2e/test_request_keys.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvdepot_connector.protocol import EXTRA_KEY_BYTES, Uncacheable
from kvdepot_connector.vllm.extra_keys import AdapterFingerprints, MMItem, RequestKeys, request_keys

CHUNK = 16


def req(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = {"num_prompt_tokens": 64, "lora_request": None, "mm_features": [],
                               "prompt_embeds": None, "prompt_is_token_ids": None}  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def feature(identifier: str, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))


def adapter_dir(tmp_path: Path, name: str, payload: bytes) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 4}')
    (d / "adapter_model.safetensors").write_bytes(payload)
    return d


def test_a_plain_request_has_no_extra_keys() -> None:
    keys = request_keys(req(), CHUNK, AdapterFingerprints())
    assert isinstance(keys, RequestKeys) and keys.plain and keys.extras(4) == ()


def test_an_adapter_keys_every_chunk_including_generated_ones(tmp_path: Path) -> None:
    d = adapter_dir(tmp_path, "a", b"weights-1")
    keys = request_keys(req(lora_request=SimpleNamespace(lora_name="a", lora_path=str(d))), CHUNK,
                        AdapterFingerprints())  # fmt: skip
    assert isinstance(keys, RequestKeys)
    extras = keys.extras(6)  # 4 prompt chunks and 2 of generated tokens
    assert len(extras) == 6 and all(len(e) == EXTRA_KEY_BYTES for e in extras)
    assert len(set(extras)) == 1  # the adapter alone: the same on every chunk (the chain adds position)


def test_adapter_fingerprint_follows_the_files_not_the_name(tmp_path: Path) -> None:
    fps = AdapterFingerprints()
    a = adapter_dir(tmp_path, "a", b"weights-1")
    b = adapter_dir(tmp_path, "b", b"weights-2")
    same = adapter_dir(tmp_path, "same", b"weights-1")
    fa, fb, fs = fps.fingerprint(str(a)), fps.fingerprint(str(b)), fps.fingerprint(str(same))
    assert fa is not None and fb is not None and fa != fb and fa == fs
    # Rewritten in place (a reload under the same name and path): a new fingerprint.
    (a / "adapter_model.safetensors").write_bytes(b"weights-3")
    os.utime(a / "adapter_model.safetensors", ns=(1, 1))
    assert fps.fingerprint(str(a)) not in (fa, None)
    assert fps.fingerprint(str(tmp_path / "missing")) is None
    assert fps.fingerprint(str(a / "adapter_config.json")) is None  # a file, not a directory
    assert AdapterFingerprints(max_bytes=4).fingerprint(str(b)) is None  # too large to hash


def test_an_unreadable_adapter_or_an_unidentified_item_is_uncacheable() -> None:
    lost = req(lora_request=SimpleNamespace(lora_name="x", lora_path="/nonexistent"))
    assert request_keys(lost, CHUNK, AdapterFingerprints()) is Uncacheable.LORA_UNFINGERPRINTED
    blank = req(mm_features=[feature("", 3, 4)])
    assert request_keys(blank, CHUNK, AdapterFingerprints()) is Uncacheable.MM_UNIDENTIFIED
    assert request_keys(req(prompt_embeds="not a tensor"), CHUNK, AdapterFingerprints()) is (
        Uncacheable.EMBEDS_UNHASHABLE
    )


@pytest.mark.parametrize(
    ("offset", "length", "keyed"),
    [(0, 4, [0]), (14, 4, [0, 1]), (16, 16, [1]), (20, 40, [1, 2, 3]), (63, 1, [3])],
)
def test_an_image_keys_exactly_the_chunks_it_overlaps(offset: int, length: int, keyed: list[int]) -> None:
    keys = RequestKeys(CHUNK, 64, mm=(MMItem("img", offset, length),))
    extras = keys.extras(5)
    assert [i for i, e in enumerate(extras) if e] == keyed
    other = RequestKeys(CHUNK, 64, mm=(MMItem("img2", offset, length),)).extras(5)
    assert all(a != b for a, b in zip(extras, other, strict=True) if a)
    moved = RequestKeys(CHUNK, 64, mm=(MMItem("img", offset + 1, length),)).extras(5)
    assert moved != extras  # the same image one position later is another input


def test_prompt_embeds_key_each_chunk_by_its_own_rows() -> None:
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(40, 8, generator=g).to(torch.bfloat16)
    keys = request_keys(req(num_prompt_tokens=40, prompt_embeds=embeds), CHUNK, AdapterFingerprints())
    assert isinstance(keys, RequestKeys) and len(keys.embeds) == 3  # 16 + 16 + 8 rows
    changed = embeds.clone()
    changed[20, 3] += 1
    other = request_keys(req(num_prompt_tokens=40, prompt_embeds=changed), CHUNK, AdapterFingerprints())
    assert isinstance(other, RequestKeys)
    a, b = keys.extras(3), other.extras(3)
    assert a[0] == b[0] and a[1] != b[1] and a[2] == b[2]  # the chain makes chunk 2's key differ too
    mixed = request_keys(req(num_prompt_tokens=40, prompt_embeds=embeds, prompt_is_token_ids=[True] * 40),
                         CHUNK, AdapterFingerprints())  # fmt: skip
    assert isinstance(mixed, RequestKeys) and mixed.extras(3) != a
