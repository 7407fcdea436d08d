"""The disk family: local-disk L2, one crash-safe file per blob, the index rebuilt at start.

config    DiskAdapterConfig (type "disk")
adapter   DiskAdapter and `build` (the registry's builder: storage/registry.py)
files     its blob files: atomic writes, reads (buffered or O_DIRECT), removal
dirs      its directories: layout, the lock, the scan at start
Capabilities (storage/base.py): pins. Not shared.
"""
