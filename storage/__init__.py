"""L2 storage adapters and the blob codec. Knows nothing of engine/ or api/.

config         each adapter's config model and AdapterConfig, their union (app/settings composes them)
codec          blob = checked header + payload (optional FP8 values, lz4); decode_into checks all,
               verify_in_place checks a payload read straight into L1
blob_header    the blob header's layout: pack, parse, header_size, fits_in_place
fp8            the codec's FP8 (e4m3) quantization of V runs
base           the L2Adapter protocol and its result values (OpResult, LoadResult, Usage, Health)
common         AdapterCore: batching contract, close-while-in-flight, health, stats, latency, usage
inflight       OpGate (operations in flight, ended by close) and waits on executor work
health         HealthTracker: ok / degraded / down
holdings       what an adapter holds (key -> value, size) in recency order per tenant; reports
               every change to the accounting hook its owner binds (the tenant ledger)
disk           local-disk adapter: crash-safe files, index rebuilt from headers at start
diskio         its blob files: atomic writes, reads (buffered or O_DIRECT), removal
diskdirs       its directories: layout, the lock, the scan at start
slab           slab-file adapter: fixed slots in preallocated files or block devices, O_DIRECT
slabformat     its superblock and slot header: pack, parse, check
slabfile       one slab file's blocking I/O: open/format/refuse, scan, slot reads and writes
slabslots      its free/read/written slots, and the per-slot work of its executor threads
slabindex      its index checkpoint (atomic), the merge with the scan at start, the schedule
redis_adapter  Redis/Valkey adapter: pipelined single-key commands, timeouts, reconnects
redis_lane     its bulk lane: large values over blocking sockets in its executor, into L1 in place
redis_read     how the lane reads one value: one GET, or GETRANGE pieces in a sliding window
resp           the lane's RESP2 wire protocol over one blocking socket
redis_fleet    the fleet ledger in Redis: tenants' usage and quotas (scripts: redis_fleet_lua),
               quotas sealed with the deployment's key (fleet_quota)
mock           in-memory adapter with capacity, simulated bandwidth/latency and fault injection
factory        build_adapter(config, data_dir): one adapter with the executor it needs
"""
