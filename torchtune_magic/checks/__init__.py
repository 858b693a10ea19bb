"""The tuning-guide checks and their registry; running them on an observation (`detecting`)
and writing their findings' code changes (`cellchanges`)."""

from . import registry
from .base import Check, Detection

__all__ = ["Check", "Detection", "registry"]
