"""Seeing what flowed: trace (named shapes per attention call)."""

from .trace import Trace, trace

__all__ = ["Trace", "trace"]
