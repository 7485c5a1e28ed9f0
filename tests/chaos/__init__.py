"""Fault injection on a 3-node NATS JetStream cluster: ``make chaos`` runs the long suite;
the short one (``test_short.py``) runs in ``make test``."""
