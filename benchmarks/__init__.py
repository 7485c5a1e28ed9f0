"""Benchmarks: one file per figure (`make bench`)."""
