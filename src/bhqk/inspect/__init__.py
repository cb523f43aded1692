"""Seeing what flowed: trace (named shapes per attention call), capture (attention weights and other
intermediates, from any backend) and head statistics."""

from .capture import Capture, Record, capture
from .detect import detect
from .heads import HeadTable, head_table
from .stats import HeadStats, head_stats
from .trace import Trace, trace

__all__ = ["Trace", "trace", "Capture", "Record", "capture", "HeadStats", "head_stats", "HeadTable", "head_table",
           "detect"]
