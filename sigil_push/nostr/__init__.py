"""Nostr protocol values: events, keys and the NIPs the service speaks, one module per NIP."""
