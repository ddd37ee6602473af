"""Analyses of per-example quantization error (arXiv 2506.12044, sections 1-4 of the spec).

Each analysis is a function that returns a frozen result with ``to_frame()`` (a table) and
``to_dict()`` (JSON-safe numbers); :func:`interp.figures.draw` draws any of them (the
builders are in :mod:`interp.figures.quant`).

1. :func:`agreement` (:mod:`~interp.quant.analysis.agreement`): do different quantizers
   break the same inputs? Pearson and Spearman matrices of the per-example error vectors,
   with bootstrap intervals, and the Jaccard overlap of their top-10% sets against chance.
2. :func:`split_large_ctrl` (:mod:`~interp.quant.analysis.split`): D_large (top 10% by
   error, near-duplicates removed by 5-gram Jaccard on token ids) and D_ctrl (as many,
   sampled from the bottom half, seeded).
3. :func:`norm_error_correlation` (:mod:`~interp.quant.analysis.norms`): per layer, the
   Pearson correlation across examples between the mean residual norm (``resid_mid`` and
   ``resid_post``; BOS excluded) of the *reference* model and the error.
4. :func:`reversal` (:mod:`~interp.quant.analysis.reversal`): per layer, ``||r||`` against
   ``||h|| = ||RMSNorm2(r)||`` for D_large vs D_ctrl, the MLP-output error and its
   correlation with ``||h||``, the kurtosis of ``r``, and the outlier dimensions' gammas.

:func:`error_split` is the setup the localisation analyses share: per-example errors
(scored into the resumable store, or given), D_large/D_ctrl from one spec's error or the
mean, and the quantized models. :func:`run_all` runs all four analyses on a folder written
by ``interp score`` (used by ``interp errors``).
"""

from __future__ import annotations

from interp.quant.analysis.agreement import AgreementResult, agreement
from interp.quant.analysis.common import ErrorsLike, error_series
from interp.quant.analysis.error_split import ErrorSplit, error_split
from interp.quant.analysis.folder import FolderAnalyses, run_all
from interp.quant.analysis.norms import NormCorrelationResult, norm_error_correlation
from interp.quant.analysis.reversal import ReversalResult, reversal
from interp.quant.analysis.split import SplitResult, split_large_ctrl

__all__ = ["AgreementResult", "ErrorSplit", "ErrorsLike", "FolderAnalyses", "NormCorrelationResult",
           "ReversalResult", "SplitResult", "agreement", "error_series", "error_split", "norm_error_correlation",
           "reversal", "run_all", "split_large_ctrl"]
