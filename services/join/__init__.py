"""The join service: exchanges single-use join tokens for node credentials (see shared/security/join.py)."""
