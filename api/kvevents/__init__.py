"""KV events in vLLM's wire format: the publisher (an EventBus subscriber), its wire structs, the
block-hash scheme, and the inventory a consumer resyncs from."""
