"""The directory's keys are the sidecars' keys (checked against the sidecar's own BlockNamer and
encoder), scoring walks the longest prefix per tier, shared tiers count for every attached
instance, tenants never see each other, LoRA is keyed by adapter name."""

from __future__ import annotations

import random
import time

import pytest

from api.kvevents.blocks import BlockNamer
from api.kvevents.wire import AllBlocksCleared, BlockRemoved, KVEventBatch, encode_batch
from app.errors import InvalidInput
from engine.events import L1_TIER, Event, Kind
from engine.keys import KVLayout, Namespace, ObjectKey, TokenHasher
from fleet.directory import Directory
from fleet.hashing import TenantNamer, first_blocks, iter_first_blocks, seed_of
from fleet.ingest import apply_batch, batch_decoder
from fleet.spec import DirectoryConfig, InstanceSpec, NamespaceSpec, TierSpec

LAYOUT = KVLayout("float16", 2, 2, 64, block_size=4, kind="test", chunk_size=16)
KEY = b"d" * 32
MODEL = "m"
FP = LAYOUT.fingerprint.hex()


def namer(mode: str = "hashed") -> BlockNamer:
    return BlockNamer(salt_mode=mode, deployment_key=KEY, layout_of=lambda _fp: LAYOUT)  # type: ignore[arg-type]


def tokens(seed: int, chunks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(chunks * 16)]


