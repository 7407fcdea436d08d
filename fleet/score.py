"""Scorer: for a request's token ids, the longest prefix each live instance can serve, per tier.

For each namespace the live instances of the request's model registered (rank 0, group 0: one
engine's view; the layout fingerprint and chunk size may differ between instances), the chunk
keys are computed as the sidecars compute them (fleet/hashing.py: rolling blake3 chain, seed of
model, layout and tenant) and looked up in the index. An instance's prefix ends at the first chunk
that none of its holders hold: its L1, its own L2 tiers, or any holder (its own or another
instance's) on a shared tier it is attached to. Each prefix chunk counts for the best tier holding
it (L1 > local L2 > shared L2); the score is the weighted share of the request's tokens,
minus the configured load penalties:

    score = (w_l1 * t_l1 + w_local * t_local + w_shared * t_shared) / len(token_ids)
            - load_weight_l1 * l1_usage - load_weight_queue * q / (q + 8)

Tenants: the tenant is in every key's seed, so a salted request can only match that tenant's
chunks. An instance whose events do not tell tenants apart (`salt_mode=omit`), or whose tenants are
hashed with another deployment key than the directory's, is never credited for a salted request
(it is listed with prefix 0). A LoRA request (`lora_name`) is keyed with each extra key the events
showed for that adapter name (the longest match wins); a name never seen matches nothing.
Multimodal: the request's token ids are keyed without extra keys, so the prefix stops at the first
chunk that overlaps a multimodal item (its key carries the item).

Cost: a request's chunk keys are hashed once per (layout, chunk size, tenant, extra key), not
per instance, and only as far as some holder holds them: one dict lookup per chunk gives the
bitmask of every holder (fleet/index.py), so a 32k-token request is its hashing (two blake3 calls
per chunk) plus a few microseconds per instance.

State: each instance's holder masks (L1, local L2, shared L2), rebuilt when the registry's holders
or shared tiers change (`InstanceRegistry.version`); otherwise reads the registry and the index.
Event loop only.

`match` answers `/v1/match` with the same eligibility rules (fleet/match.py finds the windows; the
index says who holds each chunk found, in which tier).

Primitives: Scorer(registry, namer, lora, config, key_id).score(model, token_ids, salt, lora, now)
-> Scores; .match(model, token_ids, salt, lora, now) -> [InstanceMatches].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from app.errors import InvalidInput, NotFound
from fleet.hashing import TenantNamer, iter_first_blocks, seed_of
from fleet.ingest import LoraBook
from fleet.match import Matchers
from fleet.registry import Instance, InstanceRegistry, Tier
from fleet.spec import DirectoryConfig, NamespaceSpec
from kvdepot_connector.protocol import encode_tokens

_L1, _LOCAL, _SHARED = Tier.L1.value, Tier.LOCAL_L2.value, Tier.SHARED_L2.value


@dataclass(slots=True)
class InstanceScore:
    id: str
    url: str
    engine_url: str | None
    prefix_tokens: int
    tiers: dict[str, int]
    score: float
    queue_depth: int
    l1_usage: float


@dataclass(slots=True)
class InstanceMatches:
    id: str
    url: str
    chunk_size: int
    matches: list[tuple[int, str]] = field(default_factory=list)
    """(token offset in the request, tier) of each window found."""


@dataclass(slots=True)
class _Query:
    """One score request: its packed token ids, tenant salt and LoRA extra keys, the index's
    chunk masks, and the key chains hashed for it so far ((layout, chunk size, tenant, extra) ->
    holder runs), shared by its instances."""

    model: str
    data: bytes
    salt: str
    extras: list[bytes]
    masks: dict[int, int]
    runs: dict[tuple[str, int, str, bytes], list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(slots=True)
class Scores:
    chunk_size: int
    instances: list[InstanceScore] = field(default_factory=list)


class Scorer:
    def __init__(
        self, registry: InstanceRegistry, namer: TenantNamer, lora: LoraBook, config: DirectoryConfig,
        key_id: str | None,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.namer = namer
        self.lora = lora
        self.config = config
        self.key_id = key_id
        self.requests = 0
        self.matchers: Matchers | None = None
        self.match_requests = 0
        self._masks_cache: dict[str, tuple[int, int, int]] = {}
        self._masks_version = -1

    def _namespace(self, inst: Instance, model: str) -> NamespaceSpec | None:
        for ns in inst.spec.namespaces:
            if ns.model == model and ns.kv_rank == 0 and ns.group == 0:
                return ns
        return None

    def _tenant_ok(self, inst: Instance, salt: str) -> bool:
        if not salt:
            return True
        mode = inst.spec.salt_mode
        if mode == "omit":
            return False
        if mode == "hashed":
            return self.namer.hashed_ok and inst.spec.salt_key_id == self.key_id
        return True

    def score(
        self, model: str, token_ids: Sequence[int] | bytes, salt: str | None, lora_name: str | None,
        now: float,
    ) -> Scores:  # fmt: skip
        self.requests += 1
        data = self._encode(token_ids, "scored")
        extras: list[bytes] = self.lora.extras(lora_name) if lora_name else [b""]
        query = _Query(model, data, salt or "", extras, self.registry.index.masks)
        n_tokens = max(len(data) // 4, 1)
        holder_masks = self._holder_masks()
        out: list[InstanceScore] = []
        chunk_size = 0
        for inst in self.registry.live(now):
            ns = self._namespace(inst, model)
            if ns is None:
                continue
            chunk_size = chunk_size or ns.chunk_size
            best = (0, 0, 0)
            if self._tenant_ok(inst, query.salt):
                best = self._longest_prefix(inst, ns, query, holder_masks[inst.id])
            out.append(self._instance_score(inst, ns.chunk_size, best, n_tokens))
        out.sort(key=_rank)
        return Scores(chunk_size=chunk_size, instances=out)

    def _encode(self, token_ids: Sequence[int] | bytes, verb: str) -> bytes:
        """The request's token ids as packed uint32 (bytes already are); InvalidInput past
        `max_tokens` or for an id that is not one."""
        if len(token_ids) > self.config.max_tokens * (4 if isinstance(token_ids, bytes) else 1):
            raise InvalidInput(f"at most {self.config.max_tokens} token ids are {verb}")
        try:
            return encode_tokens(token_ids)
        except (OverflowError, TypeError) as exc:
            raise InvalidInput(f"token ids must be integers in 0..2**32-1: {exc}") from None

    def _longest_prefix(
        self, inst: Instance, ns: NamespaceSpec, query: _Query, holders: tuple[int, int, int]
    ) -> tuple[int, int, int]:
        """The instance's servable prefix, the longest over the request's extra keys: (chunks, of
        them best held in L1, in local L2); each key chain hashed once per request."""
        size = ns.chunk_size
        tenant = self.namer.tenant(query.salt, inst.spec.salt_mode)
        l1, local, shared = holders
        best = (0, 0, 0)
        for extra in query.extras:
            ck = (ns.layout_fp, size, tenant, extra)
            runs = query.runs.get(ck)
            if runs is None:
                seed = seed_of(query.model, bytes.fromhex(ns.layout_fp), 0, 0, tenant)
                runs = query.runs[ck] = _runs(query.masks, iter_first_blocks(query.data, size, seed, extra))
            found = _walk(runs, l1, local, shared)
            if found[0] > best[0]:
                best = found
        return best

    def _instance_score(
        self, inst: Instance, size: int, best: tuple[int, int, int], n_tokens: int
    ) -> InstanceScore:
        """The weighted share of the request's tokens the prefix covers, less the load penalties."""
        w = self.config.weights
        chunks, in_l1, in_local = best
        t_l1, t_local, t_shared = in_l1 * size, in_local * size, (chunks - in_l1 - in_local) * size
        value = (w.l1 * t_l1 + w.local_l2 * t_local + w.shared_l2 * t_shared) / n_tokens
        spec = inst.spec
        q = spec.queue_depth
        value -= self.config.load_weight_l1 * spec.l1_usage
        value -= self.config.load_weight_queue * q / (q + 8)
        return InstanceScore(
            id=spec.id,
            url=spec.url,
            engine_url=spec.engine_url,
            prefix_tokens=chunks * size,
            tiers={_L1: t_l1, _LOCAL: t_local, _SHARED: t_shared},
            score=round(value, 6),
            queue_depth=q,
            l1_usage=spec.l1_usage,
        )

    def match(
        self, model: str, token_ids: Sequence[int], salt: str | None, lora_name: str | None, now: float,
        *, max_per_instance: int = 256,
    ) -> list[InstanceMatches]:  # fmt: skip
        """Per live instance of the model: where windows of the request equal chunks it holds, at
        any offset (greedy, non-overlapping, ascending), with the tier holding each."""
        self.match_requests += 1
        if self.matchers is None:
            raise NotFound("the non-prefix matcher is off (directory.match = false)")
        salt = salt or ""
        data = self._encode(token_ids, "matched")
        masks = self.registry.index.masks
        holder_masks = self._holder_masks()
        found: dict[tuple[int, str, str], list[tuple[int, int]]] = {}
        out: list[InstanceMatches] = []
        for inst in self.registry.live(now):
            ns = self._namespace(inst, model)
            if ns is None:
                continue
            row = InstanceMatches(inst.id, inst.spec.url, ns.chunk_size)
            out.append(row)
            matcher = self.matchers.get(ns.chunk_size, create=False)
            if matcher is None or not self._tenant_ok(inst, salt):
                continue
            tenant = self.namer.tenant(salt, inst.spec.salt_mode)
            key = (ns.chunk_size, tenant, lora_name or "")
            hits = found.get(key)
            if hits is None:
                hits = found[key] = matcher.find((model, tenant, lora_name or ""), data)
            l1, local, shared = holder_masks[inst.id]
            end = -1
            for offset, head in hits:
                if offset < end:
                    continue
                m = masks.get(head, 0)
                tier = (
                    Tier.L1
                    if m & l1
                    else Tier.LOCAL_L2
                    if m & local
                    else Tier.SHARED_L2
                    if m & shared
                    else None
                )
                if tier is None:
                    continue
                row.matches.append((offset, tier.value))
                end = offset + ns.chunk_size
                if len(row.matches) >= max_per_instance:
                    break
        out.sort(key=lambda r: (-len(r.matches), r.id))
        return out

    def _holder_masks(self) -> dict[str, tuple[int, int, int]]:
        """Instance id -> its (L1, local L2, shared L2) holder masks; the shared mask covers every
        holder (any instance's, live or not) on a shared tier the instance is attached to. Kept
        until the registry's holders or shared tiers change (`InstanceRegistry.version`)."""
        version = self.registry.version
        if self._masks_version == version:
            return self._masks_cache
        instances = self.registry.instances.values()
        shared_bits: dict[str, int] = {}
        for inst in instances:
            for medium, fp in inst.shared.items():
                bit = inst.holders.get(medium)
                if bit is not None:
                    shared_bits[fp] = shared_bits.get(fp, 0) | (1 << bit)
        out: dict[str, tuple[int, int, int]] = {}
        for inst in instances:
            l1 = local = shared = 0
            for medium, bit in inst.holders.items():
                tier = inst.tier_of(medium)
                if tier is Tier.L1:
                    l1 |= 1 << bit
                elif tier is Tier.LOCAL_L2:
                    local |= 1 << bit
            for fp in set(inst.shared.values()):
                shared |= shared_bits.get(fp, 0)
            out[inst.id] = (l1, local, shared)
        self._masks_cache, self._masks_version = out, version
        return out


def _runs(masks: dict[int, int], heads: Iterable[int]) -> list[tuple[int, int]]:
    """The chunks' holder masks, run-length encoded up to the first chunk nobody holds: prefixes
    held are nested, so a 32k-token request is a handful of runs, walked once per instance."""
    out: list[tuple[int, int]] = []
    get = masks.get
    last = -1
    count = 0
    for h in heads:
        m = get(h, 0)
        if not m:
            break
        if m == last:
            count += 1
            continue
        if count:
            out.append((last, count))
        last, count = m, 1
    if count:
        out.append((last, count))
    return out


def _walk(runs: list[tuple[int, int]], l1: int, local: int, shared: int) -> tuple[int, int, int]:
    """The servable prefix of one instance, in chunks: (all, best tier L1, best tier local L2)."""
    every = l1 | local | shared
    n = in_l1 = in_local = 0
    for mask, count in runs:
        if not mask & every:
            break
        if mask & l1:
            in_l1 += count
        elif mask & local:
            in_local += count
        n += count
    return n, in_l1, in_local


def _rank(s: InstanceScore) -> tuple[float, int, int, str]:
    return (-s.score, -s.prefix_tokens, s.queue_depth, s.id)
