"""Delivery: outbox → providers → outcomes (see `facade` for how its parts fit)."""

from sigil_push.delivery.facade import Delivery

__all__ = ["Delivery"]
