"""Administration: the control plane's changes to the engine: tenant quotas and L2 adapters.

Role: quota CRUD (through the QuotaRegistry, which persists before it applies) and L2
administration (attach, resize, detach adapters; the store policy and the prefetch deadline), each
answered with a typed answer (engine/answers.py). The data plane never calls this; api/http does.

State: none of its own. It holds the tenant ledger (the L1 cache's), the quota registry writing to
that ledger, the engine's L2 parts (None: the sidecar runs without L2) and the directories disk
adapters may use (`allowed_roots`; None: any). Owned by the event loop.

Primitives:
  quotas() / quota(salt)                    every tenant with a quota or usage / one (NotFound)
  set_quota(salt, quota) / delete_quota(salt)   durable and in effect for the next operation
                                            (l2_bytes also in every fleet-scope Redis adapter);
                                            a tenant over a lowered limit is brought down to it
                                            then, in L1 (`fit_l1`) and in every L2 tier
  fleet_quota(salt)                         quota(salt) with the fleet figures
  set_label(salt, label) / label(salt) / delete_label(salt)   display names (engine/tenants/labels.py)
  reconcile(name)                           a fleet-scope adapter's ledger, now
  l2_adapters() / l2_policy()               the attached adapters / the policy (None: no L2)
  add_adapter(config)                       Conflict on a duplicate name; ConfigError when it
                                            may not start (a disk path outside the allowed roots)
                                            or cannot (a disk path that cannot be written, ...)
  resize_adapter(name, bytes) / remove_adapter(name, mode)   NotFound for an unknown name
  set_l2_policy(store_policy, prefetch_deadline_ms)
Every L2 change raises NotFound when the sidecar runs without L2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import structlog

from app.errors import BackendError, ConfigError, Conflict, KVDepotError, NotFound
from engine.answers import (
    AdapterAnswer,
    AdapterList,
    FleetFigures,
    L2Policy,
    QuotaList,
    ReconcileAnswer,
    StorePolicy,
    TenantLabel,
    TenantQuota,
    TierFigures,
)
from engine.l2.enforce import enforce_quota
from engine.l2.parts import L2Parts
from engine.l2.tiers import RemoveMode, Tier
from engine.tenants.labels import LabelRegistry
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import Quota, check_salt
from engine.tenants.registry import QuotaRegistry
from storage.base import FleetQuota
from storage.config import AdapterConfigBase

log = structlog.get_logger("kvdepot.admin")


class Administration:
    def __init__(
        self, ledger: TenantLedger, quotas: QuotaRegistry, l2: L2Parts | None, *,
        allowed_roots: list[Path] | None = None, labels: LabelRegistry | None = None,
        fit_l1: Callable[[str], int] | None = None,
    ) -> None:  # fmt: skip
        if quotas.ledger is not ledger:
            raise ValueError("the quota registry must write to the L1 cache's ledger")
        self.ledger = ledger
        self.quota_registry = quotas
        self.label_registry = labels if labels is not None else LabelRegistry(ledger)
        self.l2 = l2
        self.allowed_roots = None if allowed_roots is None else [r.resolve() for r in allowed_roots]
        #: evicts a tenant's L1 objects down to its limit (L1Cache.fit_quota); None: nothing to do
        self._fit_l1 = fit_l1

    # --- tenants and quotas --------------------------------------------------------------------

    def quotas(self) -> QuotaList:
        """Every tenant with a quota or usage: its quota, limits and usage per tier."""
        ledger = self.ledger
        found = (ledger.describe(salt) for salt in ledger.tenants())
        return QuotaList(allowlist=ledger.allowlist, tenants=[tenant(d) for d in found if d is not None])

    def quota(self, salt: str) -> TenantQuota:
        found = self.ledger.describe(check_salt(salt))
        if found is None:
            raise NotFound(f"tenant {salt!r} has neither a quota nor usage")
        return tenant(found)

    async def set_quota(self, salt: str, quota: Quota) -> TenantQuota:
        """Create or replace a quota; durable and in effect for the next operation once it returns.
        The l2_bytes limit is also written to every fleet-scope adapter that answers; one that
        does not is named in the answer's `fleet_errors` (set the quota again once it is back)."""
        await self.quota_registry.put(salt, quota)
        errors: dict[str, str] = {}
        for name, fleet in self._fleets():
            try:
                await fleet.set_quota(salt, quota.l2_bytes)
            except BackendError as exc:
                log.warning("fleet_quota_not_written", adapter=name, error=str(exc))
                errors[name] = f"quota not written to this adapter: {exc}"
        # Met now, not at the tenant's next store (one that stopped writing would stay over).
        if self._fit_l1 is not None:
            self._fit_l1(salt)
        if self.l2 is not None:
            await enforce_quota(self.l2.tiers, salt)
        answer = await self.fleet_quota(salt)
        return dataclasses.replace(answer, fleet_errors=answer.fleet_errors | errors)

    async def delete_quota(self, salt: str) -> None:
        """Remove the quota here and, best effort, from every fleet-scope adapter."""
        await self.quota_registry.delete(check_salt(salt))
        for name, fleet in self._fleets():
            try:
                await fleet.drop_quota(salt)
            except BackendError as exc:
                log.warning("fleet_quota_not_removed", adapter=name, error=str(exc))

    async def fleet_quota(self, salt: str) -> TenantQuota:
        """`quota(salt)` with what every fleet-scope adapter's ledger says of the tenant (a tenant
        this sidecar knows nothing of but the fleet does is answered too); an adapter that does
        not answer is named in `fleet_errors`."""
        check_salt(salt)
        fleet: dict[str, FleetFigures] = {}
        errors: dict[str, str] = {}
        for name, ledger in self._fleets():
            try:
                used, blobs, limit = await ledger.usage(salt)
            except BackendError as exc:
                errors[name] = str(exc)
                continue
            if used or blobs or limit is not None:
                fleet[name] = FleetFigures(limit_bytes=limit, bytes=used, objects=blobs)
        found = self.ledger.describe(salt)
        if found is None and not fleet:
            raise NotFound(f"tenant {salt!r} has neither a quota nor usage")
        if found is None:
            return TenantQuota(
                cache_salt=salt, tenant=self.ledger.name_of(salt), quota=None, tiers={}, fleet=fleet,
                fleet_errors=errors,
            )  # fmt: skip
        return dataclasses.replace(tenant(found), fleet=fleet, fleet_errors=errors)

    async def set_label(self, salt: str, label: object) -> TenantLabel:
        """Name the tenant `label` in metrics, /status, jobs and logs; durable once answered."""
        await self.label_registry.put(salt, label)
        return self.label(salt)

    def label(self, salt: str) -> TenantLabel:
        check_salt(salt)
        found = self.ledger.labels().get(salt)
        if found is None:
            raise NotFound("this tenant has no label")
        return TenantLabel(cache_salt=salt, label=found)

    async def delete_label(self, salt: str) -> None:
        await self.label_registry.delete(check_salt(salt))

    async def reconcile(self, name: str) -> ReconcileAnswer:
        """Reconcile one fleet-scope adapter's ledger now (Conflict for any other adapter)."""
        tier = self._l2().tiers.get(name)
        fleet = tier.adapter.capabilities().fleet
        if fleet is None:
            raise Conflict(f"L2 adapter {name!r} keeps no fleet ledger (scope fleet, Redis only)")
        report = await fleet.reconcile()
        return ReconcileAnswer(
            adapter=name, keys_scanned=report.keys_scanned, tenants=report.tenants,
            released_bytes=report.released_bytes, adopted_bytes=report.adopted_bytes,
            ledger_fixed=report.ledger_fixed,
        )  # fmt: skip

    def _fleets(self) -> list[tuple[str, FleetQuota]]:
        """The active tiers with a fleet ledger (storage.base `fleet` capability)."""
        if self.l2 is None:
            return []
        out = []
        for tier in self.l2.tiers.active():
            fleet = tier.adapter.capabilities().fleet
            if fleet is not None:
                out.append((tier.name, fleet))
        return out

    # --- L2 ------------------------------------------------------------------------------------

    def l2_adapters(self) -> AdapterList:
        if self.l2 is None:
            return AdapterList(adapters=[], policy=None)
        return AdapterList(adapters=[adapter(t) for t in self.l2.tiers.all()], policy=self.l2_policy())

    def l2_policy(self) -> L2Policy | None:
        if self.l2 is None:
            return None
        return L2Policy(
            store_policy=cast(StorePolicy, self.l2.store.policy),  # set only from a StorePolicy
            prefetch_deadline_ms=self.l2.prefetch.deadline_s * 1000,
            store_queue_depth=self.l2.store.depth,
        )

    async def add_adapter(self, config: AdapterConfigBase) -> AdapterAnswer:
        """Attach an adapter; ConfigError naming it when it may not or cannot start."""
        l2 = self._l2()
        self._check_paths(config)
        try:
            tier = await l2.tiers.add(config)
        except KVDepotError:
            raise
        except Exception as exc:  # whatever an adapter raises when it starts is the config's fault
            log.warning("l2_adapter_refused", name=config.name, error=type(exc).__name__)
            raise ConfigError(f"l2.adapters[{config.name}]: cannot start: {type(exc).__name__}") from None
        return adapter(tier)

    def _check_paths(self, config: AdapterConfigBase) -> None:
        """The adapter's local paths (a disk adapter's directories, a slab adapter's files or
        devices: `config.local_paths()`) must lie under an allowed root once symlinks and `..` are
        resolved: the sidecar creates, writes and deletes there."""
        if self.allowed_roots is None:
            return
        for path in config.local_paths():
            resolved = path.resolve()
            if not any(resolved.is_relative_to(root) for root in self.allowed_roots):
                roots = ", ".join(str(r) for r in self.allowed_roots)
                raise ConfigError(
                    f"l2.adapters[{config.name}]: path {path} is outside l2.allowed_roots ({roots})"
                )

    async def resize_adapter(self, name: str, capacity_bytes: int) -> AdapterAnswer:
        return adapter(await self._l2().tiers.resize(name, capacity_bytes))

    async def remove_adapter(self, name: str, mode: RemoveMode) -> None:
        await self._l2().tiers.remove(name, mode)

    def set_l2_policy(self, store_policy: str | None, prefetch_deadline_ms: float | None) -> L2Policy:
        l2 = self._l2()
        if store_policy is not None:
            l2.store.policy = store_policy
        if prefetch_deadline_ms is not None:
            l2.prefetch.deadline_s = prefetch_deadline_ms / 1000
        policy = self.l2_policy()
        assert policy is not None
        return policy

    def _l2(self) -> L2Parts:
        if self.l2 is None:
            raise NotFound("this sidecar runs without L2")
        return self.l2


def tenant(described: dict[str, Any]) -> TenantQuota:
    """The ledger's description of a tenant (TenantLedger.describe) as a typed answer."""
    quota = described["quota"]
    return TenantQuota(
        cache_salt=described["cache_salt"],
        tenant=described["tenant"],
        quota=None if quota is None else Quota(**quota),
        tiers={name: TierFigures(**figures) for name, figures in described["tiers"].items()},
    )


def adapter(tier: Tier) -> AdapterAnswer:
    """An attached adapter as the control plane shows it: its config without secrets, figures
    copied now."""
    a = tier.adapter
    return AdapterAnswer(
        name=tier.name,
        type=a.kind,
        state="draining" if tier.draining else "active",
        config=tier.config.redacted(),
        usage=a.usage(),
        health=a.health(),
        inflight=tier.inflight,
        stats=dataclasses.replace(a.stats),
    )
