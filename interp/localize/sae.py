"""Sparse autoencoders (SAEs): a residual stream read as a sparse sum of learned directions.

An SAE maps an activation ``x`` (``d_in`` numbers) to ``d_sae`` latents, most of them zero, and
back: ``z = act(W_enc^T (x - b_dec) + b_enc)``, ``x_hat = W_dec^T z + b_dec``. Each latent ``j``
writes along one decoder direction (row ``j`` of ``W_dec``); a latent that fires on a
recognisable set of tokens is a *feature*. How well the SAE reads the model is measured by
what it loses: the fraction of variance it leaves unexplained (FVU), how many latents fire per
token (L0), how many never fire (dead), and how much of the model's next-token loss survives
when its reconstruction replaces the activation (:mod:`interp.localize.sae_metrics`).

Three activations are read, by their SAELens names:

- ``"topk"`` (Gao et al. 2024, arXiv 2406.04093): the ``k`` largest pre-activations of each
  position are kept (then ReLU), every other latent is zero, so L0 <= k by construction. interp
  trains this kind (:func:`interp.localize.sae_train.train_sae`);
- ``"jumprelu"``: a pre-activation is kept where it exceeds its latent's ``threshold``;
- ``"standard"``: ReLU.

**Files.** :meth:`SparseAutoencoder.save` writes SAELens's layout: a folder holding ``cfg.json``
and ``sae_weights.safetensors`` with tensors ``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_in]``,
``b_enc [d_sae]``, ``b_dec [d_in]`` (and ``threshold [d_sae]`` for JumpReLU), readable by
SAELens's ``SAE.load_from_disk``. :func:`load_sae` reads such a folder, whoever wrote it, and
refuses a config or tensors it cannot read exactly.

**The input scale.** interp trains on ``c x`` with ``c = sqrt(d_in / mean ||x||^2)`` (one
constant per layer), so that the learning rate means the same at every layer, and decodes
``(W_dec^T z + b_dec) / c``. The saved tensors have ``c`` folded in (``W_enc c``, ``W_dec / c``,
``b_dec / c``), which gives the same latents and reconstruction on the raw activation with no
scale at all: the files are plain SAELens SAEs, exact for any reader, and the object read back
is the one saved, bit for bit. ``scale`` records ``c``; :attr:`SparseAutoencoder.directions`
gives the unit-norm decoder directions of the scaled space.

Example:
    >>> import torch, tempfile
    >>> from interp.localize.sae import TopKSAE, load_sae
    >>> g = torch.Generator().manual_seed(0)
    >>> W_dec = torch.nn.functional.normalize(torch.randn(16, 8, generator=g), dim=1)
    >>> sae = TopKSAE(W_enc=W_dec.T.clone(), b_enc=torch.zeros(16), W_dec=W_dec, b_dec=torch.zeros(8), k=3,
    ...               hook_name="blocks.0.hook_resid_post")
    >>> x = torch.randn(5, 8, generator=g)
    >>> z = sae.encode(x)
    >>> tuple(z.shape), int((z != 0).sum(dim=1).max()) <= 3
    ((5, 16), True)
    >>> folder = tempfile.mkdtemp() + "/sae"
    >>> back = load_sae(sae.save(folder))
    >>> bool(torch.equal(back.decode(back.encode(x)), sae.decode(sae.encode(x))))
    True
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from jaxtyping import Float, Int64
from torch import Tensor

from interp.errors import ComponentError, DataError, NonFiniteError
from interp.io import check_complete, staged_folder, write_json, write_safetensors
from interp.reading import JSON_LIMIT, read_json, regular_file
from interp.runtime import hooks as hk
from interp.schema import conform

__all__ = ["ARCHITECTURES", "JumpReLUSAE", "ReLUSAE", "SparseAutoencoder", "TopKSAE", "load_sae", "sae_site"]

SAE_KIND = "sparse-autoencoder"  # the kind of interp output folder a saved SAE is
CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
WEIGHTS_LIMIT = 16 << 30  # 16 GiB: a 1M-latent SAE on a 4096-wide stream in float32 is 32 GiB, none is read here


@dataclass(frozen=True, eq=False, kw_only=True)
class SparseAutoencoder:
    """An SAE's tensors (SAELens names and shapes) and what it reads; one subclass per activation.

    Attributes:
        W_enc: ``[d_in, d_sae]``.
        b_enc: ``[d_sae]``.
        W_dec: ``[d_sae, d_in]``: row ``j`` is latent ``j``'s decoder direction (norm ``1 / scale``
            for interp's SAEs, see the module docstring).
        b_dec: ``[d_in]``.
        hook_name: the hook point read, as SAELens names it (``blocks.5.hook_resid_post``).
        scale: the input scale ``c`` the SAE was trained at, already folded into the tensors
            (1 for an SAE trained on raw activations).
        apply_b_dec_to_input: whether ``b_dec`` is subtracted before encoding (SAELens's flag;
            true for interp's SAEs, false for some published ones).
        settings: how it was made (model, rows, training settings and log); saved in ``cfg.json``.
    """

    architecture: ClassVar[str] = ""
    W_enc: Float[Tensor, "d_in d_sae"]
    b_enc: Float[Tensor, " d_sae"]
    W_dec: Float[Tensor, "d_sae d_in"]
    b_dec: Float[Tensor, " d_in"]
    hook_name: str = ""
    scale: float = 1.0
    apply_b_dec_to_input: bool = True
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d_in, d_sae = self.d_in, self.d_sae
        shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,),
                  **self._extra_shapes()}
        for name, shape in shapes.items():
            value = getattr(self, name)
            if not isinstance(value, Tensor) or tuple(value.shape) != shape or not value.is_floating_point():
                got = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise DataError(f"An SAE's {name} must be a float tensor of shape {list(shape)} (d_in {d_in}, "
                                f"d_sae {d_sae}); got {got}.")
            if not value.is_contiguous():  # as a loaded SAE's are: a saved SAE then computes bit-identically
                object.__setattr__(self, name, value.contiguous())  # after loading (matmul kernels follow strides)
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise DataError(f"An SAE's input scale must be a positive number; got {self.scale!r}.")

    def _extra_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0]) if self.W_enc.ndim == 2 else -1

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1]) if self.W_enc.ndim == 2 else -1

    @property
    def directions(self) -> Float[Tensor, "d_sae d_in"]:
        """The decoder rows times ``scale``: unit norm for an SAE interp trained."""
        return self.W_dec * self.scale

    def pre_activations(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_sae"]:
        """``W_enc^T (x - b_dec) + b_enc`` (``b_dec`` left out when ``apply_b_dec_to_input`` is false)."""
        x = x.to(self.W_enc.dtype)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return torch.addmm(self.b_enc, x.reshape(-1, self.d_in), self.W_enc).reshape(*x.shape[:-1], self.d_sae)

    def activation(self, pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        raise NotImplementedError

    def encode(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_sae"]:
        """The latents ``z`` of ``x``, dense (zeros where a latent does not fire)."""
        return self.activation(self.pre_activations(x))

    def decode(self, z: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_in"]:
        """The reconstruction ``W_dec^T z + b_dec``."""
        z = z.to(self.W_dec.dtype)
        return torch.addmm(self.b_dec, z.reshape(-1, self.d_sae), self.W_dec).reshape(*z.shape[:-1], self.d_in)

    def reconstruct(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_in"]:
        return self.decode(self.encode(x))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> SparseAutoencoder:
        """A copy with every tensor on ``device`` / in ``dtype`` (the same object when nothing changes)."""
        moved: dict[str, Any] = {name: value.to(device=device, dtype=dtype) for name, value in self._tensors().items()}
        if all(moved[name] is value for name, value in self._tensors().items()):
            return self
        return replace(self, **moved)

    def _tensors(self) -> dict[str, Tensor]:
        return {"W_enc": self.W_enc, "W_dec": self.W_dec, "b_enc": self.b_enc, "b_dec": self.b_dec}

    def _cfg(self) -> dict[str, Any]:
        """SAELens's config keys (those every SAELens version reads), then interp's own under ``"interp"``."""
        layer = _layer_of(self.hook_name)
        model = self.settings.get("model")
        return {"architecture": self.architecture, "d_in": self.d_in, "d_sae": self.d_sae,
                "dtype": str(self.W_enc.dtype).removeprefix("torch."), "device": "cpu",
                "hook_name": self.hook_name, "hook_layer": layer, "hook_head_index": None,
                "apply_b_dec_to_input": self.apply_b_dec_to_input, "normalize_activations": "none",
                "finetuning_scaling_factor": False, "activation_fn_str": self._activation_name(),
                "model_name": model if isinstance(model, str) else None,
                "context_size": self.settings.get("context_size"), "prepend_bos": True,
                "interp": {"input_scale": float(self.scale), "scale_folded": True,
                           "settings": dict(self.settings)}}

    def _activation_name(self) -> str:
        return "relu"

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the SAE in SAELens's layout into ``folder`` (an interp output: built beside it, renamed in).

        Returns:
            The folder. The tensors are written as they are (float32 on the host), so :func:`load_sae` gives back
            identical tensors.
        """
        tensors = {name: value.detach().to("cpu").contiguous() for name, value in self._tensors().items()}
        with staged_folder(folder, SAE_KIND) as tmp:
            write_json(tmp / CFG_FILE, self._cfg())
            write_safetensors(tmp / WEIGHTS_FILE, tensors)
        return Path(folder)


@dataclass(frozen=True, eq=False, kw_only=True)
class TopKSAE(SparseAutoencoder):
    """``z = ReLU(TopK_k(pre))``: the ``k`` largest pre-activations of each position, then ReLU.

    Attributes:
        k: latents kept per position (L0 <= k; fewer where a kept pre-activation is negative).
    """

    architecture: ClassVar[str] = "topk"
    k: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= self.d_sae:
            raise DataError(f"A TopK SAE's k must be an integer in 1..d_sae ({self.d_sae}); got {self.k!r}.")

    def encode_sparse(self, x: Float[Tensor, "... d_in"]) -> tuple[Float[Tensor, "... k"], Int64[Tensor, "... k"]]:
        """The ``k`` kept latents of each position: their values (after ReLU) and indices (ascending)."""
        values, indices = self.pre_activations(x).topk(self.k, dim=-1, sorted=False)
        indices, order = indices.sort(dim=-1)
        return values.gather(-1, order).clamp_min(0), indices

    def decode_sparse(self, values: Float[Tensor, "... k"], indices: Int64[Tensor, "... k"]
                      ) -> Float[Tensor, "... d_in"]:
        """:meth:`decode` of the latents given as ``(values, indices)``, reading only those decoder rows."""
        flat = torch.nn.functional.embedding_bag(indices.reshape(-1, indices.shape[-1]), self.W_dec,
                                                 per_sample_weights=values.reshape(-1, values.shape[-1])
                                                 .to(self.W_dec.dtype), mode="sum")
        return (flat + self.b_dec).reshape(*values.shape[:-1], self.d_in)

    def activation(self, pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        values, indices = pre.topk(self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, indices, values.clamp_min(0))

    def _activation_name(self) -> str:
        return "topk"

    def _cfg(self) -> dict[str, Any]:
        # "k" is SAELens 6's key, activation_fn_kwargs the key of earlier versions
        return {**super()._cfg(), "k": self.k, "activation_fn_kwargs": {"k": self.k}}


@dataclass(frozen=True, eq=False, kw_only=True)
class JumpReLUSAE(SparseAutoencoder):
    """``z = pre * (pre > threshold)``, one threshold per latent (SAELens's ``jumprelu``)."""

    architecture: ClassVar[str] = "jumprelu"
    # host: an empty placeholder default; a loaded or built SAE replaces it with its own tensor
    threshold: Float[Tensor, " d_sae"] = field(default_factory=lambda: torch.zeros(0))

    def _extra_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"threshold": (self.d_sae,)}

    def activation(self, pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        return pre * (pre > self.threshold.to(pre.dtype))

    def _tensors(self) -> dict[str, Tensor]:
        return {**super()._tensors(), "threshold": self.threshold}


@dataclass(frozen=True, eq=False, kw_only=True)
class ReLUSAE(SparseAutoencoder):
    """``z = ReLU(pre)`` (SAELens's ``standard`` architecture)."""

    architecture: ClassVar[str] = "standard"

    def activation(self, pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        return pre.clamp_min(0)


ARCHITECTURES: dict[str, type[SparseAutoencoder]] = {cls.architecture: cls for cls in (TopKSAE, JumpReLUSAE, ReLUSAE)}
"""SAELens architecture name -> the class that reads it."""


def _layer_of(hook_name: str) -> int | None:
    match = re.fullmatch(r"blocks\.(\d+)\..+", hook_name)
    return int(match.group(1)) if match else None


def sae_site(model: Any, sae: SparseAutoencoder) -> tuple[str, int]:
    """The ``(component, layer)`` of ``model`` whose hook point the SAE reads (its ``hook_name``).

    Raises:
        ComponentError: the hook name is no ``d_model``-wide hook point of interp's (``blocks.L.hook_resid_post``,
            ``hook_resid_pre``, ``hook_resid_mid``, ``hook_attn_out``, ``hook_mlp_out``), the model has no such
            layer, or the SAE's width is not the model's.
    """
    layer = _layer_of(sae.hook_name)
    found = [name for name, rec in hk.COMPONENT_RECORDS.items()
             if rec.width == "d_model" and layer is not None and rec.hook.format(layer=layer) == sae.hook_name]
    if not found or layer is None:
        wide = ", ".join(rec.hook.format(layer="L") for rec in hk.COMPONENT_RECORDS.values() if rec.width == "d_model")
        raise ComponentError(f"This SAE reads {sae.hook_name!r}, which is not a hook point interp can read or "
                             f"replace: SAEs on {wide} are supported.")
    component = found[0]
    hk.hook_point(model, component, layer)  # the model has that layer and component
    if sae.d_in != int(model.cfg.d_model):
        raise ComponentError(f"This SAE reads {sae.d_in}-wide activations; the model's residual stream is "
                             f"{int(model.cfg.d_model)} wide: it was trained on another model.")
    return component, layer


# ---------------------------------------------------------------------------------------
# Reading an SAELens folder

_SCHEMA = {"d_in": "int", "d_sae": "int", "architecture": "str", "apply_b_dec_to_input": "bool",
           "normalize_activations": "str | bool | None", "hook_name": "str", "hook_point": "str", "k": "int",
           "activation_fn_kwargs": "dict | None", "activation_fn_str": "str | None", "activation_fn": "str | None",
           "interp": "dict", "metadata": "dict", "meta": "dict"}
_REQUIRED = ("d_in", "d_sae")


def _read_cfg(folder: Path) -> dict[str, Any]:
    path = folder / CFG_FILE
    record = read_json(regular_file(path, "an SAE's config"), "an SAE's config", limit=JSON_LIMIT)
    return conform(record, _SCHEMA, f"{path} (an SAE's config)",
                   optional=tuple(k for k in _SCHEMA if k not in _REQUIRED))


def _hook_name(cfg: Mapping[str, Any], where: Path) -> str:
    meta = cfg.get("metadata") or cfg.get("meta") or {}
    for value in (cfg.get("hook_name"), cfg.get("hook_point"), meta.get("hook_name")):
        if isinstance(value, str) and value:
            return value
    raise DataError(f"{where}: the config names no hook point (hook_name): it is not an SAELens SAE config.")


def _architecture(cfg: Mapping[str, Any], where: Path) -> str:
    name = cfg.get("architecture", "standard")  # SAELens's default for configs that predate the key
    activation = cfg.get("activation_fn_str") or cfg.get("activation_fn")
    if name == "standard" and activation == "topk":  # how SAELens 3-5 wrote TopK SAEs
        name = "topk"
    if name not in ARCHITECTURES:
        raise DataError(f"{where}: architecture {name!r} is not one interp reads; it reads "
                        f"{', '.join(repr(a) for a in ARCHITECTURES)}.")
    if name == "standard" and activation not in (None, "relu"):
        raise DataError(f"{where}: a standard SAE with activation {activation!r}; interp reads ReLU and TopK ones.")
    scaling = cfg.get("normalize_activations")
    if scaling not in (None, "none", False):  # SAELens before 4 wrote false for none, true for a scale
        raise DataError(f"{where}: normalize_activations is {scaling!r}; interp reads SAEs that take the raw "
                        "activation (\"none\"). Fold the normalisation into the weights first.")
    return name


def _k(cfg: Mapping[str, Any], where: Path) -> int:
    kwargs = cfg.get("activation_fn_kwargs") or {}
    k = cfg.get("k", kwargs.get("k"))
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg["d_sae"]:
        raise DataError(f"{where}: a TopK SAE's config needs k (or activation_fn_kwargs.k), an integer in 1..d_sae "
                        f"({cfg['d_sae']}); got {k!r}.")
    return k


def _read_tensors(folder: Path, names: tuple[str, ...]) -> dict[str, Tensor]:
    from interp.io import read_safetensors

    path = regular_file(folder / WEIGHTS_FILE, "an SAE's weights")
    if path.stat().st_size > WEIGHTS_LIMIT:
        raise DataError(f"{path} is {path.stat().st_size >> 20} MiB, larger than any SAE interp reads "
                        f"({WEIGHTS_LIMIT >> 30} GiB).")
    tensors = read_safetensors(path, "SAE weights")
    if "log_threshold" in tensors and "threshold" in names and "threshold" not in tensors:
        tensors["threshold"] = tensors.pop("log_threshold").double().exp()  # SAELens's training layout
    ones = tensors.get("scaling_factor")
    if ones is not None and bool((ones == 1).all()):
        del tensors["scaling_factor"]  # SAELens 3-5 wrote a unit finetuning scale into some files
    missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    if missing or extra:
        raise DataError(f"{path} must hold exactly {', '.join(names)}; missing {missing or 'none'}, unexpected "
                        f"{extra or 'none'}. It is not an SAE of this architecture.")
    for name, value in tensors.items():
        if not value.is_floating_point():
            raise DataError(f"{path}: {name} holds {value.dtype} values; an SAE's tensors are floating point.")
        if not bool(value.isfinite().all()):
            raise NonFiniteError(f"{path}: {name} holds NaN or inf; the SAE is damaged. Train or download it again.")
    return {name: value if value.dtype == torch.float64 else value.float() for name, value in tensors.items()}


def load_sae(folder: str | os.PathLike[str]) -> SparseAutoencoder:
    """Read an SAE saved in SAELens's layout (``cfg.json`` + ``sae_weights.safetensors``) from ``folder``.

    Reads ``"topk"``, ``"jumprelu"`` and ``"standard"`` (ReLU) SAEs, whether interp or SAELens (any
    version) wrote them; tensors come back as float32 (float64 kept) on the host.

    Raises:
        DataError: the folder lacks either file, or an interp run left it incomplete; the config is not a JSON
            object with integer ``d_in``/``d_sae`` and a hook name; the architecture or an activation
            normalisation is one interp does not read; a tensor is missing, unexpected or of the wrong shape.
        NonFiniteError: a tensor holds NaN or inf.
    """
    where = check_complete(Path(folder), "SAE")
    if not where.is_dir():
        raise DataError(f"An SAE is read from a folder holding {CFG_FILE} and {WEIGHTS_FILE}; {folder} is not a "
                        "folder.")
    cfg = _read_cfg(where)
    name = _architecture(cfg, where)
    cls = ARCHITECTURES[name]
    # host: a 1 x 1 placeholder SAE, only to list the tensor names the architecture stores
    tensors = _read_tensors(where, tuple(cls(W_enc=torch.zeros(1, 1), b_enc=torch.zeros(1), W_dec=torch.zeros(1, 1),
                                              b_dec=torch.zeros(1),  # host: the placeholder's last tensor
                                              **_placeholder(name))._tensors()))
    extra: dict[str, Any] = {"k": _k(cfg, where)} if name == "topk" else {}
    ours = cfg.get("interp") or {}
    scale = ours.get("input_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise DataError(f"{where}: interp.input_scale must be a positive number; got {scale!r}.")
    shapes = {n: list(v.shape) for n, v in tensors.items()}
    if tensors["W_enc"].ndim != 2 or list(tensors["W_enc"].shape) != [cfg["d_in"], cfg["d_sae"]]:
        raise DataError(f"{where}: the config says d_in {cfg['d_in']}, d_sae {cfg['d_sae']}, but the tensors are "
                        f"{shapes}.")
    settings: dict[str, Any] = ours["settings"] if isinstance(ours.get("settings"), dict) else {}
    try:
        return cls(**tensors, hook_name=_hook_name(cfg, where), scale=float(scale),
                   apply_b_dec_to_input=cfg.get("apply_b_dec_to_input", True), settings=settings, **extra)
    except DataError as exc:
        raise DataError(f"{where}: {exc} The tensors are {shapes}.") from None


def _placeholder(name: str) -> dict[str, Any]:
    """Arguments that make a 1 x 1 SAE of architecture ``name`` (to list the tensors its files hold)."""
    # host: a placeholder that lists tensor names only
    return {"k": 1} if name == "topk" else {"threshold": torch.zeros(1)} if name == "jumprelu" else {}
