"""Exceptions raised by smp."""

from __future__ import annotations

__all__ = ["ConfigError", "SMPError", "NotInitializedError"]


class SMPError(RuntimeError):
    """Base class of every error smp raises on purpose."""


class ConfigError(SMPError, ValueError):
    """A configuration key is unknown, has the wrong type or an impossible value.

    Raised by :func:`smp.init` on every rank *before* any communication, so a bad
    configuration never leaves some ranks waiting for the others.
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"smp config key {key!r}: {message}")


class NotInitializedError(SMPError):
    """An smp function that needs the runtime was called before :func:`smp.init`."""
