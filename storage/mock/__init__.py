"""The mock family: an in-memory L2 with capacity, simulated bandwidth/latency and fault injection,
for tests and benchmarks of everything above storage/.

config    MockAdapterConfig (type "mock")
adapter   MockAdapter and `build` (the registry's builder: storage/registry.py)
Capabilities (storage/base.py): none. Not shared.
"""
