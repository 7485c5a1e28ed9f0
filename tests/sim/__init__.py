"""Simulated agents at scale (issue 10 item 4)."""
