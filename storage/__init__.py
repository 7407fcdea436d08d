"""L2 storage adapters and the blob codec. Knows nothing of engine/ or api/.

codec          blob = checked header + payload (optional FP8 values, lz4); decode_into checks all
base           the L2Adapter protocol and its result values (OpResult, LoadResult, Usage, Health)
common         AdapterCore: batching contract, close-while-in-flight, health, stats, latency
disk, diskio   local-disk adapter: crash-safe files, index rebuilt from headers at start
redis_adapter  Redis/Valkey adapter: pipelined single-key commands, timeouts, reconnects
mock           in-memory adapter with capacity, simulated bandwidth/latency and fault injection
factory        build_adapter(config, data_dir): one adapter with the executor it needs
"""
