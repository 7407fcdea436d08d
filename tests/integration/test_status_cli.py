"""`kvdepot status` as a process against a real sidecar after traffic from a real connector client:
the JSON summary agrees with the sidecar's own /metrics (hits, tiers' health and bytes, tenants'
bytes), tenants only with the admin token (from the flag, a file or the environment), the terminal
table shows the same, and a wrong token or an unreachable sidecar is one line on stderr, exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sidecar import SidecarProcess
from tests.integration.metrics_sidecar import DEAD_ADAPTER, TOKEN, load, observed_sidecar, scrape
from tests.integration.redis_keys import new_prefix
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, dict[str, int]]]:
    prefix = new_prefix("status")
    with observed_sidecar(tmp_path_factory.mktemp("status"), prefix) as sc:
        yield sc, load(sc, rounds=4)


def status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")} | {"COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "app.cli", "status", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=base | (env or {}), check=False)  # fmt: skip


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return json.loads(result.stdout)


def test_the_json_summary_agrees_with_the_metrics(sidecar: tuple[SidecarProcess, dict[str, int]]) -> None:
    sc, figures = sidecar
    summary = as_json(status("--url", sc.http, "--token", TOKEN, "--json", "--top", "10"))
    metrics = samples(scrape(sc))
    assert summary["ready"] is True and summary["not_running"] == {}
    assert summary["hit_chunks"] == metrics[("kvdepot_lookup_hit_chunks_total", ())]
    assert summary["miss_chunks"] == metrics[("kvdepot_lookup_miss_chunks_total", ())]
    # What the client saw: its L1 hits, then the chunks its waiting lookups got from L2.
    assert summary["hit_chunks"] == figures["hits_l1"]
    assert summary["hits_from_l2"] == figures["hits_l2"] > 0
    total = summary["hit_chunks"] + summary["miss_chunks"]
    assert summary["hit_ratio"] == round((summary["hit_chunks"] + summary["hits_from_l2"]) / total, 4)
    tiers = {t["tier"]: t for t in summary["tiers"]}
    assert list(tiers) == ["l1", "disk", "shared", DEAD_ADAPTER]
    assert tiers["l1"]["bytes"] == metrics[("kvdepot_l1_used_bytes", ())]
    for name in ("disk", "shared", DEAD_ADAPTER):
        adapter = (("adapter", name),)
        assert tiers[name]["bytes"] == metrics[("kvdepot_l2_bytes", adapter)]
        assert tiers[name]["hits"] == metrics[("kvdepot_l2_loads_total", adapter)]
        up = {"ok": 1.0, "degraded": 0.5, "down": 0.0}[tiers[name]["health"]]
        assert up == metrics[("kvdepot_l2_up", adapter)]
    assert tiers[DEAD_ADAPTER]["health"] == "down" and "connect" in tiers[DEAD_ADAPTER]["last_error"].lower()
    assert tiers["disk"]["health"] == "ok" and tiers["disk"]["bytes"] > 0
    wb = summary["write_behind"]
    assert wb["submitted"] == metrics[("kvdepot_l2_store_submitted_total", ())] > 0
    tenants = {t["tenant"]: t for t in summary["tenants"]}
    assert set(tenants) == {"_default", "acme", "tiny"}
    byte_counts = [t["bytes"] for t in summary["tenants"]]
    assert byte_counts == sorted(byte_counts, reverse=True)
    for name, t in tenants.items():
        held = sum(v for (n, labels), v in metrics.items()
                   if n == "kvdepot_tenant_bytes" and ("tenant", name) in labels)  # fmt: skip
        assert t["bytes"] == held, name
    assert tenants["tiny"]["quota_refusals"] > 0 and tenants["acme"]["quota_refusals"] == 0
    top = as_json(status("--url", sc.http, "--token", TOKEN, "--json", "--top", "1"))["tenants"]
    assert [t["tenant"] for t in top] == [summary["tenants"][0]["tenant"]]


def test_tenants_need_the_token_from_a_flag_a_file_or_the_environment(
    sidecar: tuple[SidecarProcess, dict[str, int]], tmp_path: Path
) -> None:
    sc, _ = sidecar
    assert as_json(status("--url", sc.http, "--json"))["tenants"] is None
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    by_file = as_json(status("--url", sc.http, "--json", "--token-file", str(token_file)))
    by_env = as_json(status("--url", sc.http, "--json", env={"KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN}))
    assert by_file["tenants"] and by_env["tenants"]
    assert {t["tenant"] for t in by_file["tenants"]} == {t["tenant"] for t in by_env["tenants"]}


Sidecar = tuple[SidecarProcess, dict[str, int]]


def test_the_terminal_summary_shows_tiers_health_and_tenants(sidecar: Sidecar) -> None:
    sc, _ = sidecar
    shown = status("--url", sc.http, "--token", TOKEN)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "ready" in out and "Tiers" in out and "Top tenants" in out and "write-behind:" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert {"l1", "disk", "shared", DEAD_ADAPTER, "_default", "acme", "tiny"} <= set(rows)
    assert "down" in rows[DEAD_ADAPTER] and "ok" in rows["disk"]
    anonymous = status("--url", sc.http).stdout
    assert "Top tenants" not in anonymous and "shown with the admin token" in anonymous
    assert "tiny" not in anonymous and "acme" not in anonymous


def test_a_wrong_token_or_no_sidecar_is_one_line_and_exit_1(sidecar: Sidecar) -> None:
    sc, _ = sidecar
    wrong = status("--url", sc.http, "--token", "not-the-token", "--json")
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert wrong.stderr.count("\n") == 1 and "401" in wrong.stderr and "not-the-token" not in wrong.stderr
    gone = status("--url", f"http://127.0.0.1:{free_port()}", "--json")
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.startswith("kvdepot status: cannot read")
    not_kvdepot = status("--url", sc.http + "/metrics", "--json")  # answers, but not a kvdepot status
    assert not_kvdepot.returncode == 1 and not_kvdepot.stderr.count("\n") == 1
    no_file = status("--url", sc.http, "--token-file", "/nonexistent/token")
    assert no_file.returncode == 1 and "cannot read the token file" in no_file.stderr
    assert status("--url", sc.http, "--top", "-1").returncode == 2  # argparse: a usage error
