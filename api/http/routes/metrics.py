"""Prometheus exposition. With an admin token set, the per-tenant series (their `tenant` label is a
cache_salt, a tenant's secret) are served only to a scrape that holds the token (Prometheus:
`authorization: {credentials: ...}` in the scrape config); everything else stays open."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from api.http.deps import AdminView, Ctx

router = APIRouter(tags=["metrics"])

TENANT_LABEL = "tenant"
TENANT_FAMILIES = "kvdepot_tenant_"


class WithoutTenants(Collector):
    """The families of `source`, less those about tenants (by name or by a `tenant` label)."""

    def __init__(self, source: Collector) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name.startswith(TENANT_FAMILIES):
                continue
            if any(TENANT_LABEL in sample.labels for sample in family.samples):
                continue
            yield family


@router.get(
    "/metrics",
    summary="Prometheus text exposition (per-tenant series: with the admin token, when one is set)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(ctx: Ctx, admin: AdminView) -> Response:
    source: Collector = ctx.registry if admin else WithoutTenants(ctx.registry)
    return Response(generate_latest(source), media_type=CONTENT_TYPE_LATEST)
