"""Security of a Zattera cluster, enforced by NATS (SECURITY.md): nkeys and JWTs (``nkeyjwt``), the role
permission tables (``permissions``), the operator/accounts/signing keys (``authority``), credentials files
(``creds``), TLS material (``tls``), node join tokens and the join service (``join``), and what
``zattera up --secure`` prepares (``setup``)."""
