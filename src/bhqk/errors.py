"""The library's error types. A user's mistake is a ValueError subclass that names what is wrong."""


class ShapeError(ValueError):
    """A tensor's shape does not fit the named sizes bound so far (B, H, Hkv, Q, K, d, dv, D)."""


class MaskError(ValueError):
    """A mask or bias cannot be used as given: wrong dtype, does not broadcast, ambiguous alignment."""


class BackendError(ValueError):
    """A backend was asked for a call it cannot take; the message says why (see ``why_not``)."""


class LoadError(ValueError):
    """A checkpoint does not fit the model: missing, unexpected or mis-shaped keys, unknown architecture."""


class MisuseWarning(UserWarning):
    """A call that runs but very likely means something else: a mask in ``nn.MultiheadAttention``
    polarity (True = masked out), a sequence-first module fed batch-first input. Silence one kind with
    ``warnings.filterwarnings("ignore", category=bhqk.errors.MisuseWarning)``."""


class PerformanceHint(UserWarning):
    """A call that runs right but could run much faster, and how (said once per process and kind):
    e.g. ``auto`` running the tiled backend on a GPU where FlexAttention was never measured."""


def warn_misuse(message: str) -> None:
    """Warn with MisuseWarning, attributed to the first caller outside bhqk (the user's line)."""
    warn_user(message, MisuseWarning)


def warn_user(message: str, category: type[Warning]) -> None:
    """Warn with ``category``, attributed to the first caller outside bhqk (the user's line)."""
    import sys
    import warnings
    from types import FrameType

    level = 3  # stacklevel 3 = the caller of the function that called warn_user
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "bhqk":
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
