"""Relay connections and subscriptions: one websocket per relay, shared by all keys."""
