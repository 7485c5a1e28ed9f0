"""Zattera orchestrator service."""
