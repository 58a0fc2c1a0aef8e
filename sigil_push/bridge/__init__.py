"""The relay bridge (see `facade` for how its parts fit, docs/bridge.md for what it does)."""

from sigil_push.bridge.facade import Bridge

__all__ = ["Bridge"]
