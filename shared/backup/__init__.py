"""Backups of a cluster (docs/backup.md): what a backup holds and where it goes.

``manifest.py`` is the pure description of one backup (its objects and their SHA-256, the schema and
version it was taken at, the state revision); ``recovery.py`` seals the cluster secrets key to a recovery
passphrase (Argon2id, PyNaCl); ``targets.py`` stores objects in a local directory or an S3-compatible
object store; ``cluster.py`` reads a cluster's contents at one point and writes them back; ``retention.py``
keeps the newest verified backups of a target; ``status.py`` says what the scheduled backups last did;
``sealed.py`` seals a target's settings to the cluster key; ``offsite.py`` copies volume snapshots to a
target and fetches them back. The
operator actions are in :mod:`shared.actions.backup` (create, list, verify),
:mod:`shared.actions.backup_restore` (restore) and :mod:`shared.actions.backup_schedule`.
"""
