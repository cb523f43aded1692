"""Seeing what flowed: trace (named shapes per attention call), capture (attention weights and other
intermediates, from any backend), head statistics, and edit (change some heads and see what happens)."""

from .capture import Capture, Record, capture
from .edit import Edit, edit
from .stats import HeadStats, head_stats
from .trace import Trace, trace

__all__ = ["Trace", "trace", "Capture", "Record", "capture", "Edit", "edit", "HeadStats", "head_stats"]
