"""The cluster state in memory, split by reason to change.

- :mod:`shared.state.store`: ``StateStore``, the pure indexed store (applies entries, answers reads).
- :mod:`shared.state.feed`: ``StateView``, the store kept in step with the ``zattera-state`` bucket
  (consumers, resync, catching up to a revision).
- :mod:`shared.state.reader`: ``StateReader``, the read-only protocol every pure decision takes.
- :mod:`shared.state.changes`: ``ChangeFeed``, coalesced change notifications.
"""
