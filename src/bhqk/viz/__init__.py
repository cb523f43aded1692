"""Pictures and pages of attention: heatmaps, the layers × heads grid and mask drawings (matplotlib,
the optional ``viz`` extra, imported only when a picture is drawn), one self-contained interactive HTML
page, an export to bertviz, and pictures of attention statistics at any length (``overview_png``,
``received_png``, ``head_png``: see :mod:`bhqk.viz.stats_page`)."""

from .cli import show
from .export import to_bertviz
from .heatmap import grid, heatmap, mask
from .html import html
from .stats_page import head_png, head_series, overview_png, received_peaks, received_png

__all__ = ["heatmap", "grid", "mask", "html", "to_bertviz", "show", "overview_png", "received_png", "received_peaks",
           "head_png", "head_series"]
