"""Zattera autoscale service."""
