"""The engine's side of L2: which adapters are attached (tiers), writing committed chunks behind
to them (store controller) and loading missing chunks back into L1 (prefetch controller)."""
