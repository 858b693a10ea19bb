"""The tuning-guide checks and their registry."""

from . import registry
from .base import Check, Detection

__all__ = ["Check", "Detection", "registry"]
