"""kvdepot engine: keys, the L1 tier, controllers, quotas and events. All mutable cache state lives
here and is owned by the event loop; api/ calls the `CacheEngine` facade, never the parts."""
