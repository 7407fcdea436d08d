"""A real Prometheus (Debian's `prometheus` package; tests/run.sh installs it) on a loopback port of
its own, scraping a real sidecar every second while a real connector client stores and looks up
(tests/integration/metrics_load.py), with deploy/'s scrape config (the admin token from a file)
and alert rules. Every expression of the Grafana dashboard is evaluated through Prometheus's HTTP
query API and must return data without error; every alert rule must evaluate without error; and
the rule the test provokes (an L2 adapter pointed at a port nothing listens on) must fire.

The values each panel expression returned are printed (pytest -s) and written to
$KVDEPOT_PANEL_VALUES (default /tmp/kvdepot-prometheus-panels.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.metrics_sidecar import DEAD_ADAPTER, TOKEN, observed_sidecar, start_load
from tests.integration.redis_keys import new_prefix
from tests.integration.test_deploy_files import ALERTS, PROMETHEUS, alert_rules, dashboard_exprs
from tests.integration.tools import need_tool
from tests.ports import free_port

pytestmark = pytest.mark.slow

PROVOKED = "KvdepotL2AdapterDown"
PANEL_VALUES = Path(os.environ.get("KVDEPOT_PANEL_VALUES", "/tmp/kvdepot-prometheus-panels.json"))


class Prometheus:
    def __init__(self, binary: str, config: Path, data: Path, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log = (data.parent / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def get(self, path: str, **params: str) -> Any:
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # a bad query: 400 with a JSON body saying why
            return json.loads(exc.read())

    def query(self, expr: str) -> Any:
        return self.get("/api/v1/query", query=expr)

    def wait_ready(self, timeout: float = 60) -> None:
        up = f"{self.base}/-/ready"
        until(lambda: self.proc.poll() is None and answers(up), timeout, "prometheus ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def until(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def rules_copy(path: Path) -> Path:
    """deploy/prometheus/alerts.yml as it is, except the provoked rule's hold (`for`), 5 s instead
    of its 30 s: the test watches it fire without waiting half a minute. Everything else, its
    expression included, is the file's."""
    rules: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    found = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == PROVOKED]
    assert len(found) == 1 and "for" in found[0], f"{PROVOKED} with a hold in {ALERTS}"
    found[0]["for"] = "5s"
    path.write_text(yaml.safe_dump(rules))
    return path


def scrape_config(target: str, token_file: Path, rules: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with this test's target, token file, rules file and
    1-second scrapes and evaluations."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
    config["rule_files"] = [str(rules)]
    job = config["scrape_configs"][0]
    assert job["job_name"] == "kvdepot"
    job["authorization"]["credentials_file"] = str(token_file)
    job["static_configs"] = [{"targets": [target]}]
    return config


@pytest.fixture
def prometheus_binary() -> str:
    need_tool("promtool", "prometheus")
    return need_tool("prometheus", "prometheus")


@pytest.fixture
def running(prometheus_binary: str, tmp_path: Path) -> Iterator[tuple[Prometheus, str]]:
    """(Prometheus, the sidecar's instance label): a sidecar under load, scraped every second."""
    with observed_sidecar(tmp_path / "sidecar", new_prefix("prom")) as sc:
        load = start_load(sc, rounds=400, seconds=150, pause=0.2)
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        target = sc.http.removeprefix("http://")
        config = tmp_path / "prometheus.yml"
        rules = rules_copy(tmp_path / "alerts.yml")
        config.write_text(yaml.safe_dump(scrape_config(target, token_file, rules)))
        promtool = str(Path(prometheus_binary).with_name("promtool"))
        checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True,
                                 timeout=60, check=False)  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
        prom = Prometheus(prometheus_binary, config, tmp_path / "tsdb", free_port())
        try:
            prom.wait_ready()
            yield prom, target
        finally:
            prom.stop()
            load.terminate()
            _, err = load.communicate(timeout=30)
            assert load.returncode in (0, -15), err[-3000:]


def series_values(result: dict[str, Any]) -> list[str]:
    return [f"{json.dumps(r['metric'], sort_keys=True)} = {r['value'][1]}" for r in result["data"]["result"]]


def test_dashboards_and_alerts_evaluate_in_a_real_prometheus(running: tuple[Prometheus, str]) -> None:
    prom, target = running
    # Scraped with the token (tenant series present) and up.
    until(lambda: prom.query(f'up{{job="kvdepot",instance="{target}"}} == 1')["data"]["result"], 60,
          "the sidecar's target up")  # fmt: skip
    until(lambda: prom.query("kvdepot_tenant_bytes")["data"]["result"], 30, "tenant series scraped")
    # Traffic over several scrapes: lookups, L1 evictions, L2 loads and dead workers rising.
    for counter in ("lookups", "evictions", "l2_loads", "worker_dead"):
        expr = f"increase(kvdepot_{counter}_total[1m]) > 0"
        until(lambda e=expr: prom.query(e)["data"]["result"], 90, expr)

    # Every dashboard expression: no error, and data (waited for: a rate needs two scrapes).
    panels: list[dict[str, Any]] = []
    for title, expr in dashboard_exprs():
        answer = prom.query(expr)
        assert answer["status"] == "success", (title, expr, answer)
        until(lambda e=expr: prom.query(e)["data"]["result"], 60, f"data for {title!r}: {expr}")
        answer = prom.query(expr)
        panels.append({"panel": title, "expr": expr, "values": series_values(answer)})
    PANEL_VALUES.write_text(json.dumps(panels, indent=1))
    for panel in panels:
        print(f"\n[{panel['panel']}] {panel['expr']}")
        for value in panel["values"]:
            print(f"    {value}")

    # The provoked rule fires for the dead adapter, and only for it.
    def firing() -> list[dict[str, Any]]:
        alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == PROVOKED and a["state"] == "firing"]

    until(firing, 90, f"{PROVOKED} firing")
    assert {a["labels"]["adapter"] for a in firing()} == {DEAD_ADAPTER}

    # Every rule of the file is loaded and evaluates without error; the sidecar is not "down".
    rules = {r["name"]: r for g in prom.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]}
    assert set(rules) == {r["alert"] for r in alert_rules()}
    for name, rule in rules.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)
        assert rule["lastEvaluation"] > "2000", (name, rule)  # evaluated (not the zero time)
    assert rules["KvdepotSidecarDown"]["state"] == "inactive"
    assert rules[PROVOKED]["state"] == "firing"
    print("\nrules: " + ", ".join(f"{n}={r['state']}" for n, r in sorted(rules.items())))
