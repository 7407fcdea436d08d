"""The L1 tier: a shared-memory arena, its allocator, object lifecycles, eviction."""
