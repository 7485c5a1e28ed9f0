"""Zattera routes service."""
