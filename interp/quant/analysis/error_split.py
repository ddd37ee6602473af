"""The setup the localisation analyses start from: per-example errors, D_large/D_ctrl, the quantized models.

:func:`error_split` is the one way to get them: the errors come from the resumable score
store (:func:`interp.quant.store.score`, ``NLL(quantized) - NLL(reference)`` per example),
or are given (a score folder's); D_large/D_ctrl are picked by :func:`~interp.quant.analysis.split.split_large_ctrl` from
the error of one spec or the mean over specs; and the quantized models come from the same
disk cache the scoring used, loaded when first asked for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from interp.data import Examples
from interp.errors import InterpError
from interp.models import Model
from interp.quant.analysis.split import SplitResult, split_large_ctrl
from interp.quant.apply import _cached_quant_info, _quantize_cached
from interp.quant.spec import MethodSpec, parse_spec
from interp.quant.store import ScoreStore, _score, _unique
from interp.runtime.swap import WeightStash
from interp.validate import checked


@dataclass
class ErrorSplit:
    """Per-example errors of quantized copies of ``reference``, the D_large/D_ctrl split, and the models.

    Attributes:
        reference: the full-precision model.
        errors: index example id (in the order of the examples), one column per canonical spec.
        split: D_large and D_ctrl (see :func:`~interp.quant.analysis.split.split_large_ctrl`).
        split_on: ``"mean"`` or the canonical spec whose error picked the split.
        calibration: the calibration examples (None when no spec needs them).
        cache_dir: the disk cache of quantized models (None: the user cache).
        batch_size: calibration examples per block forward when a model must be quantized.
    """

    reference: Model
    errors: pd.DataFrame
    split: SplitResult
    split_on: str
    calibration: Examples | None = None
    cache_dir: Path | None = None
    batch_size: int = 8
    progress: bool | None = None
    _models: dict[str, Any] = field(default_factory=dict, repr=False)

    def quant_info(self, spec: str | MethodSpec) -> Any:
        """``quantized(spec).quant_info``, read from the cache's record when the model is not loaded
        (a quantized SmolLM2 copy takes about a second to load; the record, a millisecond)."""
        parsed = parse_spec(spec)
        if str(parsed) not in self._models:
            info = _cached_quant_info(self.reference, parsed, self.calibration, cache_dir=self.cache_dir)
            if info is not None:
                return info
        return self._quantized(parsed).quant_info

    def weights(self, spec: str | MethodSpec, stash: WeightStash) -> Any:
        """One copy of the weights: ``spec``'s quantized block weights alone, as a
        :class:`~interp.quant.inplace.SavedWeights` of the cache folder :meth:`quantized` loads its
        copy from (quantized in place into ``stash`` first if it is missing). The analyses that take
        them swap them into the reference where a run needs them."""
        from interp.quant.inplace import SavedWeights, _cached_variant

        folder = _cached_variant(self.reference, parse_spec(spec), self.calibration, stash=stash,
                                 cache_dir=self.cache_dir, progress=self.progress, batch_size=self.batch_size)
        return SavedWeights(folder, self.reference)

    def quantized(self, spec: str | MethodSpec) -> Any:
        """The quantized copy for ``spec``: loaded from the cache (quantized there first if absent), kept."""
        return self._quantized(parse_spec(spec))

    def _quantized(self, spec: MethodSpec) -> Any:
        name = str(spec)
        if name not in self._models:
            self._models[name] = _quantize_cached(self.reference, spec, self.calibration, cache_dir=self.cache_dir,
                                                  progress=self.progress, batch_size=self.batch_size)
        return self._models[name]


@checked
def error_split(
    reference: Model,
    specs: Sequence[str | MethodSpec],
    examples: Examples,
    *,
    store: str | os.PathLike[str] | ScoreStore | None = None,
    errors: pd.DataFrame | None = None,
    calibration: Examples | None = None,
    split_on: str | MethodSpec = "mean",
    cache_dir: str | os.PathLike[str] | None = None,
    top: float = 0.10,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool | None = None,
) -> ErrorSplit:
    """Per-example errors of ``specs`` on ``examples``, D_large/D_ctrl, and access to the quantized models.

    Args:
        reference: the full-precision model.
        specs: method specs.
        examples: the evaluation examples.
        store: score into this store (a folder, a ``.sqlite`` file or an open store); finished
            batches are not scored again. Give ``store`` or ``errors``.
        errors: per-example errors already computed (index example id, one column per canonical
            spec, e.g. a score folder's); used as they are.
        calibration: calibration-split examples, needed when a spec is calibrated.
        split_on: the error that picks D_large: ``"mean"`` over the error columns, or one spec (text or parsed).
        cache_dir: the quantized models' cache (default: ``quantized/`` beside the store, as
            :func:`~interp.quant.store.score` uses; with ``errors``, the user cache).
        top, seed: passed to :func:`~interp.quant.analysis.split.split_large_ctrl`.
        batch_size: examples per forward.

    Example:
        >>> import pathlib, tempfile, torch
        >>> import interp
        >>> from interp.quant import error_split
        >>> model = interp.tiny_model("llama")
        >>> rows = torch.randint(0, 256, (20, 16), generator=torch.Generator().manual_seed(0))
        >>> ex = interp.Examples.from_tokens(rows)
        >>> setup = error_split(model, ["rtn:bits=3,group=32"], ex, store=pathlib.Path(tempfile.mkdtemp()),
        ...                     split_on="rtn:bits=3,group=32", top=0.2, progress=False)
        >>> setup.errors.shape, len(setup.split.large), setup.quantized("rtn:bits=3,group=32").quant_info.spec
        ((20, 1), 4, 'rtn:bits=3,group=32,zero=float')
    """
    if (store is None) == (errors is None):
        raise InterpError("error_split needs either a store to score into or the errors already computed, not both.")
    parsed = [parse_spec(s) for s in specs]  # the one parse of each: scored, named and cached as parsed
    names = [str(s) for s in parsed]
    cache = Path(cache_dir) if cache_dir is not None else None
    if errors is None:
        assert store is not None
        own = not isinstance(store, ScoreStore)
        st = store if isinstance(store, ScoreStore) else ScoreStore(store)
        try:
            errors = _score(reference, _unique(parsed), examples, store=st, calibration=calibration,
                            batch_size=batch_size, progress=progress, cache_dir=cache)
            cache = cache if cache is not None else st.folder / "quantized"
        finally:
            if own:
                st.close()
    missing = [name for name in names if name not in errors.columns]
    if missing:
        raise InterpError(f"The errors have no column for {', '.join(missing)}; scored: {', '.join(errors.columns)}.")
    if split_on == "mean":
        target = errors.mean(axis=1).rename("mean")
    else:
        split_on = str(parse_spec(split_on))
        if split_on not in errors.columns:
            raise InterpError(f"Spec {split_on} is not among the scored specs: {', '.join(errors.columns)}.")
        target = errors[split_on].rename(split_on)
    split = split_large_ctrl(target, examples, top=top, seed=seed)
    return ErrorSplit(reference=reference, errors=errors, split=split, split_on=split_on, calibration=calibration,
                      cache_dir=cache, batch_size=batch_size, progress=progress)
