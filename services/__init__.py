"""Zattera services: one folder per service, each runnable as ``python -m services.<name>``."""
