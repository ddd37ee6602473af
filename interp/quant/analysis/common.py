"""What the quantization-error analyses share: reading per-example errors in the shapes users pass them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from interp.errors import InterpError

ErrorsLike = pd.Series | pd.DataFrame


def error_series(errors: Any, ids: Sequence[str] | None = None) -> pd.Series:
    """One error per example: a Series as is, a DataFrame's mean over specs, or an array labelled by ``ids``.

    Example:
        >>> import pandas as pd
        >>> error_series(pd.DataFrame({"a": [1.0, 2.0], "b": [3.0, 4.0]}, index=["x", "y"])).tolist()
        [2.0, 3.0]
    """
    if isinstance(errors, pd.DataFrame):
        return errors.mean(axis=1).rename("mean")
    if isinstance(errors, pd.Series):
        return errors
    values = np.asarray(errors.detach().cpu() if hasattr(errors, "detach") else errors, dtype=np.float64)
    if ids is None or len(ids) != values.size:
        raise InterpError("Per-example errors given as an array need the example ids (same length).")
    return pd.Series(values, index=list(ids), name="error")
