#!/usr/bin/env bash
# Sets up the environment and runs every gate: ruff, mypy --strict, import layering, the
# documentation site's mkdocs build --strict, pytest.
# Extra arguments go to one pytest run over what they name (e.g. tests/run.sh -k allocator);
# without any, the unit suite runs once the installs are done, then the integration and e2e suites
# side by side.
set -euo pipefail
cd "$(dirname "$0")/.."

# The independent installs run side by side (each mostly waits on downloads and unpacking); their
# output is shown when they end, and a failed one stops the run before any test.
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
background() {  # name command...: run in the background, its output in $logs/name
  local name="$1"; shift
  "$@" >"$logs/$name" 2>&1 &
  echo $! >"$logs/$name.pid"
}
finish() {  # name: wait for a background job, show its output, stop on its failure
  local rc=0
  wait "$(cat "$logs/$1.pid")" || rc=$?
  cat "$logs/$1"
  if [ "$rc" -ne 0 ]; then
    echo "error: $1 failed (exit $rc)" >&2
    exit "$rc"
  fi
}

# The e2e suite drives a real vLLM: its own environment (.venv-vllm; quick when already there).
background setup_vllm tests/e2e/setup_vllm.sh
# NVIDIA Dynamo's KV indexer, which an integration test feeds our KV events: its own environment.
background setup_dynamo tests/integration/setup_dynamo.sh

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Two distributions: the engine-side connector (./connector) and the sidecar, which depends on it.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ./connector -e '.[test]'

# The integration suites need a Redis; start one when none answers.
if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
# ... and a 3-node Redis Cluster on 7101-7103 (the cluster variants of the L2 tests).
tests/redis_cluster.sh

# Debian's prometheus (promtool checks; a real Prometheus scrapes a sidecar in
# tests/integration/test_prometheus.py) and chromium (the /docs page in a headless browser), when
# missing. As root, or through sudo without a password; a failed install fails those tests.
need=()
{ command -v prometheus && command -v promtool; } >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
install_tools() {
  local as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo -n)
  if ! { "${as_root[@]}" apt-get update -q && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -q "$@"; } >/tmp/kvdepot-apt.log 2>&1; then
    echo "warning: could not install $* (see /tmp/kvdepot-apt.log): their tests will fail" >&2
  fi
}
if [ ${#need[@]} -gt 0 ]; then
  background tools install_tools "${need[@]}"
fi

# Under this script a test whose tool is missing fails instead of skipping (tests/integration/tools.py).
export TESTS_NEED_TOOLS=1  # (no KVDEPOT_ prefix: the sidecar refuses unknown KVDEPOT_ names)

echo "== ruff (at ${SECONDS} s)"
.venv/bin/ruff check .
echo "== mypy --strict (at ${SECONDS} s)"
.venv/bin/mypy app api engine storage gpu fleet httpkit bench connector/kvdepot_connector
echo "== layering (at ${SECONDS} s)"
.venv/bin/python tests/check_layering.py
echo "== mkdocs build --strict (at ${SECONDS} s)"
# The documentation site, built into a temporary directory: a broken link or anchor between its
# pages fails (mkdocs.yml's validation settings, made fatal by --strict).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$logs/site"
echo "== setup_vllm (at ${SECONDS} s)"
finish setup_vllm
echo "== setup_dynamo (at ${SECONDS} s)"
finish setup_dynamo
if [ ${#need[@]} -gt 0 ]; then
  echo "== tools (${need[*]}) (at ${SECONDS} s)"
  finish tools
fi
if [ $# -eq 0 ]; then
  # The unit suite alone (nothing else running: its wall time is its own), then the others.
  echo "== pytest: unit (at ${SECONDS} s)"
  unit_rc=0
  .venv/bin/python -m pytest --durations=10 tests/unit || unit_rc=$?
  # The e2e suite (real vLLM engines: mostly CPU) runs beside the integration suite (real sidecars
  # and Redis: mostly waiting on them); they share no state (Redis keys under their own prefixes,
  # free ports, their own temporary directories). Its output follows the integration suite's.
  background e2e .venv/bin/python -m pytest -p no:cacheprovider --durations=15 tests/e2e
  echo "== pytest: integration (the e2e suite runs beside it) (at ${SECONDS} s)"
  integration_rc=0
  .venv/bin/python -m pytest --durations=25 tests/integration || integration_rc=$?
  echo "== pytest: e2e (at ${SECONDS} s)"
  e2e_rc=0
  wait "$(cat "$logs/e2e.pid")" || e2e_rc=$?
  cat "$logs/e2e"
  echo "== pytest done (at ${SECONDS} s)"
  if [ "$unit_rc" -ne 0 ] || [ "$integration_rc" -ne 0 ] || [ "$e2e_rc" -ne 0 ]; then
    echo "error: pytest failed (exit codes: unit $unit_rc, integration $integration_rc, e2e $e2e_rc)" >&2
    exit 1
  fi
else
  echo "== pytest (at ${SECONDS} s)"
  .venv/bin/python -m pytest "$@"
fi
