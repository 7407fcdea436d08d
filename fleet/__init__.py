"""Fleet-level logic: pure code for the directory and the reference router (no I/O of its own)."""
