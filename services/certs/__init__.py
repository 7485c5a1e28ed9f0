"""The certificate service: automatic HTTPS over ACME (docs/certificates.md)."""
