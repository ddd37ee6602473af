"""SAOBP as a transformers attention implementation, for training small llama-style models.

transformers dispatches attention through a registry (``AttentionInterface``): a model built
with ``attn_implementation="saobp"`` calls :func:`saobp_attention_forward` in every layer.
That function computes the usual scaled dot-product pattern ``A = softmax(QK^T/sqrt(d) + mask)``
and, on the layers chosen in :class:`SAOBPConfig`, replaces it by the SAOBP refinement
``B = saobp(A, beta)`` (see :mod:`interp.attention.saobp`) before mixing the values. Other
layers run transformers' own eager attention, so with ``beta = 0`` an SAOBP model computes
exactly what the eager baseline computes.

The settings travel with the model:

* each attention module gets a ``saobp_config`` attribute (the :class:`SAOBPConfig`), and
  the model config a ``saobp`` dict, written to ``config.json`` by ``save_pretrained``;
* a learnable beta is a per-head ``nn.Parameter`` ``saobp_beta_raw`` on each refined
  attention module, so it is trained, and saved in the state dict, with the model. The
  beta used is ``softplus(saobp_beta_raw)``, which is never negative.

Example:
    >>> from interp.attention.trainable import SAOBPConfig, build_llama, saobp_betas
    >>> tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    >>> model = build_llama(tiny, SAOBPConfig(layers=[1], beta=0.5, learnable=True), seed=0)
    >>> saobp_betas(model)[1]
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from einops import rearrange
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface
from transformers.models.llama.modeling_llama import eager_attention_forward, repeat_kv

from interp.attention.saobp import MODES, Mode, saobp
from interp.errors import InterpError
from interp.validate import checked, checked_class

ATTN_IMPLEMENTATION = "saobp"
BETA_PARAM = "saobp_beta_raw"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SAOBPConfig",
    "build_llama",
    "capture_prior_patterns",
    "register_saobp_attention",
    "saobp_attention_forward",
    "saobp_betas",
]


@checked_class
@dataclass
class SAOBPConfig:
    """Where and how SAOBP refines attention in a trained model.

    Attributes:
        layers: layer indices to refine; None refines every layer.
        mode: ``"first_order"`` (one extra matmul, the training fast path) or ``"exact"``.
        beta: the fixed beta, or the initial value of a learnable one (then ``> 0``).
        learnable: learn one beta per query head, as ``softplus(raw)``.
        chunk: exact mode only: queries per chunk (None picks one from a memory budget).

    Example:
        >>> from interp.attention import SAOBPConfig
        >>> cfg = SAOBPConfig(layers=[1], beta=2.0, learnable=False)
        >>> cfg.applies_to(0), cfg.applies_to(1), cfg.mode
        (False, True, 'first_order')
    """

    layers: list[int] | None = None
    mode: Mode = "first_order"
    beta: float = 1.0
    learnable: bool = True
    chunk: int | None = None
    _layer_set: frozenset[int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InterpError(f"SAOBPConfig.mode must be one of {', '.join(MODES)}, got {self.mode!r}.")
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta >= 0:
            raise InterpError(f"SAOBPConfig.beta must be a float >= 0, got {self.beta!r}.")
        if self.learnable and self.beta <= 0:
            raise InterpError(
                "A learnable beta is softplus(raw) and cannot start at exactly 0 (raw would be -inf and "
                "never move); start it small instead, e.g. SAOBPConfig(beta=0.05, learnable=True)."
            )
        if self.layers is not None:
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers):
                raise InterpError(f"SAOBPConfig.layers must be non-negative layer indices, got {self.layers!r}.")
            self._layer_set = frozenset(self.layers)

    def applies_to(self, layer_idx: int) -> bool:
        """Whether SAOBP refines attention in layer ``layer_idx``."""
        return self._layer_set is None or layer_idx in self._layer_set

    def to_dict(self) -> dict[str, Any]:
        """Plain settings, JSON-ready."""
        settings = asdict(self)
        settings.pop("_layer_set")
        return settings


def _inverse_softplus(value: float) -> float:
    # softplus(x) = log(1 + e^x), so x = log(e^value - 1); for large values x ~ value.
    return value if value > 20 else math.log(math.expm1(value))


def module_beta(module: Any, settings: SAOBPConfig) -> float | torch.Tensor:
    """The beta a refined attention module uses now: a float, or ``softplus(raw)`` per head."""
    raw = getattr(module, BETA_PARAM, None)
    return settings.beta if raw is None else nn.functional.softplus(raw)


@checked
def saobp_attention_forward(
    module: Any,  # a transformers attention module (layer_idx, num_key_value_groups, ...)
    query: torch.Tensor,  # [batch, head, query, d_head]
    key: torch.Tensor,  # [batch, kv_head, key, d_head]
    value: torch.Tensor,  # [batch, kv_head, key, d_head]
    attention_mask: torch.Tensor | None,  # [batch, 1, query, key], additive (0 / most negative)
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with the SAOBP-refined pattern, in transformers' attention-function signature.

    Layers that SAOBP does not cover (or modules without a ``saobp_config``) fall through to
    transformers' ``eager_attention_forward`` unchanged.

    Returns:
        ``(attn_output [batch, query, head, d_head], pattern [batch, head, query, key])``; the
        pattern returned (and seen with ``output_attentions=True``) is the refined one.

    Example:
        A layer that SAOBP does not cover gets transformers' eager attention, unchanged:

        >>> import torch
        >>> from interp.attention import SAOBPConfig, build_llama, saobp_attention_forward
        >>> sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...              num_attention_heads=2)
        >>> model = build_llama(sizes, SAOBPConfig(layers=[1], beta=2.0), seed=0)
        >>> q, k, v = torch.randn(3, 1, 2, 5, 16, generator=torch.Generator().manual_seed(0))
        >>> out, pattern = saobp_attention_forward(model.model.layers[1].self_attn, q, k, v, None, scaling=0.25)
        >>> tuple(out.shape), tuple(pattern.shape), bool(torch.allclose(pattern.sum(-1), torch.ones(1, 2, 5)))
        ((1, 5, 2, 16), (1, 2, 5, 5), True)
    """
    settings: SAOBPConfig | None = getattr(module, "saobp_config", None)
    if settings is None or not settings.applies_to(module.layer_idx):
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    keys = repeat_kv(key, module.num_key_value_groups)
    values = repeat_kv(value, module.num_key_value_groups)
    scores = (query @ keys.transpose(-1, -2)) * scaling  # [batch, head, query, key]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    # softmax in float32 at least (as eager attention does), and in float64 for a float64 model, whose
    # rows must then sum to 1 to float64 precision for saobp's check
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    prior = torch.softmax(scores, dim=-1, dtype=work).to(query.dtype)
    captured = getattr(module, "saobp_capture", None)
    if captured is not None:
        captured.append(prior.detach())
    refined = saobp(
        prior,
        module_beta(module, settings),
        mode=settings.mode,
        chunk=settings.chunk,
        scores=scores if settings.mode == "first_order" else None,
    )
    mixed = nn.functional.dropout(refined, p=dropout, training=module.training) @ values
    return rearrange(mixed, "b h q d -> b q h d").contiguous(), refined


