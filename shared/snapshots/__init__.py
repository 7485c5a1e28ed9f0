"""Volume snapshots, control side and storage: the dispatcher (``dispatch.py``: records, dispatch to the
volume's node, restore guards), the object store layout (``store.py``, sealed with ``crypto.py``) and the
per-volume lock (``locking.py``). The snapshot engine the agent runs is ``services/agent/snapshots/``.
"""
