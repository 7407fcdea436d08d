"""Tenant labels with a real sidecar process: once a tenant is labelled, its cache_salt (a secret)
appears nowhere in /metrics nor /status, the label does; the label survives a restart (labels.json);
bad labels are 4xx with the error JSON and change nothing; removing the label brings the salt back
as the metric label."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sidecar import SidecarProcess
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import client
from tests.integration.tenant_traffic import TOKEN, http, read, store
from tests.integration.test_tenant_tiers_process import sample, scrape

SECRET = "secret-salt-7f3a9c"


def start(factory: StartSidecar, data_dir: Path) -> SidecarProcess:
    env = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN, "KVDEPOT_L2__ADAPTERS": "[]"}
    return factory(data_dir=data_dir, env=env, l1_size_gb=3 / 1024)


def traffic(sc: SidecarProcess, rid: str) -> None:
    c = client(sc.url)
    try:
        store(c, SECRET, 1, 0, 3, rid + "w0")
        store(c, "plain", 2, 0, 2, rid + "w1")
        assert len(read(c, SECRET, 0, 3, rid + "r0")) == 3
        read(c, SECRET, 5, 2, rid + "r1")  # misses
    finally:
        c.close()


def test_a_labelled_tenants_salt_never_appears_in_metrics(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    sc = start(sidecar_factory, data_dir)
    traffic(sc, "a")
    assert SECRET in scrape(sc)  # unlabelled, the top tenants are named by salt

    assert http(sc, "PUT", f"/tenants/{SECRET}/label", {"label": "acme"}, token=False)[0] == 401
    for bad in ("other", "_default", "has space", "", "x" * 65, "-lead", 7):
        status, body = http(sc, "PUT", f"/tenants/{SECRET}/label", {"label": bad})
        assert status == 422 and body["error"]["code"] == "invalid_input", (bad, body)
    assert http(sc, "PUT", f"/tenants/{SECRET}/label", {"label": "acme", "x": 1})[0] == 422
    assert http(sc, "PUT", "/tenants/" + "s" * 300 + "/label", {"label": "acme"})[0] == 422
    status, body = http(sc, "PUT", f"/tenants/{SECRET}/label", {"label": "plain"})  # another's salt
    assert status == 409 and body["error"]["code"] == "conflict"
    assert http(sc, "GET", f"/tenants/{SECRET}/label")[0] == 404

    status, body = http(sc, "PUT", f"/tenants/{SECRET}/label", {"label": "acme"})
    assert status == 200 and body == {"cache_salt": SECRET, "label": "acme"}
    assert http(sc, "PUT", "/tenants/plain/label", {"label": "acme"})[0] == 409  # taken
    traffic(sc, "b")
    text = scrape(sc)
    assert SECRET not in text
    assert sample(text, "kvdepot_tenant_hit_chunks_total", tenant="acme", tier="l1") == 6
    assert sample(text, "kvdepot_tenant_objects", tenant="acme", tier="l1") == 3
    assert 'tenant="plain"' in text
    assert SECRET not in json.dumps(sc.get_json("/status"))
    assert http(sc, "GET", f"/quotas/{SECRET}")[1]["tenant"] == "acme"
    status, job = http(sc, "DELETE", f"/tenants/{SECRET}/cache")
    assert status == 202 and job["tenant"] == "acme"
    sc.stop()

    sc = start(sidecar_factory, data_dir)  # the label is kept in <data_dir>/labels.json
    assert json.loads((data_dir / "labels.json").read_text())["labels"] == {SECRET: "acme"}
    traffic(sc, "c")
    text = scrape(sc)
    assert SECRET not in text and sample(text, "kvdepot_tenant_objects", tenant="acme", tier="l1") == 3
    assert http(sc, "GET", f"/tenants/{SECRET}/label")[1]["label"] == "acme"

    status, body = http(sc, "PUT", "/tenants/c%2Fd/label", {"label": "cd"})  # a salt with a slash
    assert status == 200 and body == {"cache_salt": "c/d", "label": "cd"}
    assert http(sc, "GET", "/tenants/c/d/label")[1]["label"] == "cd"
    assert http(sc, "PUT", "/tenants/_default/label", {"label": "dflt"})[1]["cache_salt"] == ""
    assert http(sc, "DELETE", f"/tenants/{SECRET}/label")[0] == 204
    assert http(sc, "DELETE", f"/tenants/{SECRET}/label")[0] == 404
    assert SECRET in scrape(sc)


def test_a_label_spelled_like_a_labelled_tenants_salt_is_refused(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    """A tenant's label never shows another tenant's salt: once SECRET is labelled `acme`, labelling
    another tenant `SECRET` would put SECRET in /metrics and /status as that tenant's name."""
    sc = start(sidecar_factory, tmp_path / "data")
    traffic(sc, "a")
    assert http(sc, "PUT", f"/tenants/{SECRET}/label", {"label": "acme"})[0] == 200
    status, body = http(sc, "PUT", "/tenants/plain/label", {"label": SECRET})
    assert status == 409 and body["error"]["code"] == "conflict", body
    assert SECRET not in scrape(sc)
    # a salt with a quota and no bytes yet is a known salt too
    assert http(sc, "PUT", "/quotas/quiet-salt-42", {"l1_bytes": 1 << 20})[0] == 200
    assert http(sc, "PUT", "/tenants/plain/label", {"label": "quiet-salt-42"})[0] == 409
    assert http(sc, "PUT", f"/tenants/{SECRET}/label", {"label": SECRET})[0] == 200  # its own salt
