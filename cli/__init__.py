"""The ``zattera`` command: the operator interface."""
