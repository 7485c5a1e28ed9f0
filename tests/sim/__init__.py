"""Simulated agents at scale."""
