"""Pictures and pages of attention: heatmaps, the layers × heads grid and mask drawings (matplotlib,
the optional ``viz`` extra, imported only when a picture is drawn), one self-contained interactive HTML
page, and an export to bertviz."""

from .export import to_bertviz
from .heatmap import grid, heatmap, mask
from .html import html

__all__ = ["heatmap", "grid", "mask", "html", "to_bertviz", "show"]


def show(sentence: str, out_dir, **kw):
    """Capture a sentence's attention with the bundled MiniLM and write PNGs and the HTML page
    (see :func:`bhqk.viz.cli.show`)."""
    from .cli import show as _show

    return _show(sentence, out_dir, **kw)
