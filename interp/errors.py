"""Errors raised by interp.

Every error a user can trigger through bad input is an :class:`InterpError` (or a subclass),
with a message that says what was wrong and how to fix it. Library tracebacks are caught at
the boundary and re-raised in these words.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class InterpError(ValueError):
    """Bad input or an unsupported request, explained in interp's own words."""


class ModelLoadError(InterpError):
    """A model could not be found, converted or loaded."""


class DataError(InterpError):
    """A text source is missing, empty, malformed, or too small for the request."""


class ComponentError(InterpError):
    """A component name, layer index or hook point does not exist on this model."""


class SpecError(InterpError):
    """A quantization method spec is malformed or unsupported."""


class NonFiniteError(InterpError):
    """NaN or inf appeared in weights or activations."""


class ResourceError(InterpError):
    """A request would exceed available memory or disk, or an output path is unusable."""


class ToolError(InterpError):
    """An external tool interp runs (llama.cpp's ``llama-quantize``, ``llama-perplexity``) is missing or failed."""


def exit_status(body: Callable[[], object]) -> int:
    """Run a module command's ``body`` (``python -m interp....``): 0 when it finishes; on an
    :class:`InterpError`, the message as ``error: ...`` on stderr and 2, never a traceback. The one place the
    module commands turn a user's mistake into an exit status (``interp``'s own CLI has its own, with labels)."""
    try:
        body()
    except InterpError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