def stored_events(
    toks: list[int], salt: str, tier: str = L1_TIER, extra: bytes = b"", lora: str = "",
    model: str = MODEL,
) -> list[Event]:  # fmt: skip
    data = b"".join(t.to_bytes(4, "little") for t in toks)
    hashes = TokenHasher(16).chunk_hashes(data, extras=[extra] * (len(toks) // 16) if extra else ())
    ns = Namespace(model, LAYOUT.fingerprint)
    out = []
    for i, h in enumerate(hashes):
        out.append(
            Event(
                Kind.STORED,
                0,
                tier=tier,
                key=ObjectKey(ns, salt, h),
                tokens=data[i * 64 : (i + 1) * 64],
                parent=hashes[i - 1] if i else b"",
                extra=extra,
                lora_name=lora,
            )
        )
    return out


def batch_of(events: list[Event], mode: str = "hashed") -> bytes:
    n = namer(mode)
    stored = [n.stored(e) for e in events]
    return encode_batch(KVEventBatch(ts=time.time(), events=stored))  # type: ignore[arg-type]


def spec(name: str, *, mode: str = "hashed", shared: str | None = None, queue: int = 0) -> InstanceSpec:
    tiers = [TierSpec(medium="DISK")]
    if shared:
        tiers.append(TierSpec(medium="REDIS", shared=shared))
    return InstanceSpec(
        id=name, url=f"http://{name}:1", events_endpoint="tcp://127.0.0.1:1",
        namespaces=[NamespaceSpec(model=MODEL, layout_fp=FP, block_size=4, chunk_size=16)],
        salt_mode=mode, salt_key_id="00" * 8, tiers=tiers, queue_depth=queue,
    )  # fmt: skip


def directory(**config: object) -> Directory:
    return Directory(DirectoryConfig(**config), KEY, "00" * 8)


def feed(d: Directory, name: str, payload: bytes) -> None:
    inst = d.registry.get(name)
    assert inst is not None
    apply_batch(d.registry, inst, batch_decoder.decode(payload), d.lora)


@pytest.mark.parametrize("mode", ["hashed", "plain", "omit"])
def test_first_blocks_are_the_sidecars_block_hashes(mode: str) -> None:
    toks = tokens(1, 5)
    sidecar = [namer(mode).stored(e) for e in stored_events(toks, "tenant-a")]
    tenant = TenantNamer(KEY).tenant("tenant-a", mode)  # type: ignore[arg-type]
    seed = seed_of(MODEL, LAYOUT.fingerprint, 0, 0, tenant)
    data = b"".join(t.to_bytes(4, "little") for t in toks)
    assert first_blocks(data, 16, seed) == [s.block_hashes[0] for s in sidecar if s is not None]
    assert list(iter_first_blocks(data + b"\1\0\0\0", 16, seed)) == first_blocks(data, 16, seed)
    extra = bytes(range(32))
    assert list(iter_first_blocks(data, 16, seed, extra)) == first_blocks(data, 16, seed, extra)


def test_score_walks_the_longest_prefix_per_tier_best_first() -> None:
    d = directory()
    now = time.monotonic()
    for name in ("a", "b", "c"):
        d.registry.register(spec(name), now)
    toks = tokens(2, 8)
    feed(d, "a", batch_of(stored_events(toks[: 16 * 6], "")))  # a: 6 chunks in L1
    feed(d, "b", batch_of(stored_events(toks[: 16 * 3], "")))  # b: 3 in L1, 8 on disk
    feed(d, "b", batch_of(stored_events(toks, "", tier="disk")))
    feed(d, "c", batch_of(stored_events(toks[16:], "")))  # c: not the first chunk: nothing
    got = d.scorer.score(MODEL, toks, None, None, now)
    assert got.chunk_size == 16
    by = {s.id: s for s in got.instances}
    assert by["a"].prefix_tokens == 96 and by["a"].tiers == {"l1": 96, "local_l2": 0, "shared_l2": 0}
    assert by["b"].prefix_tokens == 128 and by["b"].tiers == {"l1": 48, "local_l2": 80, "shared_l2": 0}
    assert by["c"].prefix_tokens == 0
    assert [s.id for s in got.instances] == ["a", "b", "c"]  # 96 x 1.0 > 48 + 80 x 0.5
    assert by["a"].score == pytest.approx(96 / 128)

    # a removal cuts the prefix there; a clear forgets the instance
    n = namer()
    removed = [n.removed(e.key, L1_TIER) for e in stored_events(toks, "")[2:3]]  # type: ignore[arg-type]
    feed(d, "a", encode_batch(KVEventBatch(ts=0.0, events=removed)))  # type: ignore[arg-type]
    assert {s.id: s.prefix_tokens for s in d.scorer.score(MODEL, toks, None, None, now).instances}["a"] == 32
    feed(d, "b", encode_batch(KVEventBatch(ts=0.0, events=[AllBlocksCleared()])))
    assert {s.id: s.prefix_tokens for s in d.scorer.score(MODEL, toks, None, None, now).instances}["b"] == 0
    assert isinstance(removed[0], BlockRemoved)


def test_an_instance_naming_its_l1_gpu_is_scored_in_l1_by_that_name() -> None:
    d = directory()
    now = time.monotonic()
    d.registry.register(spec("g").model_copy(update={"l1_medium": "GPU"}), now)
    d.registry.register(spec("c"), now)
    toks = tokens(5, 4)
    gpu = BlockNamer(salt_mode="hashed", deployment_key=KEY, layout_of=lambda _fp: LAYOUT,
                     medium=lambda t: "GPU" if t == L1_TIER else t.upper())  # fmt: skip
    feed(d, "g", encode_batch(KVEventBatch(ts=0.0, events=[gpu.stored(e) for e in stored_events(toks, "")])))  # type: ignore[misc]
    feed(d, "c", batch_of(stored_events(toks, "")))  # CPU: the default L1 name
    by = {s.id: s for s in d.scorer.score(MODEL, toks, None, None, now).instances}
    assert by["g"].tiers == {"l1": 64, "local_l2": 0, "shared_l2": 0} == by["c"].tiers
    # for "c", whose L1 is CPU, a GPU medium is one of its other tiers
    feed(d, "c", encode_batch(KVEventBatch(ts=0.0, events=[AllBlocksCleared()])))
    feed(d, "c", encode_batch(KVEventBatch(ts=0.0, events=[gpu.stored(e) for e in stored_events(toks, "")])))  # type: ignore[misc]
    assert {s.id: s for s in d.scorer.score(MODEL, toks, None, None, now).instances}["c"].tiers["l1"] == 0


def test_a_shared_tier_counts_for_every_attached_instance_only() -> None:
    d = directory()
    now = time.monotonic()
    d.registry.register(spec("w", shared="aa" * 8), now)  # writes to redis A
    d.registry.register(spec("r", shared="aa" * 8), now)  # attached to the same redis
    d.registry.register(spec("o", shared="bb" * 8), now)  # another redis
    toks = tokens(3, 4)
    feed(d, "w", batch_of(stored_events(toks, "", tier="redis")))
    by = {s.id: s for s in d.scorer.score(MODEL, toks, None, None, now).instances}
    assert by["w"].tiers["shared_l2"] == 64 and by["r"].tiers["shared_l2"] == 64
    assert by["o"].prefix_tokens == 0
    assert by["r"].score == pytest.approx(0.25)


def test_load_weights_prefer_the_idle_instance_among_equal_prefixes() -> None:
    toks = tokens(7, 2)

    def scored(**weights: float) -> list[tuple[str, int, float]]:
        d = directory(**weights)
        now = time.monotonic()
        d.registry.register(spec("busy", queue=40), now)
        d.registry.register(spec("idle", queue=0), now)
        for name in ("busy", "idle"):
            feed(d, name, batch_of(stored_events(toks, "")))
        answer = d.scorer.score(MODEL, toks, None, None, now)
        return [(s.id, s.prefix_tokens, s.score) for s in answer.instances]

    # no load weight: equal scores, the shorter queue first
    assert scored() == [("idle", 32, 1.0), ("busy", 32, 1.0)]
    # with one: the busy instance's score drops by 0.5 * 40 / (40 + 8)
    (first, _, top), (second, _, low) = scored(load_weight_queue=0.5)
    assert (first, second) == ("idle", "busy") and top == 1.0
    assert low == pytest.approx(1.0 - 0.5 * 40 / 48, abs=1e-6)


def test_a_timed_out_instance_leaves_the_scores() -> None:
    d = directory(instance_timeout_s=5.0)
    d.registry.register(spec("a"), 100.0)
    assert [s.id for s in d.scorer.score(MODEL, [1] * 16, None, None, 104.0).instances] == ["a"]
    assert d.scorer.score(MODEL, [1] * 16, None, None, 106.0).instances == []
    assert d.scorer.score("other-model", [1] * 16, None, None, 104.0).instances == []


def test_tenants_never_leak_attacker_scores_with_other_salts() -> None:
    """An attacker knowing the victim's token ids scores them with its own salt, no salt, a salt
    differing by case or whitespace: the victim's chunks never count."""
    d = directory()
    now = time.monotonic()
    d.registry.register(spec("h"), now)
    d.registry.register(spec("p", mode="plain"), now)
    d.registry.register(spec("o", mode="omit"), now)
    toks = tokens(4, 4)
    feed(d, "h", batch_of(stored_events(toks, "victim")))
    feed(d, "p", batch_of(stored_events(toks, "victim"), mode="plain"))
    feed(d, "o", batch_of(stored_events(toks, "victim"), mode="omit"))
    victim = {s.id: s.prefix_tokens for s in d.scorer.score(MODEL, toks, "victim", None, now).instances}
    assert victim == {"h": 64, "p": 64, "o": 0}  # omit: tenants merged in the hashes, never credited
    for salt in ("attacker", None, "", "Victim", "victim ", "victim\0"):
        scores = d.scorer.score(MODEL, toks, salt, None, now).instances
        leaked = {s.id: s.prefix_tokens for s in scores if s.id != "o" and s.prefix_tokens}
        assert leaked == {}, salt
    # an instance hashing tenants with another deployment key is never credited for a salt
    other = Directory(DirectoryConfig(), b"x" * 32, "11" * 8)
    other.registry.register(spec("h"), now)
    inst = other.registry.get("h")
    assert inst is not None
    apply_batch(
        other.registry, inst, batch_decoder.decode(batch_of(stored_events(toks, "victim"))), other.lora
    )
    assert other.scorer.score(MODEL, toks, "victim", None, now).instances[0].prefix_tokens == 0


def test_lora_is_scored_by_adapter_name_learnt_from_events() -> None:
    d = directory()
    now = time.monotonic()
    d.registry.register(spec("a"), now)
    toks = tokens(5, 3)
    extra = bytes(range(32))
    feed(d, "a", batch_of(stored_events(toks, "", extra=extra, lora="sql")))
    by_name = d.scorer.score(MODEL, toks, None, "sql", now).instances[0]
    assert by_name.prefix_tokens == 48
    assert d.scorer.score(MODEL, toks, None, None, now).instances[0].prefix_tokens == 0  # base model
    assert d.scorer.score(MODEL, toks, None, "other", now).instances[0].prefix_tokens == 0


def test_an_adapter_named_without_an_extra_key_scores_like_the_base_model() -> None:
    d = directory()
    now = time.monotonic()
    d.registry.register(spec("a"), now)
    toks = tokens(6, 2)
    feed(d, "a", batch_of(stored_events(toks, "", lora="plain-adapter")))  # the client gave no key
    assert d.scorer.score(MODEL, toks, None, "plain-adapter", now).instances[0].prefix_tokens == 32


def test_bad_token_ids_are_invalid_input() -> None:
    d = directory(max_tokens=64)
    d.registry.register(spec("a"), 0.0)
    for bad in ([-1], [1 << 32], [1] * 65):
        with pytest.raises(InvalidInput):
            d.scorer.score(MODEL, bad, None, None, 0.0)


def test_a_tier_an_instance_starts_announcing_counts_at_the_next_score() -> None:
    d = directory()
    now = time.monotonic()
    d.registry.register(spec("a", shared="aa" * 8), now)
    toks = tokens(8, 4)
    feed(d, "a", batch_of(stored_events(toks[:32], "")))
    first = d.scorer.score(MODEL, toks, None, None, now).instances[0]
    assert first.tiers == {"l1": 32, "local_l2": 0, "shared_l2": 0}
    feed(d, "a", batch_of(stored_events(toks[:48], "", tier="disk")))  # a new holder: DISK
    feed(d, "a", batch_of(stored_events(toks, "", tier="redis")))  # and REDIS, a shared tier
    then = d.scorer.score(MODEL, toks, None, None, now).instances[0]
    assert then.tiers == {"l1": 32, "local_l2": 16, "shared_l2": 16}
    # forgotten, its bits go to the next instance: nothing of a's is credited to it
    d.registry.forget("a")
    d.registry.register(spec("b"), now)
    feed(d, "b", batch_of(stored_events(toks[:16], "", tier="disk")))
    assert [(s.id, s.tiers) for s in d.scorer.score(MODEL, toks, None, None, now).instances] == [
        ("b", {"l1": 0, "local_l2": 16, "shared_l2": 0})
    ]
