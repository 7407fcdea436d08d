"""The slab family: slab-file L2, fixed slots in preallocated files or raw block devices, O_DIRECT.

config    SlabAdapterConfig (type "slab")
adapter   SlabAdapter and `build` (the registry's builder: storage/registry.py)
headers   its superblock and slot header: pack, parse, check
file      one slab file's blocking I/O: open/format/refuse, scan, slot reads and writes
slots     its free/read/written slots, and the per-slot work of its executor threads
index     its index checkpoint (atomic), the merge with the scan at start, the schedule
Capabilities (storage/base.py): none (no pins: eviction does not consult them). Not shared.
"""
