"""The variables torchrun sets, read strictly: :func:`world` (``(rank, local_rank, world_size)``).

A base module (no torch), so the command line can read them before it imports anything heavy.
"""

from __future__ import annotations

import os
import re

from interp.errors import InterpError

__all__ = ["TORCHRUN_VARIABLES", "variable", "world"]

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
_UNSET = "unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE to run as one process, or start the command with torchrun"


def variable(name: str) -> int | None:
    """A torchrun variable as a whole number >= 0, None when unset; an empty or other value is refused."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    if not re.fullmatch(r"[0-9]{1,18}", raw.strip()):
        raise InterpError(f"The environment variable {name}={raw!r} is not a whole number >= 0, as torchrun sets it: "
                          f"{_UNSET}.")
    return int(raw.strip())


def world() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from the variables torchrun sets (``(0, 0, 1)`` without).

    torchrun sets ``RANK`` and ``WORLD_SIZE`` together (and ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); an empty or
    non-numeric value, one of the pair without the other, or a rank outside the world is an
    :class:`~interp.errors.InterpError` saying so, not a silent rank 0 of 1.

    Example:
        >>> import os
        >>> os.environ.update(RANK="1", WORLD_SIZE="")
        >>> world()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        interp.errors.InterpError: The environment variable WORLD_SIZE='' is not a whole number >= 0, ...
        >>> for name in ("RANK", "WORLD_SIZE"):
        ...     del os.environ[name]
        >>> world()
        (0, 0, 1)
    """
    rank, local, size, local_size = (variable(name) for name in TORCHRUN_VARIABLES)
    if rank is None and size is None and local is None:
        return 0, 0, 1
    if rank is None or size is None:
        given = ", ".join(f"{n}={os.environ[n]}" for n in TORCHRUN_VARIABLES if n in os.environ)
        missing = " and ".join(n for n, v in (("RANK", rank), ("WORLD_SIZE", size)) if v is None)
        raise InterpError(f"Only some of torchrun's variables are set ({given}; {missing} missing): torchrun sets "
                          f"RANK and WORLD_SIZE together. {_UNSET[0].upper()}{_UNSET[1:]}.")
    local = 0 if local is None else local
    if size < 1 or rank >= size or (local_size is not None and not local < local_size <= size):
        raise InterpError(f"torchrun's variables disagree: RANK={rank}, LOCAL_RANK={local}, WORLD_SIZE={size}, "
                          f"LOCAL_WORLD_SIZE={local_size}; a rank lies below the world size. {_UNSET[0].upper()}"
                          f"{_UNSET[1:]}.")
    return rank, local, size
