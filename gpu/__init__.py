"""Device abstraction and transfers (CUDA, or a CPU stub that runs the same paths)."""
