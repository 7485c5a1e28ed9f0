"""Volume snapshots, node side: deterministic tar (``tarstream.py``) → FastCDC chunks (``chunking.py``) →
SHA-256 names → zstd → optional AES-256-GCM, stored in the ``zattera-snapshots`` object store
(``shared/snapshots/store.py``) with dedup across all volumes; restore and a grace-period GC
(``engine.py``); and ``handlers.py``, the agent's NATS handler of snapshot, restore and prune requests. The
control side (records, dispatch to the volume's node, restore guards) is ``shared/snapshots/dispatch.py``.
"""
