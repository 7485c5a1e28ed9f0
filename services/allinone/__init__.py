"""Every control-plane service in one process, for a single machine (``zattera up``'s default)."""
