"""sigil-push: private, self-hostable push notifications for Nostr direct messages."""

__version__ = "0.1.0"
