"""Per tenant, which tier served each hit, with a real sidecar process and the disk tier (real
files): chunks written behind, L1 cleared by salt, a lookup served by the L2 prefetch counts as a
hit of the adapter (and an L1 miss), a lookup of what is in L1 as L1 hits; /quotas and the tenant
metrics say so per (tenant, tier), and another tenant's lookups count nothing for this one."""

from __future__ import annotations

import json
import urllib.request

from bench.sidecar import SidecarProcess
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import client
from tests.integration.tenant_traffic import TOKEN, content, http, read, store
from tests.integration.test_tenants_l2_process import written_behind
from tests.integration.waiting import wait_for


def scrape(sc: SidecarProcess) -> str:
    req = urllib.request.Request(sc.http + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def start(factory: StartSidecar) -> SidecarProcess:
    env = {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_L2__ADAPTERS": json.dumps([{"type": "disk", "name": "disk", "fsync": "never"}]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
    }
    return factory(env=env, l1_size_gb=3 / 1024)


def test_hits_are_counted_per_tenant_in_the_tier_that_served_them(sidecar_factory: StartSidecar) -> None:
    sc = start(sidecar_factory)
    c = client(sc.url)
    try:
        store(c, "h", 1, 0, 3, "w0")
        store(c, "o", 2, 0, 3, "w1")
        wait_for(lambda: written_behind(sc), what="write-behind")
        c.clear(cache_salt="h")
        got = read(c, "h", 0, 3, "r0", wait=True)  # L1 misses, all three served by the disk prefetch
        assert len(got) == 3 and all(o.equal(content(1, 0, i)) for i, o in enumerate(got))
        tiers = http(sc, "GET", "/quotas/h")[1]["tiers"]
        assert (tiers["l1"]["hits"], tiers["l1"]["misses"], tiers["disk"]["hits"]) == (0, 3, 3)
        store(c, "h", 1, 1, 2, "w2")
        assert len(read(c, "h", 1, 2, "r1")) == 2  # in L1
        assert len(read(c, "o", 0, 3, "r2")) == 3  # another tenant's L1 hits
        tiers = http(sc, "GET", "/quotas/h")[1]["tiers"]
        assert (tiers["l1"]["hits"], tiers["l1"]["misses"], tiers["disk"]["hits"]) == (2, 3, 3)
        other = http(sc, "GET", "/quotas/o")[1]["tiers"]
        assert (other["l1"]["hits"], other["disk"]["hits"]) == (3, 0)
        text = scrape(sc)
        assert sample(text, "kvdepot_tenant_hit_chunks_total", tenant="h", tier="disk") == 3
        assert sample(text, "kvdepot_tenant_hit_chunks_total", tenant="h", tier="l1") == 2
        assert sample(text, "kvdepot_tenant_miss_chunks_total", tenant="h", tier="l1") == 3
        assert sample(text, "kvdepot_tenant_hit_chunks_total", tenant="o", tier="disk") == 0
    finally:
        c.close()
