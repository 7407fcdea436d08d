"""The directory's fast path computes the sidecars' keys, exactly: for random requests (chunk and
block sizes, token ids over the whole uint32 range, a partial last chunk, salts in every salt mode,
LoRA extra keys, multimodal extra keys on single chunks), the block hashes the scorer looks up equal
those a sidecar announces (engine/keys.py's TokenHasher, chunk by chunk, then api/kvevents'
BlockNamer), and a scored request finds exactly the prefix each instance was told to hold."""

from __future__ import annotations

import random
import struct
import time

from api.kvevents.blocks import BlockNamer
from api.kvevents.wire import KVEventBatch, encode_batch
from engine.events import L1_TIER, Event, Kind
from engine.keys import KVLayout, Namespace, ObjectKey, TokenHasher
from fleet.directory import Directory
from fleet.hashing import TenantNamer, first_blocks, iter_first_blocks, seed_of
from fleet.ingest import apply_batch, batch_decoder
from fleet.spec import DirectoryConfig, InstanceSpec, NamespaceSpec, TierSpec
from kvdepot_connector.protocol import encode_tokens

KEY = b"k" * 32
KEY_ID = "00" * 8
MODES = ("hashed", "plain", "omit")
SALTS = ("", "tenant-a", "Tenant-A", "t\u00e9nant \u2603", "x" * 300)


def random_tokens(rng: random.Random, chunk: int, full_chunks: int) -> list[int]:
    n = full_chunks * chunk + rng.randrange(chunk)  # a partial last chunk, most of the time
    edges = (0, 1, 2**32 - 1, 2**31)
    return [rng.choice(edges) if rng.random() < 0.05 else rng.randrange(2**32) for _ in range(n)]


def random_layout(rng: random.Random) -> KVLayout:
    chunk = rng.choice([1, 2, 3, 4, 16, 48, 256])
    block = rng.choice([b for b in (1, 2, 3, 4, 16) if chunk % b == 0])
    return KVLayout("float16", 2, 2, 64, block_size=block, kind="test", chunk_size=chunk)


def sidecar_events(
    layout: KVLayout, model: str, toks: list[int], salt: str, extras: list[bytes], *,
    tier: str = L1_TIER, lora: str = "",
) -> list[Event]:  # fmt: skip
    """What a sidecar publishes for storing `toks`: its own per-chunk chain (TokenHasher)."""
    data = struct.pack(f"<{len(toks)}I", *toks)  # uint32 little-endian, the wire format
    hashes = TokenHasher(layout.chunk_size).chunk_hashes(data, extras=extras)
    ns = Namespace(model, layout.fingerprint)
    step = layout.chunk_size * 4
    out = []
    for i, h in enumerate(hashes):
        event = Event(
            Kind.STORED, 0, tier=tier, key=ObjectKey(ns, salt, h), tokens=data[i * step : (i + 1) * step],
            parent=hashes[i - 1] if i else b"", extra=extras[i] if i < len(extras) else b"",
            lora_name=lora,
        )  # fmt: skip
        out.append(event)
    return out


def namer(layout: KVLayout, mode: str) -> BlockNamer:
    return BlockNamer(salt_mode=mode, deployment_key=KEY, layout_of=lambda _fp: layout)  # type: ignore[arg-type]


