"""Linear probes on captured activations, with held-out accuracy and a control task.

A linear probe asks whether a property (a label per prompt, or per token) can be read off a
component's activation by a linear map. Accuracy alone overstates it: a probe with enough
capacity can memorise labels of token *types* from the token's own embedding. Hewitt & Liang
(2019) therefore pair every probe with a **control task**: each token type gets a random label
(drawn once from the label distribution, seeded), and the same probe is trained on those.
*Selectivity* = accuracy - control accuracy: high when the activation encodes the property
beyond the token identity.

The probe is a ridge-regularised least-squares classifier, fitted in closed form in float64
(one ``d x d`` solve): targets ``+1`` for the class and ``-1`` otherwise, an unpenalised
intercept, the prediction the class of the largest score. It is deterministic and the same
objective as scikit-learn's ``RidgeClassifier``. The ridge weight is ``ridge`` times the mean
diagonal of the centred Gram matrix, so one value suits every layer's scale. Prompts (not
tokens) are split into train and test, so no prompt is on both sides.

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")
    >>> prompts = [f"{w} {i}" for i in range(8) for w in ("cat", "dog")]
    >>> res = interp.linear_probe(model, prompts, [p[:3] for p in prompts], layers=[1], position=1)
    >>> res.summary()[["layer", "accuracy"]].values.tolist()  # the first letter tells cat from dog
    [[1.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.data import aligned_rows, left_aligned, real_lengths
from interp.display import ResultDisplay
from interp.errors import ComponentError, DataError
from interp.localize.prompts import Prompts, as_examples
from interp.models import Model, model_name
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, device_of
from interp.runtime.capture import capture
from interp.validate import checked

DEFAULT_RIDGE = 1e-2


@dataclass(frozen=True)
class RidgeProbe(CheckedResult):
    """A fitted probe: ``scores = x @ weight + bias``, prediction ``classes[scores.argmax()]`` (finite: a probe fitted
    on NaN activations is refused, :mod:`interp.results`)."""

    weight: Float[Tensor, "d classes"]
    bias: Float[Tensor, " classes"]

    def predict(self, x: Tensor) -> Tensor:
        """The class index of each row of ``x`` ``[n, d]``."""
        return (x.double() @ self.weight + self.bias).argmax(dim=-1)


@checked
def fit_probe(x: Tensor, y: Tensor, n_classes: int, ridge: float = DEFAULT_RIDGE) -> RidgeProbe:
    """The closed-form ridge classifier on ``x [n, d]`` and class indices ``y [n]`` (float64).

    ``W = (Xc^T Xc + lam I)^-1 Xc^T Yc`` on centred data, ``b = mean(Y) - mean(X) W``, with ``Y``
    the ``+1/-1`` coding of ``y`` and ``lam = ridge * mean(diag(Xc^T Xc))``.

    Example:
        >>> import torch
        >>> x = torch.tensor([[0.0, 1.0], [0.1, 0.9], [1.0, 0.0], [0.9, 0.2]])
        >>> fit_probe(x, torch.tensor([0, 0, 1, 1]), 2).predict(x).tolist()
        [0, 0, 1, 1]
    """
    if (x.ndim != 2 or not x.is_floating_point() or y.ndim != 1 or len(y) != len(x) or y.is_floating_point()
            or y.dtype == torch.bool):
        raise DataError(f"fit_probe takes x [n, d] (floats) and y [n] (integer class indices); got x {list(x.shape)} "
                        f"({x.dtype}) and y {list(y.shape)} ({y.dtype}).")
    if n_classes < 2 or len(y) == 0 or bool(((y < 0) | (y >= n_classes)).any()):
        raise DataError(f"y must hold class indices in 0..{n_classes - 1} (n_classes >= 2), one per row of x.")
    if ridge < 0:
        raise DataError(f"ridge must be >= 0 (a weight on the penalty); got {ridge}.")
    x64 = x.double()
    targets = -torch.ones(len(y), n_classes, dtype=torch.float64, device=x.device)
    targets[torch.arange(len(y), device=x.device), y] = 1.0
    x_mean, y_mean = x64.mean(dim=0), targets.mean(dim=0)
    xc, yc = x64 - x_mean, targets - y_mean
    gram = xc.T @ xc
    lam = ridge * float(torch.diagonal(gram).mean()) if float(torch.diagonal(gram).mean()) > 0 else ridge
    gram.diagonal().add_(lam)
    try:
        weight = torch.linalg.solve(gram, xc.T @ yc)
    except torch.linalg.LinAlgError:
        raise DataError("The probe's normal equations are singular (the activations are constant or collinear and "
                        "ridge is 0): pass ridge > 0.") from None
    return RidgeProbe(weight=weight, bias=y_mean - x_mean @ weight)


@dataclass(frozen=True)
class LinearProbeResult(CheckedResult, ResultDisplay):
    """Held-out accuracy of a linear probe per layer, against its control task.

    Attributes:
        accuracy, control_accuracy, train_accuracy: ``[layers]`` fractions.
        majority: the held-out share of the most common training class (the trivial baseline).
        layers: the layers probed.
        classes: the labels, in the order of the probes' columns.
        probes: one :class:`RidgeProbe` per layer (the task's, not the control's).

    Made only finite (an accuracy over no held-out row is NaN, and refused): see :mod:`interp.results`.
    """

    accuracy: Tensor
    control_accuracy: Tensor
    train_accuracy: Tensor
    majority: float
    layers: list[int]
    classes: list[Any]
    probes: list[RidgeProbe]
    n_train: int
    n_test: int
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """One row per layer: held-out accuracy, control accuracy, selectivity, train accuracy."""
        return pd.DataFrame({"layer": self.layers, "accuracy": self.accuracy.numpy(),
                             "control accuracy": self.control_accuracy.numpy(),
                             "selectivity": (self.accuracy - self.control_accuracy).numpy(),
                             "train accuracy": self.train_accuracy.numpy(), "majority": self.majority})


def _features(model: Model, prompts: Prompts, labels: Any, component: str, layers: list[int], position: int,
              batch_size: int) -> tuple[dict[int, Tensor], list[Any], Tensor, Tensor]:
    """Per layer the probed activations ``[n, d]``, their labels, token ids (the control task's types),
    and the prompt each came from."""
    examples = as_examples(model, prompts)
    n, lengths = len(examples), real_lengths(examples)
    per_token = isinstance(labels, Tensor) and labels.ndim == 2
    if per_token:
        if tuple(labels.shape) != tuple(examples.tokens.shape):
            raise DataError(f"Per-token labels must be shaped like the token rows {tuple(examples.tokens.shape)}; "
                            f"got {tuple(labels.shape)}.")
        mask = examples.attention_mask if examples.attention_mask is not None else torch.ones_like(labels, dtype=bool)
        labels = left_aligned(labels, mask)[0]
    elif len(labels) != n:
        raise DataError(f"labels needs one label per prompt ({n}) or a per-token tensor [N, T]; got {len(labels)}.")
    rows = lengths + position if position < 0 else torch.full_like(lengths, position)
    if not per_token and bool(((rows < 0) | (rows >= lengths)).any()):
        raise DataError(f"position {position} is outside a prompt; count from the end (-1 is the last token).")
    feats: dict[int, list[Tensor]] = {layer: [] for layer in layers}
    kept_labels: list[Any] = []
    types, owner = [], []
    for start, end in batches(n, batch_size):
        tokens, _ = aligned_rows(examples, start, end, device_of(model))
        with torch.no_grad():
            store, _ = capture(model, tokens, [(component, layer) for layer in layers])
        # the probed positions are picked on the device; only they go to the host (for the float64 fit)
        if per_token:
            width = torch.arange(tokens.shape[1], device=lengths.device)
            keep = (labels[start:end] >= 0) & (width[None] < lengths[start:end, None])
            picked = keep.nonzero()
            kept_labels += labels[start:end][keep].tolist()
            owner.append(picked[:, 0] + start)
            at: tuple[Tensor, ...] = (keep.to(tokens.device),)
        else:
            index = torch.arange(end - start, device=rows.device)
            kept_labels += list(labels[start:end])
            owner.append(index + start)
            at = (index.to(tokens.device), rows[start:end].to(tokens.device))
        types.append(tokens[at].cpu())
        for layer in layers:
            x = store[(component, layer)]
            feats[layer].append(x[tuple(i.to(x.device) for i in at)].flatten(1).float().cpu())
    return {layer: torch.cat(x) for layer, x in feats.items()}, kept_labels, torch.cat(types), torch.cat(owner)


def _check_question(labels: Any, test_fraction: float) -> None:
    """Refuse a probing question with no answer before the model runs: float labels taken as classes, fewer than
    two classes, or too few prompts to hold any out."""
    if isinstance(labels, Tensor):
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool and labels.ndim == 2:
            raise DataError(f"labels are classes, but this tensor holds {labels.dtype} values: pass integer class "
                            "ids (-1 where a token has no label); a continuous target needs a regression.")
        values = [v for v in labels.flatten().tolist() if labels.ndim == 1 or v >= 0]
        n = int(labels.shape[0])
    else:
        values, n = list(labels), len(labels)
    floats = [v for v in values if isinstance(v, float) or type(v).__name__.startswith("float")]
    if floats:
        raise DataError(f"labels are classes, but {floats[0]!r} is a float, so every distinct value would be a class "
                        "of its own: pass ints, strings or bools (bin a continuous value first).")
    if any(not isinstance(v, Hashable) for v in values):
        bad = next(v for v in values if not isinstance(v, Hashable))
        raise DataError(f"labels must be hashable class names (ints, strings, bools); got {type(bad).__name__}.")
    if len(set(values)) < 2:
        raise DataError(f"A probe needs at least two distinct labels; got {sorted(set(values), key=str)}.")
    held = max(1, round(test_fraction * n))
    if held >= n:
        raise DataError(f"Too few prompts to hold some out: {n} prompt(s) with test_fraction={test_fraction} hold out "
                        f"{held}, leaving none to train on. Pass more prompts or a smaller test_fraction.")


def _control_labels(types: Tensor, y: Tensor, train: Tensor, n_classes: int, seed: int) -> Tensor:
    """Hewitt & Liang's control task: one label per token type, drawn from the training label distribution."""
    generator = torch.Generator().manual_seed(seed + 1)
    distribution = torch.bincount(y[train], minlength=n_classes).double()
    unique, inverse = torch.unique(types, return_inverse=True)
    drawn = torch.multinomial(distribution, len(unique), replacement=True, generator=generator)
    return drawn[inverse]


def _accuracy(probe: RidgeProbe, x: Tensor, y: Tensor) -> float:
    return float((probe.predict(x) == y).double().mean()) if len(y) else float("nan")


@checked
def linear_probe(
    model: Model,
    prompts: Prompts,
    labels: Sequence[Hashable] | Tensor,
    *,
    layers: Sequence[int] | None = None,
    component: str = "resid_post",
    position: int = -1,
    test_fraction: float = 0.25,
    ridge: float = DEFAULT_RIDGE,
    seed: int = 0,
    batch_size: int = 8,
) -> LinearProbeResult:
    """Train a linear probe per layer on ``component``'s activations; score it on held-out prompts and
    against a control task.

    Args:
        model: a bridge from :func:`interp.load_model`.
        prompts: strings, token rows or Examples.
        labels: one label per prompt (read at ``position``), or a per-token integer tensor shaped like
            the token rows (``-1`` where a token has no label).
        layers: the layers probed (default: all).
        component: a ``[batch, pos, ...]`` component (``resid_post``, ``resid_mid``, ``attn_out``, ``down``...).
        position: for per-prompt labels, where each prompt is read (negative: from its last real token).
        test_fraction: the share of prompts held out.
        ridge: the ridge weight, relative to the mean diagonal of the centred Gram matrix.
        seed: the split's and the control labels' seed.
        batch_size: prompts per forward.

    Returns:
        A :class:`~interp.localize.linear_probe.LinearProbeResult`.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> prompts = [f"{word} {end}" for word in ("red", "blue", "green", "gold") for end in ("cat", "dog")] * 2
        >>> labels = [p.endswith("cat") for p in prompts]
        >>> result = interp.linear_probe(model, prompts, labels, layers=[0, 1])
        >>> result.n_train, result.n_test, result.layers
        (12, 4, [0, 1])
        >>> list(result.table().columns)
        ['layer', 'accuracy', 'control accuracy', 'selectivity', 'train accuracy', 'majority']
    """
    if component == "pattern" or component not in hk.COMPONENTS:
        raise ComponentError(f"Cannot probe {component!r}: use a component of [batch, pos, ...] shape such as "
                             "resid_post, resid_mid, attn_out or down.")
    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must lie strictly between 0 and 1; got {test_fraction!r}.")
    chosen = hk.check_layers(model, layers)
    _check_question(labels, test_fraction)
    feats, raw, types, owner = _features(model, prompts, labels, component, chosen, position, batch_size)
    classes = sorted(set(raw), key=str)
    if len(classes) < 2:
        raise DataError(f"A probe needs at least two distinct labels; got {classes}.")
    y = torch.tensor([classes.index(v) for v in raw], dtype=torch.long)  # host: labels, beside the host features
    n_prompts = int(owner.max()) + 1
    order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed))  # host: seeded CPU draw
    held = set(order[: max(1, round(test_fraction * n_prompts))].tolist())
    test = torch.tensor([int(o) in held for o in owner], device=owner.device)
    train = ~test
    if not bool(train.any()) or not bool(test.any()):
        raise DataError("Too few prompts to hold some out: pass more prompts or another test_fraction.")
    control = _control_labels(types, y, train, len(classes), seed)
    accuracy, control_acc, train_acc, probes = [], [], [], []
    for layer in chosen:
        x = feats[layer]
        probe = fit_probe(x[train], y[train], len(classes), ridge)
        shadow = fit_probe(x[train], control[train], len(classes), ridge)
        probes.append(probe)
        accuracy.append(_accuracy(probe, x[test], y[test]))
        train_acc.append(_accuracy(probe, x[train], y[train]))
        control_acc.append(_accuracy(shadow, x[test], control[test]))
    majority = float((y[test] == torch.bincount(y[train]).argmax()).double().mean())
    settings = {"model": model_name(model), "component": component, "ridge": ridge, "seed": seed,
                "test_fraction": test_fraction, "per_token": isinstance(labels, Tensor) and labels.ndim == 2}
    # host: results, from each layer's Python floats
    held_out, control_held_out, on_train = (torch.tensor(v, dtype=torch.float64)
                                            for v in (accuracy, control_acc, train_acc))
    return LinearProbeResult(accuracy=held_out, control_accuracy=control_held_out, train_accuracy=on_train,
                             majority=majority,
                             layers=chosen, classes=classes, probes=probes, n_train=int(train.sum()),
                             n_test=int(test.sum()), settings=settings)
