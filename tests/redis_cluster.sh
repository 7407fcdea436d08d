#!/usr/bin/env bash
# Starts a 3-node Redis Cluster on 127.0.0.1:7101-7103 (no replicas, no persistence) when none of
# its nodes answers; waits until `cluster info` says ok. Idempotent: a cluster already up is left
# alone. Called by tests/run.sh and by the integration tests' `redis_cluster` fixture.
# Environment: KVDEPOT_CLUSTER_DIR (where nodes-P.conf and logs go; default a fresh temp dir).
set -euo pipefail
PORTS=(7101 7102 7103)

answers() { redis-cli -h 127.0.0.1 -p "$1" ping >/dev/null 2>&1; }
healthy() { redis-cli -h 127.0.0.1 -p "${PORTS[0]}" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }

any=0
for p in "${PORTS[@]}"; do
  if answers "$p"; then any=1; fi
done
if [ "$any" = 0 ]; then
  dir="${KVDEPOT_CLUSTER_DIR:-$(mktemp -d /tmp/kvdepot-cluster.XXXXXX)}"
  mkdir -p "$dir"
  for p in "${PORTS[@]}"; do
    rm -f "$dir/nodes-$p.conf"
    redis-server --port "$p" --cluster-enabled yes --cluster-config-file "$dir/nodes-$p.conf" \
      --daemonize yes --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
      --logfile "$dir/redis-$p.log" --cluster-require-full-coverage no
  done
  for _ in $(seq 100); do
    up=1
    for p in "${PORTS[@]}"; do answers "$p" || up=0; done
    [ "$up" = 1 ] && break
    sleep 0.1
  done
  redis-cli --cluster create 127.0.0.1:7101 127.0.0.1:7102 127.0.0.1:7103 \
    --cluster-replicas 0 --cluster-yes >/dev/null
fi
for _ in $(seq 300); do
  if healthy; then exit 0; fi
  sleep 0.1
done
echo "redis cluster on ${PORTS[*]} did not become ok" >&2
exit 1
