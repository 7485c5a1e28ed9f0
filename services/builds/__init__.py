"""Zattera builds service."""