def register_saobp_attention() -> None:
    """Register ``"saobp"`` with transformers' attention and mask registries (idempotent).

    The mask registry maps ``"saobp"`` to the eager (additive float) mask, the form
    :func:`saobp_attention_forward` expects.

    Example:
        >>> from transformers import AttentionInterface
        >>> from interp.attention import register_saobp_attention, saobp_attention_forward
        >>> register_saobp_attention()  # already done on import; calling it again is harmless
        >>> AttentionInterface()["saobp"] is saobp_attention_forward
        True
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, saobp_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)


def attach_saobp(model: LlamaForCausalLM, settings: SAOBPConfig) -> None:
    """Give each attention module of ``model`` the SAOBP settings (and a learnable beta)."""
    layers = model.model.layers
    unknown = sorted(set(settings.layers or ()) - set(range(len(layers))))
    if unknown:
        raise InterpError(
            f"SAOBPConfig.layers {unknown} do not exist: the model has {len(layers)} layers (0..{len(layers) - 1})."
        )
    model.config.saobp = settings.to_dict()
    for layer in layers:
        attention = layer.self_attn
        attention.saobp_config = settings
        if settings.learnable and settings.applies_to(attention.layer_idx):
            n_heads = model.config.num_attention_heads
            raw = torch.full((n_heads,), _inverse_softplus(settings.beta), dtype=torch.float32,
                             device=attention.q_proj.weight.device)
            attention.register_parameter(BETA_PARAM, nn.Parameter(raw))


@checked
def build_llama(
    config_kwargs: dict[str, Any], saobp: SAOBPConfig | None = None, seed: int | None = None
) -> LlamaForCausalLM:
    """Build a randomly initialised ``LlamaForCausalLM``, with SAOBP attention or eager attention.

    Args:
        config_kwargs: keyword arguments for ``transformers.LlamaConfig`` (sizes, vocab, ...).
            ``attn_implementation`` is set here and must not be passed.
        saobp: SAOBP settings, or None for the standard eager-attention baseline.
        seed: if given, ``torch.manual_seed(seed)`` right before initialisation, so a
            baseline and an SAOBP model built with the same seed share every weight.

    Returns:
        The model in train mode. A learnable beta adds one ``saobp_beta_raw`` parameter of
        shape ``[n_heads]`` per refined layer, after the standard initialisation (it draws no
        random numbers, so the other weights match the baseline's).

    Example:
        >>> import torch
        >>> from interp.attention import SAOBPConfig, build_llama
        >>> sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...              num_attention_heads=2)
        >>> model = build_llama(sizes, SAOBPConfig(layers=[1], beta=2.0), seed=0)
        >>> model.config._attn_implementation, tuple(model(torch.randint(0, 64, (1, 8))).logits.shape)
        ('saobp', (1, 8, 64))
    """
    if "attn_implementation" in config_kwargs:
        raise InterpError("Do not pass attn_implementation; choose it with saobp=SAOBPConfig(...) or saobp=None.")
    register_saobp_attention()
    implementation = "eager" if saobp is None else ATTN_IMPLEMENTATION
    try:
        config = LlamaConfig(**config_kwargs, attn_implementation=implementation)  # type: ignore[call-arg]
    except (TypeError, ValueError, StrictDataclassError) as exc:
        raise InterpError(f"Invalid LlamaConfig settings {config_kwargs}: {exc}") from None
    if seed is not None:
        torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if saobp is not None:
        attach_saobp(model, saobp)
    return model.train()


def _refined_modules(model: nn.Module) -> list[Any]:
    """The attention modules of ``model`` that SAOBP refines."""
    refined = []
    for module in model.modules():
        settings: Any = getattr(module, "saobp_config", None)
        if settings is not None and settings.applies_to(getattr(module, "layer_idx", -1)):
            refined.append(module)
    return refined


@checked
@contextmanager
def capture_prior_patterns(model: nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Record the unrefined pattern ``A`` of every refined layer during forward passes.

    Yields ``{layer: [pattern [batch, head, query, key], ...]}``, one entry per forward pass;
    ``output_attentions=True`` returns the refined pattern ``B`` instead.

    Example:
        >>> tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...             num_attention_heads=4, num_key_value_heads=4)
        >>> model = build_llama(tiny, SAOBPConfig(beta=1.0), seed=0)
        >>> with capture_prior_patterns(model) as priors:
        ...     _ = model(torch.zeros(1, 5, dtype=torch.long))
        >>> priors[0][0].shape
        torch.Size([1, 4, 5, 5])
    """
    refined = _refined_modules(model)
    captured: dict[int, list[torch.Tensor]] = {module.layer_idx: [] for module in refined}
    for module in refined:
        module.saobp_capture = captured[module.layer_idx]
    try:
        yield captured
    finally:
        for module in refined:
            module.saobp_capture = None


@checked
def saobp_betas(model: nn.Module) -> dict[int, torch.Tensor]:
    """The beta each refined layer uses now, ``{layer: [n_heads]}`` (detached; empty for a baseline).

    Example:
        >>> from interp.attention import SAOBPConfig, build_llama, saobp_betas
        >>> sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...              num_attention_heads=2)
        >>> betas = saobp_betas(build_llama(sizes, SAOBPConfig(layers=[1], beta=2.0), seed=0))
        >>> {layer: [round(float(b), 4) for b in beta] for layer, beta in betas.items()}
        {1: [2.0, 2.0]}
    """
    betas: dict[int, torch.Tensor] = {}
    for module in _refined_modules(model):
        beta = module_beta(module, module.saobp_config)
        n_heads = module.config.num_attention_heads
        betas[module.layer_idx] = (
            beta.detach().clone() if isinstance(beta, torch.Tensor)
            else torch.full((n_heads,), float(beta), device=next(module.parameters()).device)
        )
    return betas


register_saobp_attention()
