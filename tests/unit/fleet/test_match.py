"""The non-prefix matcher: a stored chunk's tokens found at any offset of a request, collisions
rejected by the full-hash check, repeated content counted, tenants and adapters apart."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from app.errors import NotFound
from fleet.directory import Directory
from fleet.ingest import apply_batch, batch_tokens_decoder
from fleet.match import Matcher
from fleet.spec import DirectoryConfig
from kvdepot_connector.protocol import encode_tokens
from tests.unit.fleet.test_score import KEY, MODEL, batch_of, spec, stored_events


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(n)]


def test_rolling_fingerprints_equal_the_chunks_own() -> None:
    m = Matcher(16)
    data = toks(1, 100)
    raw = encode_tokens(data)
    for off in (0, 7, 84):
        m.learn(("m", "", ""), encode_tokens(data[off : off + 16]), head=1000 + off)
    assert m.find(("m", "", ""), raw) == [(0, 1000), (7, 1007), (84, 1084)]
    assert m.find(("m", "other-tenant", ""), raw) == []
    assert m.find(("m", "", "adapter"), raw) == []


def test_a_fingerprint_collision_is_rejected_by_the_full_hash() -> None:
    m = Matcher(16, slots=256)
    data = toks(2, 16)
    m.learn(("m", "", ""), encode_tokens(data), head=5)
    table = m.tables[("m", "", "")]
    slot = int(np.nonzero(table.fp)[0][0])
    table.full[slot] = (1, 2)  # same fingerprint, other content
    assert m.find(("m", "", ""), encode_tokens(data)) == []
    assert m.collisions == 1


def test_repeated_content_under_another_prefix_is_counted() -> None:
    m = Matcher(16)
    chunk = encode_tokens(toks(3, 16))
    m.learn(("m", "", ""), chunk, head=1)
    m.learn(("m", "", ""), chunk, head=1)  # the same chunk again: not repeated content
    assert m.repeated == 0
    m.learn(("m", "", ""), chunk, head=2)  # the same tokens after another prefix
    assert m.repeated == 1


def test_match_reports_a_document_after_another_system_prompt_per_instance() -> None:
    d = Directory(DirectoryConfig(match=True), KEY, "00" * 8)
    now = time.monotonic()
    d.registry.register(spec("a"), now)
    d.registry.register(spec("b"), now)
    doc = toks(4, 64)  # 4 chunks of 16
    stored = toks(5, 32) + doc  # a's prompt: system prompt 1 then the document
    for name, salt in (("a", "t"), ("b", "other")):
        inst = d.registry.get(name)
        assert inst is not None
        payload = batch_of(stored_events(stored, salt))
        apply_batch(d.registry, inst, batch_tokens_decoder.decode(payload), d.lora, d.matchers)
    request = toks(6, 23) + doc + toks(7, 10)  # another system prompt, unaligned
    rows = {r.id: r for r in d.scorer.match(MODEL, request, "t", None, now)}
    assert rows["a"].matches == [(23, "l1"), (39, "l1"), (55, "l1"), (71, "l1")]
    assert rows["b"].matches == []  # b holds the document for another tenant only
    assert d.scorer.score(MODEL, request, "t", None, now).instances[0].prefix_tokens == 0
    assert d.matchers is not None and d.matchers.totals()["entries"] == 12


def test_match_is_off_unless_configured() -> None:
    d = Directory(DirectoryConfig(), KEY, "00" * 8)
    with pytest.raises(NotFound):
        d.scorer.match(MODEL, [1] * 16, None, None, 0.0)
