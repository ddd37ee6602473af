"""Rounding bounds the tests' tolerances are derived from (one definition for every test file)."""

from __future__ import annotations

from typing import Any

import torch

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps
U_BF16 = torch.finfo(torch.bfloat16).eps / 2  # unit roundoff of bfloat16: 2**-8


def rounding_tol(n_terms: Any, scale: Any, eps: float) -> Any:
    """Largest gap, from rounding alone, between two evaluations of one quantity.

    An evaluation that chains ``n_terms`` roundings (each addend of a sum, each product or
    quotient; a libm/SLEEF ``log`` or ``exp``, good to 1 ulp, counts as two) of values whose
    magnitudes add up to at most ``scale`` is within ``n_terms * (eps / 2) * scale`` of the exact
    value, to first order and for any summation order (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., 2002, sections 3.1 and 4.2). Two evaluations are within twice
    that: ``n_terms * eps * scale``. Works elementwise on tensors.
    """
    return n_terms * eps * scale
