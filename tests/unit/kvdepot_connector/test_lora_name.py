"""The optional `lora_name` of STORE and SAVE_BLOCKS: old clients omit it, it is bounded, and the
vLLM scheduler side fills it from the request's LoRA adapter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from kvdepot_connector import calls
from kvdepot_connector import protocol as p
from kvdepot_connector.vllm.extra_keys import AdapterFingerprints, RequestKeys, request_keys
from kvdepot_connector.vllm.scheduler import ScheduledRequest, SchedulerSide
from tests.unit.kvdepot_connector.test_extra_keys import adapter_dir, req

CHUNK = 16


class _OldStore(msgspec.Struct, tag="store", tag_field="op"):
    """STORE as a client from before `lora_name` encoded it."""

    id: int
    engine_id: int
    request_id: str
    tokens: bytes


def test_a_store_without_lora_name_decodes_as_none_given() -> None:
    frame = msgspec.msgpack.encode(_OldStore(id=1, engine_id=1, request_id="r", tokens=b""))
    msg = p.request_decoder.decode(frame)
    assert isinstance(msg, p.Store) and msg.lora_name == ""


@pytest.mark.parametrize("kind", [p.Store, p.SaveBlocks])
def test_lora_name_travels_and_is_bounded(kind: type[p.Store] | type[p.SaveBlocks]) -> None:
    ok = kind(id=1, engine_id=1, request_id="r", tokens=b"", lora_name="sql-adapter")
    assert p.request_decoder.decode(p.encode(ok)) == ok
    long = kind(id=1, engine_id=1, request_id="r", tokens=b"", lora_name="x" * (p.MAX_LORA_NAME_LEN + 1))
    with pytest.raises(msgspec.ValidationError, match="lora_name"):
        p.request_decoder.decode(p.encode(long))


def test_the_client_refuses_a_lora_name_too_long_before_sending() -> None:
    with pytest.raises(ValueError, match="lora_name has 257 characters"):
        calls.reserve([1, 2], "r", "", 0, lora_name="x" * 257)
    with pytest.raises(ValueError, match="lora_name"):
        calls.save_blocks([1, 2], "r", [0], "", 0, lora_name="x" * 257)


def _miss() -> p.LookupReply:
    return p.LookupReply(id=0, hit_tokens=0, hit_chunks=0, total_chunks=0)


class _MissingClient:
    """A sidecar client whose lookups all miss."""

    instance = "ab" * 32

    def lookup(self, tokens: Sequence[int] | bytes, **_: object) -> p.LookupReply:
        return _miss()


def test_the_scheduler_side_names_the_requests_lora_adapter_in_its_saves(tmp_path: Path) -> None:
    d = adapter_dir(tmp_path, "sql", b"weights")

    lora = req(num_prompt_tokens=2 * CHUNK, lora_request=SimpleNamespace(lora_name="sql", lora_path=str(d)))
    found = request_keys(lora, CHUNK, AdapterFingerprints())
    assert isinstance(found, RequestKeys)
    sched = SchedulerSide([_MissingClient()], chunk_size=CHUNK, block_size=CHUNK)  # type: ignore[list-item]
    prompt = list(range(2 * CHUNK))
    sched.matched_tokens("with", prompt, None, len(prompt), 0, keys=lambda: found)
    sched.matched_tokens("plain", prompt, None, len(prompt), 0)
    plan = sched.plan_step(
        [ScheduledRequest("with", [0, 1], 0, 2 * CHUNK), ScheduledRequest("plain", [2, 3], 0, 2 * CHUNK)]
    )
    assert {s.request_id: s.lora_name for s in plan.saves} == {"with": "sql", "plain": ""}
