"""The secrets service: holds the cluster secrets key, answers agents, rotates the key (docs/secrets.md)."""
