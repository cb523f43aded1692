"""Seeing what flowed: trace (named shapes per attention call), capture (attention weights, statistics
and other intermediates, from any backend), head tables and detectors, and edit (change some heads and
see what happens)."""

from . import edits
from .capture import Capture, Record, capture
from .detect import detect
from .edit import Edit, edit
from .heads import HeadTable, head_table
from .retrieval import retrieval
from .stats import HeadStats, head_stats
from .trace import Trace, trace

__all__ = ["Trace", "trace", "Capture", "Record", "capture", "Edit", "edit", "edits", "HeadStats", "head_stats", "HeadTable",
           "head_table", "detect", "retrieval"]
