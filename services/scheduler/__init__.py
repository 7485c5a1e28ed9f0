"""Zattera scheduler service."""
