"""Managed databases (docs/addons.md): what an add-on's environment is made of, as pure functions."""
