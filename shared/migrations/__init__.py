"""The cluster's schema and its migrations (docs/upgrades.md).

The schema is everything of the cluster a release depends on: its streams, buckets and object stores and
their configuration, subjects, the state keys' layout and what the messages mean. The recorded cluster
configuration (the state stream's metadata, ``shared/provisioning.py``) carries the schema number the cluster is
at. Each change to it ships as one migration, a module ``m<NNNN>_<name>.py`` of this package (``registry``
lists them, ``base`` is what one writes, ``runner`` applies the pending ones under a lease).

This package's ``__init__`` and ``registry`` import nothing of NATS: ``shared/provisioning.py`` reads the schema
number from ``registry`` to record it when it initialises a cluster.
"""
