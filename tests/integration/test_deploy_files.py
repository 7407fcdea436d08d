"""deploy/: the Grafana dashboard, the Prometheus config and alert rules, the docker-compose file and
the Kubernetes pod, parsed and checked against the project: every metric their expressions name is
in the metric catalog (docs/metrics.md, checked against a live scrape by test_metric_catalog.py), the
rules pass `promtool check rules`, the compose services and the pod run what the Dockerfiles build
with the sockets where both containers see them, and the sidecar's own arguments and environment
from each file start a real `kvdepot serve` whose probes answer 200."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.sidecar import SidecarProcess
from tests.integration.test_serve_process import cli_env
from tests.integration.tools import need_tool
from tests.metric_catalog import CATALOG, catalog_rows
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvdepot.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
POD = DEPLOY / "kubernetes" / "pod.yaml"
PROMQL_WORDS = {
    "sum", "rate", "increase", "by", "histogram_quantile", "le", "op", "adapter", "tenant", "tier",
    "state", "instance", "job", "up", "and", "or", "unless", "on", "ignoring", "without", "offset",
    "group_left", "group_right",
}  # fmt: skip


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects (label values and keywords left out)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_strings)
    without_matchers = re.sub(r"\{[^}]*\}", "", without_ranges)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_matchers))
    return {w for w in words - PROMQL_WORDS if not re.fullmatch(r"\d+[smhd]?", w)}


def catalog_series() -> set[str]:
    """Every series name the catalog's families expose (histograms: _bucket, _sum, _count)."""
    names = {"up"}
    for row in catalog_rows(CATALOG.read_text()).values():
        if row.type == "histogram":
            names |= {row.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(row.name)
    return names


def test_the_dashboard_has_the_panels_an_operator_needs_over_catalogued_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvdepot"
    titles = " / ".join(p["title"] for p in dash["panels"]).lower()
    topics = ("tier usage", "hit ratio per tier", "hit ratio per tenant", "latency", "l2 health",
              "write-behind queue", "dropped", "evictions", "quota refusals", "dead workers")  # fmt: skip
    for topic in topics:
        assert topic in titles, topic
    known = catalog_series()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        assert metric_names(expr) <= known, (title, expr, metric_names(expr) - known)
    datasources = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    uid = datasources["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {uid}


def test_the_alert_rules_pass_promtool_and_name_catalogued_metrics() -> None:
    rules = alert_rules()
    names = {rule["alert"] for rule in rules}
    assert {"KvdepotSidecarDown", "KvdepotL2AdapterDown", "KvdepotWriteBehindDrops", "KvdepotL1NoSpace",
            "KvdepotL2NoSpace", "KvdepotDeadWorkers"} <= names  # fmt: skip
    known = catalog_series()
    for rule in rules:
        assert metric_names(rule["expr"]) <= known, rule
    promtool = need_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_the_image_copies_every_package_the_distribution_ships() -> None:
    """`pip install .` in the image installs what `[tool.setuptools.packages.find]` finds there: a
    package it does not COPY is missing from the image (fleet/ once was, and `serve` imports it)."""
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {pattern.rstrip("*") for pattern in found["include"]}
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages <= copied, packages - copied
    assert all((ROOT / p / "__init__.py").is_file() for p in packages)


def test_the_compose_file_runs_what_the_repository_builds() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert set(services) == {"engine", "kvdepot", "redis", "prometheus", "grafana"}
    sidecar, engine = services["kvdepot"], services["engine"]
    assert (COMPOSE.parent / sidecar["build"]["context"] / sidecar["build"]["dockerfile"]).resolve() == (
        ROOT / "Dockerfile"
    )
    engine_file = (COMPOSE.parent / engine["build"]["context"] / engine["build"]["dockerfile"]).resolve()
    assert engine_file == DEPLOY / "engine.Dockerfile"
    # The engine image pins the vLLM the e2e suite runs, and installs the connector.
    pin = re.search(r'VLLM_SPEC="([^"]+)"', (ROOT / "tests" / "e2e" / "setup_vllm.sh").read_text())
    assert pin is not None and pin.group(1) in engine_file.read_text()
    assert "COPY connector " in engine_file.read_text()
    # Bind-mounted files exist; the Prometheus config's target is the sidecar's service and port.
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), (name, volume)
    target = load_yaml(PROMETHEUS)["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target == "kvdepot:" + re.search(r"^EXPOSE (\d+)$", (ROOT / "Dockerfile").read_text(), re.M)[1]  # type: ignore[index]
    secret = "/run/secrets/" + services["prometheus"]["secrets"][0]
    assert load_yaml(PROMETHEUS)["scrape_configs"][0]["authorization"]["credentials_file"] == secret
    assert sidecar["environment"]["KVDEPOT_HTTP__ADMIN_TOKEN_FILE"] == secret
    check_engine_reaches_sidecar(engine["command"], engine["volumes"], sidecar["command"], sidecar["volumes"])
    grafana = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvdepot.yml")
    assert grafana[provider["providers"][0]["options"]["path"]] == "./grafana/dashboards"


def test_the_pod_shares_memory_volumes_and_probes_health_and_readiness() -> None:
    pod = load_yaml(POD)
    assert pod["kind"] == "Pod"
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert set(containers) == {"kvdepot", "engine"}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {name: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for name, c in containers.items()}
    for path in ("/dev/shm", "/run/kvdepot"):
        shared = mounts["kvdepot"][path]
        assert mounts["engine"][path] == shared
        assert volumes[shared]["emptyDir"]["medium"] == "Memory"
    sidecar = containers["kvdepot"]
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8080}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8080}
    for c in containers.values():
        assert c["resources"]["limits"]["memory"] and c["resources"]["limits"]["cpu"]
    engine_mounts = [f"{m['name']}:{m['mountPath']}" for m in containers["engine"]["volumeMounts"]]
    sidecar_mounts = [f"{m['name']}:{m['mountPath']}" for m in sidecar["volumeMounts"]]
    check_engine_reaches_sidecar(containers["engine"]["args"], engine_mounts, sidecar["args"], sidecar_mounts)


