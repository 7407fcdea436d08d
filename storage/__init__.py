"""L2 storage adapters and the blob codec. Knows nothing of engine/ or api/."""
