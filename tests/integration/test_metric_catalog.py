"""The metric catalog (docs/metrics.md) against a real sidecar's /metrics after traffic from a real
connector client: every exported family has a row saying its type, labels and meaning, every row
names an exported family, and `promtool check metrics` finds nothing to say about the text."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tests.integration.metrics_sidecar import load, observed_sidecar, scrape
from tests.integration.redis_keys import new_prefix
from tests.integration.tools import need_tool
from tests.metric_catalog import CATALOG, catalog_rows, differences, scraped_rows


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("catalog")
    with observed_sidecar(tmp, new_prefix("catalog")) as sc:
        figures = load(sc, rounds=10)
        # The traffic did what the labelled series need: L1 and L2 hits, misses, error replies,
        # L1 evictions (the L1 holds 64 chunks), quota refusals.
        assert figures["hits_l1"] > 0 and figures["hits_l2"] > 0, figures
        assert figures["misses"] > 0 and figures["errors"] == 10, figures
        text = scrape(sc)
        refused = 'kvdepot_tenant_quota_refused_chunks_total{tenant="tiny",tier="l1"}'
        for counter in ("kvdepot_evictions_total", refused):
            value = re.search(rf"^{re.escape(counter)} (\S+)$", text, re.M)
            assert value is not None and float(value[1]) > 0, counter
        return text


def test_every_exported_family_has_a_catalog_row_and_every_row_is_exported(scraped: str) -> None:
    rows = scraped_rows(scraped)
    assert len(rows) > 80
    unlabelled = [r.name for r in rows.values() if r.labels == ("?",)]
    assert unlabelled == [], f"families without a sample (the traffic must produce them): {unlabelled}"
    problems = differences(catalog_rows(CATALOG.read_text()), rows)
    stale = "docs/metrics.md is stale (python -m tests.metric_catalog):\n"
    assert problems == [], stale + "\n".join(problems)


def test_a_new_family_without_a_row_and_a_row_without_a_family_are_caught(scraped: str) -> None:
    extra = CollectorRegistry()
    added = Histogram("kvdepot_made_up_seconds", "Not a metric of the sidecar.", ["adapter"], registry=extra)
    added.labels("disk").observe(0.01)
    with_new = scraped + generate_latest(extra).decode()
    catalog = catalog_rows(CATALOG.read_text())
    problems = differences(catalog, scraped_rows(with_new))
    assert len(problems) == 2, problems  # the histogram and its `_created` series
    assert problems[0].startswith("exported without a catalog row: | `kvdepot_made_up_seconds` | histogram")
    del catalog["kvdepot_evictions_total"]
    catalog["kvdepot_made_up_total"] = catalog["kvdepot_lookups_total"]
    problems = differences(catalog, scraped_rows(scraped))
    assert any("`kvdepot_evictions_total`" in p and "without a catalog row" in p for p in problems)
    assert "catalog row for a metric not exported: kvdepot_made_up_total" in problems


def test_promtool_check_metrics_is_clean(scraped: str, tmp_path: Path) -> None:
    promtool = need_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "check", "metrics"], input=scraped, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "" and done.stderr.strip() == "", (
        done.stdout + done.stderr
    )
