"""Code that two or more Zattera services use: state view, fenced writes, leases, clock, NATS plumbing."""
