"""Bad input: random bytes and absurd protobufs under every key and on every subject."""
