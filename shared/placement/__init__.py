"""Placement rules shared by the scheduler and the orchestrator (pure: a view in, decisions out).

``placement`` (``place``: which nodes get new replicas, and the per-region index behind it) ·
``replicas`` (new assignments, desired counts, which replicas a deploy starts) · ``platforms``
(os/arch matching of images and nodes).
"""
