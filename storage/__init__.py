"""L2 storage: the adapter boundary, the registry of adapter types, the adapter families and the
blob codec. Knows nothing of engine/ or api/.

The core (what engine/ may use):
base           the L2 boundary: the L2Adapter protocol, its capabilities (pins, fleet ledger, key
               scan: `capabilities()`, None where an adapter lacks one), `shared`, the result values
               (OpResult, LoadResult, Usage, Health), BuildContext, key_salt
config         AdapterConfigBase: what every adapter config says of itself (redacted, local_paths,
               shared_location, transfer_threads); AdapterName
registry       ADAPTERS: adapter type -> (config class, builder), one line per type; AdapterConfig,
               their union discriminated by `type`; build_adapter(config, data_dir, keys)
auth           BlobKeys: the deployment's MAC keys (l2.auth_keys or <data_dir>/l2.key)
common         AdapterCore: batching contract, close-while-in-flight, health, stats, latency, usage
inflight       OpGate (operations in flight, ended by close), waits on executor work, Placed
health         HealthTracker (ok / degraded / down), LatencyRecorder (a histogram per operation)
holdings       what an adapter holds (key -> value, size) in recency order per tenant; reports
               every change to the accounting hook its owner binds (the tenant ledger)
codec/         blob = checked header + payload (optional FP8 values, lz4); decode_into checks all,
               verify_in_place checks a payload read straight into L1 (blob_header, fp8)

The families, one folder each (config.py, adapter.py with `build`, their own parts; the engine
never imports them, and none imports another):
disk/          local-disk adapter: crash-safe files, index rebuilt from headers at start
slab/          slab-file adapter: fixed slots in preallocated files or block devices, O_DIRECT
redis/         Redis/Valkey adapter (single node or Cluster): bulk lane, fleet ledger
mock/          in-memory adapter with capacity, simulated bandwidth/latency and fault injection
"""
