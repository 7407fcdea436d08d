"""The Redis family: Redis or Valkey (one node or a Cluster) as an L2 shared by many sidecars.

config       RedisAdapterConfig (type "redis"): its URL redacted in answers, its shared location
adapter      RedisAdapter and `build` (the registry's builder: storage/registry.py): pipelined
             single-key commands, timeouts, reconnects
router       which node serves a key (single Redis or Cluster: MOVED/ASK), a pool per node
cluster      Cluster routing's pure logic: seed URLs, the slot map, redirections
lane         the bulk lane: large values over blocking sockets in the adapter's executor, into L1
read         how the lane reads one value: one GET, or GETRANGE pieces in a sliding window
resp         the lane's RESP2 wire protocol over one blocking socket
scan         SCAN of a prefix on every node at a bounded rate
fleet        the fleet ledger: tenants' usage and quotas kept in Redis (scripts: fleet_lua),
             quotas sealed with the deployment's key (fleet_quota)
Capabilities (storage/base.py): fleet (scope "fleet"), scan. Shared. No pins (Redis evicts by its
own policy). redis-py is imported by the adapter modules only, when a Redis tier is built.
"""
