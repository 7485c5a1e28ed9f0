"""Fault injection on a 3-node NATS JetStream cluster (issue 10): ``make chaos`` runs the long suite;
the short one (``test_short.py``) runs in ``make test``."""
