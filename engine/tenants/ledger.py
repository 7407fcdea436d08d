"""TenantLedger: what each tenant (cache_salt) may hold per tier, what it holds, and its counters.

Role: the one place that knows quotas (and the allowlist mode) and usage per (tenant, tier). L1
reports into it from L1Cache; each L2 adapter reports the same way, through `TierAccounting`, with
its adapter name as the tier (the hook L2Tiers binds to it). The quota *check* is the tier's owner's:
`limit()` and `held()` are all it needs (L1Cache: on reserve, evicting the tenant's own LRU chunks
to make room; StoreController: before each write-behind, evicting the tenant's own blobs in that
adapter).

State (owned by the event loop, no locks):
  quotas    salt -> Quota
  accounts  salt -> TenantAccount: per tier bytes, objects, hits, misses, evictions, quota
            refusals. An account exists while its tenant holds bytes in some tier or has a quota, so
            their number is bounded by what is stored and what an admin configured, not by how many
            salts ever asked.
  labels    salt -> display name (engine/tenants/labels.py), used instead of the salt in metrics
  loose     per tier, counters no account holds: lookups by salts that hold nothing, refusals of
            salts without a quota (allowlist mode), counters of dropped accounts. Metrics report
            them under the tenant `other`.

Ledger semantics (L1):
- A tenant is charged the arena bytes (aligned size) of every object from its *reservation* on,
  not from its commit, so uncommitted writes cannot take it past its quota; a client that reserves
  and dies holds its bytes until the write lease expires. It is credited when the memory is freed:
  abort, expired reservation, eviction, delete, or the last unlock of a doomed (cleared while read)
  or temporary object. Storing a key that is present is EXISTS and charges nothing. Hence, at all
  times, held(salt, "l1") == the aligned sizes of that salt's objects in the arena, summed, and the
  sum over all salts == the allocator's used bytes.

Ledger semantics (L2, tier = adapter name): a tenant is charged the blob size (header included)
when the adapter holds the blob (the write returned; the disk adapter's start reports what it
found), credited when it no longer does (evicted for capacity or quota, deleted, found missing or
corrupt), charged or credited the difference when a key is written again. Hence held(salt, name)
== the sizes of that salt's blobs in the adapter, summed (Redis: of what this sidecar wrote and
has not seen deleted). A detached adapter's tier is forgotten.

Primitives in call order:
  limit(salt, tier) / held(salt, tier)           what may be held (None = unlimited) / what is
  charge(salt, tier, n) / credit(salt, tier, n)  an object's memory taken / freed
  note_lookup(salt, hits, misses)                once per LOOKUP: one dict get, nothing per chunk
  note_hits(salt, tier, chunks)                  once per prefetch and tier that served some of
                                                 the lookup's L1 misses (hits of that tier)
  note_eviction(salt, tier, n) / note_refusal(salt, tier, chunks)
  set_quota(salt, quota) / drop_quota(salt)      via QuotaRegistry, which persists first
  account(salt) / describe(salt) / labelled(top_n) / summary()    reads for HTTP, metrics, /status
  forget_tier(tier)                              an L2 adapter went away, and its usage with it
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.tenants.quota import DEFAULT_TENANT, L1, Quota, display_name

OTHER = "other"
"""The metric label of every tenant not among the top N (and of activity no account holds)."""
UNNAMEABLE = frozenset({OTHER, DEFAULT_TENANT})
"""Salts spelled like a reserved label are never labelled by name (they would collide)."""


class LedgerError(RuntimeError):
    """A credit without a matching charge. Always a bug in the reporting tier."""


@dataclass(slots=True)
class TierUsage:
    bytes: int = 0
    objects: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    quota_refusals: int = 0

    def add(self, other: TierUsage) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def copy(self) -> TierUsage:
        return dataclasses.replace(self)


@dataclass(eq=False, slots=True)
class TenantAccount:
    salt: str
    l1: TierUsage = field(default_factory=TierUsage)
    tiers: dict[str, TierUsage] = field(default_factory=dict)
    held: int = 0
    """Bytes over all tiers."""

    def __post_init__(self) -> None:
        self.tiers[L1] = self.l1

    def tier(self, name: str) -> TierUsage:
        if name == L1:
            return self.l1
        usage = self.tiers.get(name)
        if usage is None:
            usage = self.tiers[name] = TierUsage()
        return usage


class TierAccounting(Protocol):
    """What a tier reports into the ledger: L1Cache as `l1`, each L2 adapter under its name."""

    def limit(self, salt: str, tier: str) -> int | None: ...

    def held(self, salt: str, tier: str) -> int: ...

    def charge(self, salt: str, tier: str, nbytes: int, objects: int = 1) -> None: ...

    def credit(self, salt: str, tier: str, nbytes: int, objects: int = 1) -> None: ...

    def note_eviction(self, salt: str, tier: str, nbytes: int) -> None: ...

    def note_hits(self, salt: str, tier: str, chunks: int) -> None: ...

    def note_refusal(self, salt: str, tier: str, chunks: int = 1) -> None: ...

    def forget_tier(self, tier: str) -> None: ...


class TenantLedger:
    def __init__(
        self, *, allowlist: bool = False, quotas: Mapping[str, Quota] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.allowlist = allowlist
        self._labels: dict[str, str] = dict(labels or {})
        self._quotas: dict[str, Quota] = {}
        self._accounts: dict[str, TenantAccount] = {}
        self._loose: dict[str, TierUsage] = {L1: TierUsage()}
        for salt, quota in (quotas or {}).items():
            self.set_quota(salt, quota)

    # --- labels --------------------------------------------------------------------------------

    def labels(self) -> dict[str, str]:
        return dict(self._labels)

    def set_label(self, salt: str, label: str) -> None:
        """Via LabelRegistry, which checks and persists first."""
        self._labels[salt] = label

    def drop_label(self, salt: str) -> None:
        self._labels.pop(salt, None)

    def name_of(self, salt: str) -> str:
        """How metrics, /status, jobs and logs name the tenant: its label, else its salt."""
        label = self._labels.get(salt)
        return label if label is not None else display_name(salt)

    # --- quotas --------------------------------------------------------------------------------

    def quota(self, salt: str) -> Quota | None:
        return self._quotas.get(salt)

    def quotas(self) -> dict[str, Quota]:
        return dict(self._quotas)

    def set_quota(self, salt: str, quota: Quota) -> None:
        """Takes effect at the tenant's next reservation (see L1Cache for lowered quotas)."""
        self._quotas[salt] = quota
        if salt not in self._accounts:
            self._accounts[salt] = TenantAccount(salt)

    def drop_quota(self, salt: str) -> bool:
        if self._quotas.pop(salt, None) is None:
            return False
        acct = self._accounts.get(salt)
        if acct is not None and acct.held == 0:
            self._retire(acct)
        return True

    def limit(self, salt: str, tier: str) -> int | None:
        """Bytes `salt` may hold in `tier`; None = unlimited. Allowlist mode: 0 without a quota."""
        quota = self._quotas.get(salt)
        if quota is None:
            return 0 if self.allowlist else None
        return quota.limit(tier)

    # --- usage ---------------------------------------------------------------------------------

    def held(self, salt: str, tier: str = L1) -> int:
        acct = self._accounts.get(salt)
        if acct is None:
            return 0
        usage = acct.l1 if tier == L1 else acct.tiers.get(tier)
        return 0 if usage is None else usage.bytes

    def charge(self, salt: str, tier: str, nbytes: int, objects: int = 1) -> None:
        acct = self._accounts.get(salt)
        if acct is None:
            acct = self._accounts[salt] = TenantAccount(salt)
        usage = acct.l1 if tier == L1 else acct.tier(tier)
        usage.bytes += nbytes
        usage.objects += objects
        acct.held += nbytes

    def credit(self, salt: str, tier: str, nbytes: int, objects: int = 1) -> None:
        acct = self._accounts.get(salt)
        usage = None if acct is None else (acct.l1 if tier == L1 else acct.tiers.get(tier))
        if acct is None or usage is None or usage.bytes < nbytes or usage.objects < objects:
            held = 0 if usage is None else usage.bytes
            raise LedgerError(f"credit of {nbytes} bytes to {salt!r} in {tier}, which holds {held}")
        usage.bytes -= nbytes
        usage.objects -= objects
        acct.held -= nbytes
        if acct.held == 0 and salt not in self._quotas:
            self._retire(acct)

    def note_lookup(self, salt: str, hits: int, misses: int) -> None:
        acct = self._accounts.get(salt)
        usage = self._loose[L1] if acct is None else acct.l1
        usage.hits += hits
        usage.misses += misses

    def note_hits(self, salt: str, tier: str, chunks: int) -> None:
        """`chunks` L1 misses of one lookup were served by `tier` (an L2 adapter's prefetch; `l1`
        for chunks another request brought into L1 meanwhile)."""
        self._usage(salt, tier).hits += chunks

    def note_eviction(self, salt: str, tier: str, nbytes: int) -> None:
        usage = self._usage(salt, tier)
        usage.evictions += 1
        usage.evicted_bytes += nbytes

    def note_refusal(self, salt: str, tier: str, chunks: int = 1) -> None:
        self._usage(salt, tier).quota_refusals += chunks

    def forget_tier(self, tier: str) -> None:
        """An L2 adapter was detached: tenants no longer hold bytes there (counters are kept)."""
        if tier == L1:
            raise ValueError("L1 cannot be forgotten")
        for acct in list(self._accounts.values()):
            usage = acct.tiers.pop(tier, None)
            if usage is None:
                continue
            acct.held -= usage.bytes
            self._loose.setdefault(tier, TierUsage()).add(dataclasses.replace(usage, bytes=0, objects=0))
            if acct.held == 0 and acct.salt not in self._quotas:
                self._retire(acct)

    # --- reads ---------------------------------------------------------------------------------

    def account(self, salt: str) -> TenantAccount | None:
        return self._accounts.get(salt)

    def tenants(self) -> list[str]:
        """Salts with a quota or usage, sorted."""
        return sorted(self._accounts)

    def describe(self, salt: str) -> dict[str, Any] | None:
        """Quota, effective limit and usage per tier of one tenant; None if it has neither."""
        acct = self._accounts.get(salt)
        if acct is None:
            return None
        quota = self._quotas.get(salt)
        return {
            "cache_salt": salt,
            "tenant": self.name_of(salt),
            "quota": None if quota is None else quota.to_json(),
            "tiers": {
                tier: {"limit_bytes": self.limit(salt, tier), **dataclasses.asdict(usage)}
                for tier, usage in acct.tiers.items()
            },
        }

    def labelled(self, top_n: int) -> dict[str, dict[str, TierUsage]]:
        """Per metric label and tier, copies of usage and counters: the `top_n` tenants holding the
        most bytes by name (their label if they have one, else the salt; the empty salt as
        `_default`), all others summed as `other`."""
        ranked = sorted(self._accounts.values(), key=lambda a: (-a.held, a.salt))
        named = [a for a in ranked if a.salt in self._labels or a.salt not in UNNAMEABLE][:top_n]
        out: dict[str, dict[str, TierUsage]] = {
            self.name_of(a.salt): {t: u.copy() for t, u in a.tiers.items()} for a in named
        }
        other = {tier: usage.copy() for tier, usage in self._loose.items()}
        chosen = {id(a) for a in named}
        for acct in ranked:
            if id(acct) in chosen:
                continue
            for tier, usage in acct.tiers.items():
                other.setdefault(tier, TierUsage()).add(usage)
        out[OTHER] = other
        return out

    def summary(self, largest: int = 5) -> dict[str, Any]:
        """A few figures for /status."""
        holding = sorted((a for a in self._accounts.values() if a.held), key=lambda a: (-a.held, a.salt))
        refusals = sum(u.quota_refusals for u in self._loose.values())
        refusals += sum(u.quota_refusals for a in self._accounts.values() for u in a.tiers.values())
        return {
            "allowlist": self.allowlist,
            "quotas": len(self._quotas),
            "tenants_holding_bytes": len(holding),
            "quota_refused_chunks": refusals,
            "largest": [
                {
                    "tenant": self.name_of(a.salt),
                    "l1_bytes": a.l1.bytes,
                    "l1_limit_bytes": self.limit(a.salt, L1),
                }
                for a in holding[:largest]
            ],
        }

    # --- internals -----------------------------------------------------------------------------

    def _usage(self, salt: str, tier: str) -> TierUsage:
        acct = self._accounts.get(salt)
        if acct is not None:
            return acct.tier(tier)
        usage = self._loose.get(tier)
        if usage is None:
            usage = self._loose[tier] = TierUsage()
        return usage

    def _retire(self, acct: TenantAccount) -> None:
        """Drop an account that holds nothing and has no quota; its counters go to `loose`."""
        for tier, usage in acct.tiers.items():
            self._loose.setdefault(tier, TierUsage()).add(usage)
        del self._accounts[acct.salt]
