"""The node agent (``python -m services.agent``): see ``agent.py``."""
