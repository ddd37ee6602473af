"""A quantized model's record and its folder: :class:`QuantInfo`, and saving, reading and loading the weights.

:func:`save_quantized` writes a quantized model's block weights (safetensors) and its
:class:`QuantInfo` (JSON) into a folder, whole or not at all; :func:`load_quantized` puts them
onto a fresh copy of the reference after checking that they were made from it and are the
weights the record describes. :func:`~interp.quant.apply.quantize` makes the weights and
:func:`~interp.quant.apply.quantize_cached` keeps such folders in a disk cache; both names are
importable from :mod:`interp.quant.apply` too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from interp import schema
from interp.errors import DataError, InterpError
from interp.io import INCOMPLETE, is_complete, staged_folder, write_file, write_json
from interp.models import Model, copy_model, model_hash
from interp.reading import read_json
from interp.runtime import hooks, placement
from interp.validate import checked, checked_class

WEIGHTS_FILE = "quantized.safetensors"
QUANTIZED_KIND = "quantized"  # the kind in a saved folder's interp marker (interp.io.MARKER)
INFO_FILE = "quant.json"
FORMAT_VERSION = 2  # 2: written whole and renamed once; the label carries the weights' SHA-256



@checked_class
@dataclass(frozen=True)
class QuantInfo:
    """How a quantized model was made (attached to it as ``model.quant_info``).

    Attributes:
        spec: canonical method spec.
        reference_hash: :func:`~interp.models.model_hash` of the reference model.
        reference_name: the reference model's name.
        calibration: ``None`` for calibration-free methods, else the calibration set's
            hash, size, length and settings.
        layer_seconds: wall time per block (calibration forwards included).
        role_seconds: total ``quantize_weight`` time per linear role.
        calibration_seconds: time spent collecting calibration inputs.
        relative_errors: ``"layer.role"`` -> ``||W - W_hat||_F / ||W||_F``.
        algorithm: :func:`~interp.quant.apply.algorithm_version` of the code that made the weights.

    Example:
        >>> import interp
        >>> from interp.quant import model_hash, quantize
        >>> model = interp.tiny_model("llama")
        >>> info = quantize(model, "rtn:bits=4,group=32", progress=False).quant_info
        >>> info.spec, info.reference_hash == model_hash(model), info.calibration is None
        ('rtn:bits=4,group=32,zero=float', True, True)
    """

    spec: str
    reference_hash: str
    reference_name: str
    calibration: dict[str, Any] | None
    layer_seconds: list[float] = field(default_factory=list)
    role_seconds: dict[str, float] = field(default_factory=dict)
    calibration_seconds: float = 0.0
    relative_errors: dict[str, float] = field(default_factory=dict)
    algorithm: str = ""

    @property
    def seconds_per_layer(self) -> float:
        return sum(self.layer_seconds) / max(1, len(self.layer_seconds))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


RECORD_SCHEMA = {"format": "int", "weights_bytes": "int", "weights_sha256": "str", **schema.schema_of(QuantInfo)}
"""What ``quant.json`` holds (:func:`interp.schema.conform`'s kinds): the file's own keys and every QuantInfo field.
A field with a default may be absent (a record written before it existed) and reads as the default."""
_DEFAULTED = {f.name: f.default_factory if f.default_factory is not dataclasses.MISSING else (lambda v=f.default: v)
              for f in dataclasses.fields(QuantInfo)
              if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def quantized_model_info(reference: Model, info: QuantInfo) -> Any:
    """The ``info`` a quantized copy of ``reference`` carries (its own name and identity), or ``None``
    when the reference has none; :class:`~interp.quant.inplace.SavedWeights` names itself by it too."""
    calibration_hash = (info.calibration or {}).get("hash", "none")
    identity = hashlib.sha256(f"{info.reference_hash}|{info.spec}|{calibration_hash}".encode()).hexdigest()
    ref_info = getattr(reference, "info", None)
    if ref_info is None:
        return None
    return dataclasses.replace(ref_info, name=f"{ref_info.name}+{info.spec}", source_hash=identity)


def _label(qmodel: Model, reference: Model, info: QuantInfo) -> None:
    """Attach ``quant_info`` and give the copy its own name and identity."""
    model_info = quantized_model_info(reference, info)
    if model_info is not None:
        object.__setattr__(qmodel, "info", model_info)
    object.__setattr__(qmodel, "quant_info", info)



@checked
def save_quantized(model: Model, path: str | os.PathLike[str], info: QuantInfo | None = None) -> Path:
    """Write a quantized model's block weights (safetensors) and its :class:`QuantInfo` (JSON).

    ``info`` describes the weights when ``model`` carries them in place (see
    :mod:`interp.quant.inplace`); by default it is ``model.quant_info``.

    Only the quantized weights are written (the rest equals the reference). The folder is
    written whole into a temporary sibling and renamed into place once (through
    :func:`interp.output_folders.staged_folder`), so ``path`` is either absent, the previous folder, or complete;
    never weights of one spec under the label of another. The JSON records the weights file's size
    and SHA-256, checked on load. An existing ``path`` must be empty or an earlier saved quantized
    model: a folder with other files is refused, and files interp did not write are never removed.

    Example:
        >>> import pathlib, tempfile
        >>> import interp
        >>> from interp.quant import quantize, save_quantized
        >>> qmodel = quantize(interp.tiny_model("llama"), "rtn:bits=4,group=32", progress=False)
        >>> folder = save_quantized(qmodel, pathlib.Path(tempfile.mkdtemp()) / "rtn4")
        >>> sorted(p.name for p in folder.iterdir())  # the first marks the folder as interp's (interp.io)
        ['.interp-output.json', 'quant.json', 'quantized.safetensors']
    """
    info = info if info is not None else getattr(model, "quant_info", None)
    if info is None:
        raise InterpError("save_quantized needs a model returned by interp.quant.quantize (it has no quant_info).")
    out = Path(path)
    tensors = {}
    for layer in range(hooks.n_layers(model)):
        with placement.onloaded(model, [layer]):  # an offloaded block's weights come to memory to be written
            tensors.update({f"{layer}.{role}": slot.read().detach().cpu().contiguous()
                            for role, slot in hooks.linear_weights(model, layer).items()})
    with staged_folder(out, QUANTIZED_KIND, adopt=_is_saved_quantized) as tmp:
        weights = write_file(tmp / WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
        record = {"format": FORMAT_VERSION, "weights_bytes": weights.stat().st_size,
                  "weights_sha256": _file_sha256(weights), **info.to_dict()}
        write_json(tmp / INFO_FILE, record)
    return out


def _is_saved_quantized(folder: Path) -> bool:
    """A folder :func:`save_quantized` wrote before output folders carried interp's marker: its
    ``quant.json`` is interp's record, and it holds nothing else but the weights."""
    try:
        record = json.loads((folder / INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    own = {INFO_FILE, WEIGHTS_FILE}
    return (isinstance(record, dict) and record.get("format") == FORMAT_VERSION and "reference_hash" in record
            and all(p.name in own for p in folder.iterdir()))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def quant_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The record of the quantized model saved in the folder ``path``: its ``quant.json``, read bounded (a pipe or
    a device is refused) and checked against :data:`RECORD_SCHEMA`, for a complete folder whose weights file has
    the size the record gives.

    Raises:
        DataError: naming the folder or ``quant.json`` and what is wrong: no record, a save killed part-way
            (``INCOMPLETE``), a file that is not JSON, a missing key or a value of the wrong kind (named), another
            format, a weights file of another size.
    """
    folder = Path(path)
    info = folder / INFO_FILE
    if not os.path.lexists(info):
        raise DataError(f"{folder} holds no complete quantized model (expected {INFO_FILE} and {WEIGHTS_FILE}).")
    if not is_complete(folder):
        raise DataError(f"{folder} holds no complete quantized model: a save was killed or failed while writing it "
                        f"({INCOMPLETE} is there). Save or quantize it again.")
    # looked up on use: interp.schema.conform is the one place every persisted record is checked
    record = schema.conform(read_json(info, "a saved quantized model's record"), RECORD_SCHEMA, str(info),
                            optional=tuple(_DEFAULTED))
    if record["format"] != FORMAT_VERSION:
        raise DataError(f'{info}: "format" is {record["format"]}, not {FORMAT_VERSION}: it was written by another '
                        "version of interp. Quantize and save the model again.")
    try:
        size: int | None = (folder / WEIGHTS_FILE).stat().st_size
    except OSError:
        size = None
    if size != record["weights_bytes"]:
        held = f"{WEIGHTS_FILE} is missing" if size is None else f"{WEIGHTS_FILE} holds {size} bytes"
        raise DataError(f'{folder} holds no complete quantized model: {held}, not the {record["weights_bytes"]} '
                        f'its {INFO_FILE} records ("weights_bytes"). Save or quantize it again.')
    return {**{name: default() for name, default in _DEFAULTED.items()}, **record}


def read_quant_info(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The checked record of a saved quantized model (:func:`~interp.quant.saving.quant_record`), or ``None`` when
    there is none to use: the folder is absent or incomplete, or its record is damaged (the caches then quantize it
    again)."""
    try:
        return quant_record(path)
    except DataError:
        return None


def _info_from_record(record: dict[str, Any]) -> QuantInfo:
    """The QuantInfo a saved ``quant.json`` describes (its other keys are the file's own)."""
    fields = {f.name for f in dataclasses.fields(QuantInfo)}
    return QuantInfo(**{k: v for k, v in record.items() if k in fields})


@checked
def load_quantized(reference: Model, path: str | os.PathLike[str]) -> Any:
    """A copy of ``reference`` carrying the quantized weights saved in ``path``.

    Raises:
        DataError: the folder is missing or incomplete, or its ``quant.json`` is damaged
            (:func:`~interp.quant.saving.quant_record` names the key).
        InterpError: it was made from another model, or its weights are not the ones its record describes.

    Example:
        >>> import pathlib, tempfile, torch
        >>> import interp
        >>> from interp.quant import load_quantized, quantize, save_quantized
        >>> model = interp.tiny_model("llama")
        >>> qmodel = quantize(model, "rtn:bits=4,group=32", progress=False)
        >>> back = load_quantized(model, save_quantized(qmodel, pathlib.Path(tempfile.mkdtemp()) / "rtn4"))
        >>> tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
        >>> bool(torch.equal(back(tokens), qmodel(tokens)))
        True
    """
    record = quant_record(path)
    expected = model_hash(reference)
    if record["reference_hash"] != expected:
        raise InterpError(
            f"The quantized weights in {path} were made from model {record['reference_hash']}, "
            f"not from this reference ({expected}). Quantize this model again."
        )
    if _file_sha256(Path(path) / WEIGHTS_FILE) != record["weights_sha256"]:
        raise InterpError(
            f"The weights in {path} are not the ones its {INFO_FILE} describes ({record['spec']}): the folder "
            "was changed or mixed up after it was written. Delete it and quantize again."
        )
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    qmodel = copy_model(reference)
    qmodel.eval()
    with torch.no_grad():
        for layer in range(hooks.n_layers(qmodel)):
            for role, slot in hooks.linear_weights(qmodel, layer).items():
                slot.write(tensors[f"{layer}.{role}"])
    _label(qmodel, reference, _info_from_record(record))
    return qmodel