def check_engine_reaches_sidecar(
    engine_args: list[str], engine_volumes: list[str], sidecar_args: list[str], sidecar_volumes: list[str]
) -> None:
    """The engine loads the connector, and its data-plane URL is the sidecar's default socket in its
    data dir, on a volume both containers mount at the same path (the lifeline path the sidecar
    sends at hello must be valid in the engine too)."""
    from app.cli import build_parser

    config = json.loads(engine_args[engine_args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVDepotConnector" and config["kv_role"] == "kv_both"
    module = __import__(config["kv_connector_module_path"], fromlist=["__all__"])
    assert "KVDepotConnector" in module.__all__
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M)[1])  # type: ignore[index]
    args = build_parser().parse_args([*entry[1:], *sidecar_args])
    assert config["kv_connector_extra_config"]["kvdepot_url"] == f"ipc://{args.data_dir}/dataplane.sock"
    sidecar_mounts = {v.split(":")[1]: v.split(":")[0] for v in sidecar_volumes}
    engine_mounts = {v.split(":")[1]: v.split(":")[0] for v in engine_volumes}
    assert sidecar_mounts[str(args.data_dir)] == engine_mounts[str(args.data_dir)]


def serve_as_specified(args: list[str], env: dict[str, str], tmp: Path) -> SidecarProcess:
    """`kvdepot serve` with the image's ENTRYPOINT arguments, then `args` and `env` from a deploy
    file, container paths moved under `tmp`, any free port and a small arena."""

    def local(value: str) -> str:
        for path in ("/run/kvdepot", "/run/secrets", "/data"):
            value = value.replace(path, str(tmp / path.strip("/").replace("/", "-")))
        return value

    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M)[1])  # type: ignore[index]
    cmd = [sys.executable, "-m", "app.cli", *entry[1:], *args, "--http-port", "0", "--l1-size-gb", "0.02"]
    full_env = cli_env() | {k: local(v) for k, v in env.items()}
    proc = subprocess.Popen([local(a) for a in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, bufsize=1, cwd=ROOT)  # fmt: skip
    sidecar = SidecarProcess(proc)
    sidecar.wait_ready()
    return sidecar


def probe(sc: SidecarProcess, path: str) -> int:
    with urllib.request.urlopen(sc.http.replace("0.0.0.0", "127.0.0.1") + path, timeout=5) as resp:
        return int(resp.status)


def test_the_compose_sidecar_settings_start_a_real_sidecar(tmp_path: Path) -> None:
    service = load_yaml(COMPOSE)["services"]["kvdepot"]
    env = {k: str(v) for k, v in service["environment"].items()}
    # Redis by its service name is not here: the same adapter, pointed at a port nothing serves.
    dead = f"127.0.0.1:{free_port()}"
    env["KVDEPOT_L2__ADAPTERS"] = env["KVDEPOT_L2__ADAPTERS"].replace("redis:6379", dead)
    (tmp_path / "run-secrets").mkdir()
    (tmp_path / "run-secrets" / "kvdepot_admin_token").write_text("compose-test-token\n")
    sc = serve_as_specified(service["command"], env, tmp_path)
    try:
        assert probe(sc, "/health") == 200 and probe(sc, "/ready") == 200
        adapters = {a["name"]: a for a in sc.get_json("/status")["l2"]["adapters"]}
        assert set(adapters) == {"shared", "disk"}
        assert (tmp_path / "run-kvdepot" / "dataplane.sock").exists()
    finally:
        sc.stop()


def test_the_pod_sidecar_settings_start_a_real_sidecar(tmp_path: Path) -> None:
    pod = load_yaml(POD)
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "kvdepot")
    env = {e["name"]: e.get("value", "pod-test-token") for e in container["env"]}  # the Secret's value
    sc = serve_as_specified(container["args"], env, tmp_path)
    try:
        assert probe(sc, container["livenessProbe"]["httpGet"]["path"]) == 200
        assert probe(sc, container["readinessProbe"]["httpGet"]["path"]) == 200
        assert [a["name"] for a in sc.get_json("/status")["l2"]["adapters"]] == ["disk"]
        assert (tmp_path / "run-kvdepot" / "lifeline.sock").exists()
        assert (tmp_path / "data" / "l2").is_dir()
    finally:
        sc.stop()
