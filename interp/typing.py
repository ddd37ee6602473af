"""Tensor type aliases shared across interp, so signatures read like prose."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jaxtyping import Float, Int64
from torch import Tensor

if TYPE_CHECKING:  # for the annotation only: interp.models imports this module
    from interp.models import ModelInfo

Tokens = Int64[Tensor, "batch pos"]
Pattern = Float[Tensor, "... query key"]
PerQuery = Float[Tensor, "... query"]
Resid = Float[Tensor, "batch pos d_model"]
Weight = Float[Tensor, "d_out d_in"]
PerExample = Float[Tensor, " n_examples"]
TokenNLL = Float[Tensor, "batch predicted"]
Key = tuple[str, int]  # an activation site: (component, layer)


@runtime_checkable
class Model(Protocol):
    """The model handle the analyses take: what :func:`interp.load_model` and :func:`interp.tiny_model`
    return (a transformer-lens bridge around the Hugging Face model, with its
    :class:`~interp.models.ModelInfo`).

    ``info`` is mandatory: an analysis reads the model's layout and name from it.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> isinstance(model, Model), model.info.n_layers
        (True, 2)
        >>> isinstance(model.original_model, Model)  # the plain Hugging Face model has no info
        False
    """

    info: ModelInfo
    cfg: Any  # the bridge's config: n_layers, n_heads, d_model, ...
    tokenizer: Any
    original_model: Any  # the wrapped Hugging Face model

    def hooks(self, *args: Any, **kwargs: Any) -> Any:
        """A context manager that attaches forward hooks for its duration."""
        ...

    def __getattr__(self, name: str) -> Any:
        """The rest of the bridge (``blocks``, ``run_with_hooks``, ``unembed``, ...), untyped as transformer-lens is."""
        ...
