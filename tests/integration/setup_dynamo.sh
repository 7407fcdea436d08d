#!/usr/bin/env bash
# Creates .venv-dynamo: NVIDIA Dynamo's runtime (ai-dynamo-runtime, whose `python -m dynamo.indexer`
# is the standalone KV indexer: Rust, no GPU needed) in a venv of its own, never in the sidecar's or
# vLLM's, for tests/integration/test_dynamo_indexer.py. Idempotent: quick when already there.
#
#   tests/integration/setup_dynamo.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=.venv-dynamo
SPEC="ai-dynamo-runtime==1.6.1"
STAMP="$VENV/.kvdepot-setup"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SPEC" ] && "$VENV/bin/python" -c "import dynamo.indexer" 2>/dev/null; then
  echo "setup_dynamo: $SPEC already in $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$SPEC"
"$VENV/bin/python" -c "import dynamo.indexer"
echo "$SPEC" > "$STAMP"
echo "setup_dynamo: $SPEC installed in $VENV"
