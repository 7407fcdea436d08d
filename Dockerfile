# kvdepot sidecar image: run next to the inference engine, sharing the data directory (the
# data-plane and lifeline sockets). The L1 arena is a sealed memfd handed to clients over their
# lifelines: /dev/shm need not be shared; give the container memory for it.
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 kvdepot
WORKDIR /opt/kvdepot
COPY pyproject.toml README.md ./
COPY app ./app
COPY api ./api
COPY engine ./engine
COPY storage ./storage
COPY gpu ./gpu
COPY fleet ./fleet
COPY httpkit ./httpkit
# The benchmarks (`kvdepot bench ...`): a package of their own, which the sidecar never imports.
COPY bench ./bench
COPY connector ./connector
# The same install step as the README (CPU torch wheel pinned in pyproject.toml): the sidecar and
# the connector distribution it depends on (its wire protocol and layout arithmetic).
RUN python -m pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu ./connector . \
 && mkdir -p /data && chown kvdepot /data

USER kvdepot
ENV KVDEPOT_LOGGING__FORMAT=json
# The control plane listens on every interface, so it needs an admin token: generated into the data
# volume at first start (mode 0600; the log names the file, never the token). Give your own with
# KVDEPOT_HTTP__ADMIN_TOKEN (it takes precedence) or by placing the file before the first start.
ENV KVDEPOT_HTTP__ADMIN_TOKEN_FILE=/data/admin-token
VOLUME ["/data"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8080/health || exit 1
ENTRYPOINT ["kvdepot", "serve", "--http-host", "0.0.0.0", "--data-dir", "/data"]
