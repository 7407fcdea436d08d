"""The control plane of a real `kvdepot serve` process as the shipped image runs it: on every
interface only with an admin token (generated into the data dir when none is given), refusals of
an exposed or empty-token configuration and of disk adapters outside the allowed roots, and no
secret in any log line."""

from __future__ import annotations

import json
import re
import shlex
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from bench.sidecar import SidecarProcess
from tests.integration.test_serve_process import assert_refused, cli_env, run_serve

ROOT = Path(__file__).resolve().parents[2]  # the sidecar runs from here: this tree's code
DOCKERFILE = ROOT / "Dockerfile"


def image_command(data_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The image's ENTRYPOINT and ENV, read from the Dockerfile, with /data moved to `data_dir`, any
    free port and a small arena."""
    text = DOCKERFILE.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    env = cli_env()
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        for pair in shlex.split(line):
            name, _, value = pair.partition("=")
            env[name] = value.replace("/data", str(data_dir))
    assert entry[:2] == ["kvdepot", "serve"]
    args = [str(data_dir) if a == "/data" else a for a in entry[2:]]
    cmd = [sys.executable, "-m", "app.cli", "serve", *args, "--http-port", "0", "--l1-size-gb", "0.02"]
    return cmd, env


def popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1, cwd=ROOT
    )


def request(url: str, method: str = "GET", token: str | None = None, body: object = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_image_serves_every_interface_only_behind_a_generated_token(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    cmd, env = image_command(data_dir)
    assert "0.0.0.0" in cmd
    proc = popen(cmd, env)
    sidecar = SidecarProcess(proc)
    try:
        sidecar.wait_ready()
        token_file = data_dir / "admin-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        events = [json.loads(line) for line in sidecar.lines]
        generated = [e for e in events if e["event"] == "admin_token_generated"]
        assert [e["path"] for e in generated] == [str(token_file)]
        base = sidecar.http.replace("0.0.0.0", "127.0.0.1")
        quota = {"l1_bytes": 4096}
        assert request(f"{base}/quotas/a", "PUT", body=quota) == 401
        assert request(f"{base}/l2/adapters", "POST", body={"type": "mock", "name": "m"}) == 401
        assert request(f"{base}/quotas") == 401
        assert request(f"{base}/quotas/a", "PUT", token=token, body=quota) == 200
        assert request(f"{base}/health") == 200
    finally:
        sidecar.stop()
    assert token not in "\n".join(sidecar.lines)
    # A restart keeps the token it generated.
    again = SidecarProcess(popen(cmd, env))
    try:
        again.wait_ready()
        assert (data_dir / "admin-token").read_text().strip() == token
        assert not any('"admin_token_generated"' in line for line in again.lines)
    finally:
        again.stop()


def test_every_interface_without_a_token_is_refused(tmp_path: Path) -> None:
    cmd, env = image_command(tmp_path / "data")
    del env["KVDEPOT_HTTP__ADMIN_TOKEN_FILE"]
    result = run_serve(ROOT, *cmd[4:])
    assert_refused(result, "http", "0.0.0.0", "http.admin_token", "http.allow_unauthenticated")
    assert not (tmp_path / "data" / "admin-token").exists()


def test_an_empty_admin_token_is_refused(tmp_path: Path) -> None:
    env = {"KVDEPOT_HTTP__ADMIN_TOKEN": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--data-dir", str(tmp_path / "d"), "--http-port", "0"],
        check=False, capture_output=True, text=True, env=cli_env() | env, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert "http.admin_token: must not be empty" in proc.stderr


def test_a_disk_adapter_outside_the_allowed_roots_is_refused_at_start(tmp_path: Path) -> None:
    config = tmp_path / "kvdepot.toml"
    config.write_text(f'[[l2.adapters]]\ntype = "disk"\nname = "far"\npaths = ["{tmp_path / "far"}"]\n')
    result = run_serve(
        ROOT, "--config", str(config), "--data-dir", str(tmp_path / "d"), "--http-port", "0",
        "--l1-size-gb", "0.01",
    )  # fmt: skip
    assert_refused(result, "l2.adapters[far]", "l2.allowed_roots")
    assert not (tmp_path / "far").exists()


def test_a_redis_password_is_in_no_log_line(tmp_path: Path) -> None:
    password = "pr0cess-redis-secret"
    config = tmp_path / "kvdepot.toml"
    config.write_text(
        f'[[l2.adapters]]\ntype = "redis"\nname = "r"\nurl = "redis://kv:{password}@127.0.0.1:1/0"\n'
    )
    cmd = [
        sys.executable, "-m", "app.cli", "serve", "--config", str(config), "--data-dir", str(tmp_path / "d"),
        "--http-port", "0", "--l1-size-gb", "0.01", "--log-level", "debug",
    ]  # fmt: skip
    env = cli_env() | {"KVDEPOT_HTTP__ADMIN_TOKEN": "tok-en"}
    sidecar = SidecarProcess(popen(cmd, env))
    try:
        sidecar.wait_ready()
        base = sidecar.http
        second = {"type": "redis", "name": "r2", "url": f"redis://:{password}@127.0.0.1:1/1"}
        assert request(f"{base}/l2/adapters", "POST", token="tok-en", body=second) == 201
        for path in ("/status", "/l2/adapters", "/metrics"):
            with urllib.request.urlopen(base + path, timeout=5) as resp:
                assert password not in resp.read().decode()
    finally:
        sidecar.stop()
    logged = "\n".join(sidecar.lines)
    assert "kvdepot_started" in logged and "l2_adapter_added" in logged
    assert password not in logged and "tok-en" not in logged