def test_the_directorys_block_hashes_are_the_sidecars_for_random_requests() -> None:
    rng = random.Random(20261201)
    for trial in range(200):
        layout = random_layout(rng)
        chunk = layout.chunk_size
        model = rng.choice(["m", "org/model-7b", "mod\u00e8le"])
        mode = rng.choice(MODES)
        salt = rng.choice(SALTS)
        lora_key = rng.randbytes(32) if rng.random() < 0.4 else b""
        toks = random_tokens(rng, chunk, rng.randrange(0, 12))
        n = len(toks) // chunk
        events = sidecar_events(layout, model, toks, salt, [lora_key] * n if lora_key else [])
        stored = [namer(layout, mode).stored(e) for e in events]
        announced = [s.block_hashes[0] for s in stored if s is not None]
        assert len(announced) == n

        tenant = TenantNamer(KEY).tenant(salt, mode)  # type: ignore[arg-type]
        seed = seed_of(model, layout.fingerprint, 0, 0, tenant)
        data = encode_tokens(toks)
        context = (trial, chunk, mode, salt, bool(lora_key), len(toks))
        assert list(iter_first_blocks(data, chunk, seed, lora_key)) == announced, context
        assert first_blocks(data, chunk, seed, lora_key) == announced, context


def spec_for(name: str, layout: KVLayout, mode: str) -> InstanceSpec:
    return InstanceSpec(
        id=name, url=f"http://{name}:1", events_endpoint="tcp://127.0.0.1:1",
        namespaces=[NamespaceSpec(
            model="m", layout_fp=layout.fingerprint.hex(), block_size=layout.block_size,
            chunk_size=layout.chunk_size,
        )],
        salt_mode=mode, salt_key_id=KEY_ID, tiers=[TierSpec(medium="DISK")],
    )  # fmt: skip


def test_random_requests_score_exactly_the_prefix_each_instance_stored() -> None:
    """Each instance stores a random prefix of the request (the sidecar's events, random tier,
    salt, LoRA adapter, sometimes a multimodal chunk), then the request is scored: the prefix
    found is what was stored up to the first chunk keyed by more than the tokens."""
    rng = random.Random(7)
    for trial in range(40):
        layout = random_layout(rng)
        chunk = layout.chunk_size
        mode = rng.choice(("hashed", "plain"))
        salt = rng.choice(SALTS)
        lora = rng.choice(("", "sql"))
        lora_key = rng.randbytes(32) if lora else b""
        toks = random_tokens(rng, chunk, rng.randrange(1, 10))
        n = len(toks) // chunk
        d = Directory(DirectoryConfig(), KEY, KEY_ID)
        now = time.monotonic()
        expected: dict[str, int] = {}
        for i in range(rng.randrange(1, 6)):
            name = f"i{i}"
            d.registry.register(spec_for(name, layout, mode), now)
            held = rng.randrange(0, n + 1)
            extras = [lora_key] * held if lora_key else []
            image = -1
            if held and not lora and rng.random() < 0.3:  # a chunk keyed by an image: stops there
                image = rng.randrange(held)
                extras = [b""] * held
                extras[image] = rng.randbytes(32)
            # a store lands in L1 first (where the adapter's name is learnt), then maybe on disk
            tiers = [L1_TIER] if rng.random() < 0.5 else [L1_TIER, "disk"] if lora else ["disk"]
            stored = [
                namer(layout, mode).stored(e)
                for tier in tiers
                for e in sidecar_events(layout, "m", toks[: held * chunk], salt, extras, tier=tier, lora=lora)
            ]
            payload = encode_batch(KVEventBatch(ts=0.0, events=stored))  # type: ignore[arg-type]
            inst = d.registry.get(name)
            assert inst is not None
            apply_batch(d.registry, inst, batch_decoder.decode(payload), d.lora)
            expected[name] = (image if image >= 0 else held) * chunk
            # scored after each instance: what the last one registered and stored counts at once
            for tokens_in in (toks, encode_tokens(toks)):
                got = d.scorer.score("m", tokens_in, salt or None, lora or None, now)
                assert {s.id: s.prefix_tokens for s in got.instances} == expected, (trial, expected)
            tier_of = "l1" if tiers[0] == L1_TIER else "local_l2"
            assert {s.id: s.tiers[tier_of] for s in got.instances}[name] == expected[name]
        other = d.scorer.score("m", toks, salt + "-other", lora or None, now)
        assert all(s.prefix_tokens == 0 for s in other.instances)
