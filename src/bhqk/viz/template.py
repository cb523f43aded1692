"""The pages' HTML, CSS and JS live as package data under ``viz/assets/``; this fills them in.

A page template is an ``.html`` file with ``string.Template`` placeholders (``$title``, ``$css``,
``$js``, ``$data``, …); the values are inserted as they are, in one pass, so a ``$`` inside the
CSS, JS or data is never read as a placeholder.
"""

from __future__ import annotations

import string
from functools import cache
from importlib import resources


@cache
def asset(name: str) -> str:
    """The text of ``viz/assets/<name>`` (read once per process)."""
    return resources.files(__package__).joinpath("assets").joinpath(name).read_text(encoding="utf-8")  # one part each: 3.10


def fill(template: str, **values: str) -> str:
    """``viz/assets/<template>`` with each ``$name`` replaced by ``values[name]`` (all must be given)."""
    return string.Template(asset(template)).substitute(values)


def script_json(text: str) -> str:
    """JSON text made safe inside ``<script>``: no ``</`` can end the element early."""
    return text.replace("</", "<\\/")
