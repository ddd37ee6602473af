"""llama.cpp's importance matrix from interp's probes: per linear weight, the sum of squared inputs per channel.

``llama-quantize --imatrix FILE`` weighs each weight's rounding error by how large its input
channel runs: for the weight ``W`` ``[d_out, d_in]`` of a block linear layer, the importance of
input channel ``c`` is ``sum over tokens x of x_c^2`` (with the token count beside it, so the
mean ``E[x_c^2]`` is ``in_sum2 / counts``). It is the diagonal of the GPTQ Hessian ``X Xᵀ``.

:func:`importance_matrix` collects it with forward hooks on the inputs of every block linear
weight (q, k and v share one input, as do gate and up), over every position of every example,
as llama.cpp's ``llama-imatrix`` does over every position of its chunks. :func:`write_imatrix`
writes the GGUF file ``llama-imatrix`` writes (``general.type = imatrix``,
``imatrix.datasets``, ``imatrix.chunk_count``, ``imatrix.chunk_size``, and per weight
``<name>.in_sum2`` and ``<name>.counts`` in float32, names sorted), and :func:`read_imatrix`
reads that file back (llama.cpp's own too). tests/test_imatrix.py checks interp's matrix
against one ``llama-imatrix`` computed on the same tokens of the bundled SmolLM2.

Example:
    >>> import torch
    >>> import interp
    >>> from interp.quant.imatrix import importance_matrix
    >>> model = interp.tiny_model("llama")
    >>> rows = interp.Examples.from_tokens(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)))
    >>> m = importance_matrix(model, rows, batch_size=2, progress=False)
    >>> m.tokens, sorted(m.sums)[0], m.sums["blk.0.attn_q.weight"].shape
    (64, 'blk.0.attn_k.weight', (64,))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from interp.data import Examples, refuse_padding
from interp.errors import SpecError
from interp.models import Model
from interp.quant.llama_cpp import TENSOR_ROLES, gguf_name
from interp.quant.sensitivity import INPUT_GROUPS
from interp.results import CheckedResult, check_values
from interp.runtime import hooks
from interp.runtime.batching import batches, check_examples, show_progress
from interp.validate import checked

__all__ = ["ImportanceMatrix", "importance_matrix", "read_imatrix", "write_imatrix"]


@dataclass(frozen=True)
class ImportanceMatrix(CheckedResult):
    """Sums of squared inputs per channel of each block linear weight, as llama.cpp's imatrix stores them.

    Attributes:
        sums: llama.cpp tensor name (``blk.3.ffn_down.weight``) -> ``sum over tokens of x_c^2``,
            float64 ``[d_in]``.
        counts: the same names -> tokens summed over.
        chunk_size: tokens per chunk (an example's length); llama.cpp records it.
        datasets: where the tokens came from (recorded in the file).

    Made only finite, with sums of squares >= 0 and counts >= 1 (:mod:`interp.results`).
    """

    sums: dict[str, np.ndarray]
    counts: dict[str, int]
    chunk_size: int
    datasets: tuple[str, ...] = ()

    def meaningless(self) -> str | None:
        """A negative sum of squares or a count below 1 is not an importance (a hand-edited or foreign file)."""
        negative = sorted(name for name, values in self.sums.items() if bool((np.asarray(values) < 0).any()))
        if negative:
            return f"the sums of squared inputs of {negative[:4]} are negative: a sum of squares cannot be."
        empty = sorted(name for name, n in self.counts.items() if not (isinstance(n, (int, np.integer)) and n >= 1))
        if empty:
            return f"the token counts of {empty[:4]} are not positive integers: no tokens were summed for them."
        return None

    @property
    def tokens(self) -> int:
        """The token count (every weight's; they are equal unless a file says otherwise)."""
        return max(self.counts.values(), default=0)

    @property
    def chunk_count(self) -> int:
        return self.tokens // self.chunk_size if self.chunk_size else 0

    def mean(self, name: str) -> np.ndarray:
        """``E[x_c^2]`` of weight ``name``'s input channels."""
        return self.sums[name] / max(self.counts[name], 1)

    def table(self) -> pd.DataFrame:
        """One row per weight: layer, role, tensor name, channels, tokens, and the spread of ``E[x_c^2]``
        (mean, max, and max over mean: how much a few channels dominate)."""
        rows = []
        for name in sorted(self.sums, key=_order):
            layer, role = _layer_role(name)
            mean = self.mean(name)
            rows.append({"layer": layer, "role": role, "tensor": name, "channels": int(mean.size),
                         "tokens": self.counts[name], "mean_sq": float(mean.mean()), "max_sq": float(mean.max()),
                         "max_over_mean": float(mean.max() / mean.mean()) if mean.mean() > 0 else float("nan")})
        return pd.DataFrame(rows)


def _layer_role(name: str) -> tuple[int | None, str | None]:
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), TENSOR_ROLES.get(parts[2])
    return None, None


def _order(name: str) -> tuple[int, int, str]:
    layer, role = _layer_role(name)
    roles = [r for group in INPUT_GROUPS for r in group]
    return (-1 if layer is None else layer, roles.index(role) if role in roles else len(roles), name)


# llama.cpp's one tensor for roles a model stores fused in one module (GPT-2, GPT-NeoX, Phi-3: attn_qkv; Phi-3's
# gate_up_proj: ffn_up, gate rows first)
FUSED_TENSORS = {("q", "k", "v"): "attn_qkv", ("gate", "up"): "ffn_up"}


def _tensor_names(layer: int, roles: list[str], slots: Mapping[str, Any]) -> list[str]:
    """llama.cpp's tensor names for roles reading one input: one per role, or one for roles fused in one module."""
    fused = tuple(roles) in FUSED_TENSORS and len({id(slots[r].module) for r in roles}) == 1
    if fused:
        return [f"blk.{layer}.{FUSED_TENSORS[tuple(roles)]}.weight"]
    return [gguf_name(layer, r) for r in roles]


@checked
def importance_matrix(model: Model, examples: Examples, batch_size: int = 8, progress: bool | None = None,
                      datasets: tuple[str, ...] = ()) -> ImportanceMatrix:
    """llama.cpp's importance matrix of ``model``'s block linear weights over every position of ``examples``.

    Args:
        model: a loaded model (its block linear weights get one entry each, named as llama.cpp names
            them; roles a model stores fused in one module, like GPT-2's ``c_attn``, get the fused
            tensor's one entry: ``attn_qkv``).
        examples: token rows of one length, unpadded (every position is counted, BOS included, as
            ``llama-imatrix`` counts every position of its chunks).
        batch_size: examples per forward pass.
        progress: show a progress bar (None: only in a terminal).
        datasets: names recorded in the file's ``imatrix.datasets``.

    Returns:
        An :class:`ImportanceMatrix` with float64 sums (the file stores float32).
    """
    check_examples(model, examples)
    refuse_padding(examples, "an importance matrix")
    sums: dict[tuple[int, int], torch.Tensor] = {}

    def adder(key: tuple[int, int]) -> Any:
        def add(x: torch.Tensor, hook: Any) -> None:
            flat = x.detach().reshape(x.shape[0] * x.shape[1], -1).double().cpu()  # [batch * pos, d_in]
            sums[key] = sums[key] + (flat * flat).sum(0) if key in sums else (flat * flat).sum(0)

        return add

    fwd, names = [], {}
    for layer in range(hooks.n_layers(model)):
        present = hooks.linear_weights(model, layer)
        for index, roles in enumerate(INPUT_GROUPS):
            here = [r for r in roles if r in present]
            if here:
                fwd.append((hooks.linear_input_hook(model, layer, here[0]), adder((layer, index))))
                names[layer, index] = _tensor_names(layer, here, present)
    device = next(model.original_model.parameters()).device
    spans = list(batches(len(examples), batch_size))
    with torch.no_grad(), model.hooks(fwd_hooks=fwd):
        for first, last in tqdm(spans, desc="importance matrix", unit="batch", disable=not show_progress(progress)):
            hooks.decoder_body(model)(input_ids=examples.tokens[first:last].to(device))
    tokens = int(examples.tokens.numel())
    out = {name: sums[key].numpy() for key, group in names.items() for name in group}
    return ImportanceMatrix(out, {name: tokens for name in out}, examples.seq_len, tuple(datasets))


@checked
def write_imatrix(matrix: ImportanceMatrix, path: str | os.PathLike[str]) -> Path:
    """Write ``matrix`` as the GGUF file ``llama-imatrix`` writes (``llama-quantize --imatrix PATH`` reads it).

    Written through interp's one writer (:func:`interp.io.write_file`): atomically, never over a folder.
    """
    import gguf

    from interp.io import write_file

    if not matrix.sums:
        raise SpecError("the importance matrix is empty: it holds no weight")

    with np.errstate(over="ignore"):  # a sum past float32's range becomes inf, refused just below
        stored = {name: np.asarray(matrix.sums[name], dtype=np.float32) for name in sorted(matrix.sums)}
    check_values(stored, "The importance matrix in float32 (as the file stores it)")  # a sum past 3.4e38 is inf

    def produce(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch="", endianess=gguf.GGUFEndian.LITTLE)
        writer.kv_data[0].pop("general.architecture", None)  # an imatrix file has no architecture key
        writer.add_string("general.type", "imatrix")
        writer.add_array("imatrix.datasets", list(matrix.datasets))
        writer.add_uint32("imatrix.chunk_count", matrix.chunk_count)
        writer.add_uint32("imatrix.chunk_size", matrix.chunk_size)
        for name in sorted(matrix.sums):
            writer.add_tensor(f"{name}.in_sum2", stored[name])
            writer.add_tensor(f"{name}.counts", np.asarray([matrix.counts[name]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return write_file(path, produce)


@checked
def read_imatrix(path: str | os.PathLike[str]) -> ImportanceMatrix:
    """Read an imatrix GGUF file (``llama-imatrix``'s or :func:`write_imatrix`'s).

    Raises:
        SpecError: not a GGUF file, not an imatrix, or an entry without its counts.
    """
    import gguf

    from interp.reading import regular_file

    regular_file(path, "the importance matrix", SpecError)
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as error:
        raise SpecError(f"cannot read {path} as a GGUF file ({error})") from None
    fields: Mapping[str, Any] = reader.fields
    kind = fields.get("general.type")
    if kind is None or kind.contents() != "imatrix":
        raise SpecError(f"{path} is a GGUF file but not an importance matrix (general.type is "
                        f"{kind.contents() if kind is not None else 'missing'!s})")
    tensors = {t.name: np.asarray(t.data, dtype=np.float64).reshape(-1) for t in reader.tensors}
    sums, counts = {}, {}
    for name, values in tensors.items():
        if name.endswith(".in_sum2"):
            weight = name[: -len(".in_sum2")]
            count = tensors.get(f"{weight}.counts")
            if count is None or count.size != 1:
                raise SpecError(f"{path}: {weight} has sums but no single count (a mixture-of-experts imatrix is "
                                "not supported)")
            sums[weight], counts[weight] = values, int(count[0])
    datasets = tuple(fields["imatrix.datasets"].contents()) if "imatrix.datasets" in fields else ()
    chunk_size = int(fields["imatrix.chunk_size"].contents()) if "imatrix.chunk_size" in fields else 0
    return ImportanceMatrix(sums, counts, chunk_size, datasets)
