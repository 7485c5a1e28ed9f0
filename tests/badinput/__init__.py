"""Bad input (issue 10 item 3): random bytes and absurd protobufs under every key and on every subject."""
