"""Zattera scheduler service: what runs where.

``convergence`` (per-env replica decisions, with the placement rules of ``shared/placement/``) ·
``volumes`` (stateful volumes and fencing leases) · ``orphans`` · ``drain`` · ``loop`` (the placement
loop, ``lease.scheduler``) · ``liveness`` (``lease.liveness``) · ``snapshots`` (scheduled volume
snapshots, dispatched through ``shared/snapshots/dispatch.py``).
"""
