"""Zattera scheduler service: what runs where.

``placement`` (Place, pure) · ``replicas`` (pure rules shared with the orchestrator) · ``convergence``
(per-env replica decisions) · ``volumes`` (stateful volumes and fencing leases) · ``orphans`` ·
``drain`` · ``loop`` (the placement loop, ``lease.scheduler``) · ``liveness`` (``lease.liveness``) ·
``snapshots`` (scheduled volume snapshots).
"""
