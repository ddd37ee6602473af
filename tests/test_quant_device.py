"""The quantizers compute on the weight's device: nothing of a weight or of its calibration inputs goes to the host.

Every tensor operation that runs inside ``quantize_weight`` is recorded (a ``TorchDispatchMode``), and:

* no operation that reads a tensor on the weight's device ``D`` makes a tensor anywhere else (no device-to-host
  copy: on CUDA this catches a ``.cpu()``, a ``.to("cpu")`` or a factory on the host mixed into the math);
* no operation makes a tensor on ``meta``: the calls run with ``meta`` as the default device, so a tensor factory
  that names no device (which would silently make a CPU tensor) is caught on the CPU too, where every other
  tensor is on ``D`` anyway;
* ``Tensor.cpu`` and ``Tensor.numpy`` are never called, and ``Tensor.to`` never names the CPU when ``D`` is not it.

Host-side constants made on purpose (AWQ's grid of exponents, a Python list; the NF codebook's quantiles from
scipy) name ``device="cpu"`` and read nothing from ``D``: they pass. The result must come back on ``D`` in the
weight's dtype. The module runs on ``--device`` (default ``cpu``; ``pytest --device cuda`` on a GPU).
:func:`test_the_check_catches_a_host_round_trip` shows the check failing on a quantizer that does what the old
code did (weights and inputs to the CPU in float32).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from interp.quant import quantize_weight
from interp.quant.methods import METHODS

pytestmark = pytest.mark.device_suite

HQQ = pytest.mark.skipif(importlib.util.find_spec("hqq") is None,
                         reason="the hqq package is not installed (it has no wheel for some platforms)")
SPECS = ["rtn:bits=3,group=32", "rtn:bits=4,group=32,zero=int", "nf:bits=4,group=32", "nf:bits=3,group=32",
         pytest.param("hqq:bits=3,group=32", marks=HQQ), pytest.param("hqq:bits=4,group=32,optimize=0", marks=HQQ),
         "gptq:bits=3,group=32", "gptq:bits=4,group=32,act_order=0,block=24", "awq:bits=3,group=32,grid=5"]


class DeviceRecorder(TorchDispatchMode):
    """Records, for every operation, the devices of its tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[torch.device], set[torch.device]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.device for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        outputs = {t.device for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        self.ops.append((str(func), inputs, outputs))
        return out

    def problems(self, device: torch.device) -> list[str]:
        found = []
        for name, inputs, outputs in self.ops:
            if any(d.type == "meta" for d in outputs):
                found.append(f"{name} made a tensor on the default device (a factory that names no device)")
            elif device in inputs and outputs - {device}:
                found.append(f"{name} read a tensor on {device} and made one on {sorted(map(str, outputs))}")
        return found


@contextlib.contextmanager
def host_spies(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> Iterator[list[str]]:
    """Records every ``Tensor.cpu``/``Tensor.numpy`` call, and every ``Tensor.to`` naming the CPU off the CPU."""
    calls: list[str] = []
    cpu, numpy, to = torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.to

    def spy_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(f"Tensor.cpu() on a {self.device} tensor")
        return cpu(self, *args, **kwargs)

    def spy_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(f"Tensor.numpy() on a {self.device} tensor")
        return numpy(self, *args, **kwargs)

    def spy_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        named = [a for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))]
        if device.type != "cpu" and any(torch.device(a).type == "cpu" for a in named):
            calls.append(f"Tensor.to({named}) on a {self.device} tensor")
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", spy_cpu)
    monkeypatch.setattr(torch.Tensor, "numpy", spy_numpy)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    try:
        yield calls
    finally:
        monkeypatch.setattr(torch.Tensor, "cpu", cpu)
        monkeypatch.setattr(torch.Tensor, "numpy", numpy)
        monkeypatch.setattr(torch.Tensor, "to", to)


def _inputs(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    W = torch.randn(40, 96, generator=generator) * 0.05
    X = torch.randn(128, 96, generator=generator)
    X[:, 5] = 0.0  # a dead input channel (GPTQ's special case)
    return W.to(device, dtype), X.to(device, dtype)


def watched(fn: Any, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    """``fn()`` with meta as the default device, every op's devices recorded; (result, what went wrong)."""
    fn()  # warm caches (the NF codebook's quantiles, imports) outside the watch: they run once per process
    result, raised = None, []
    with host_spies(monkeypatch, device) as calls, torch.device("meta"), DeviceRecorder() as recorder:
        try:
            result = fn()
        except Exception as exc:  # e.g. a meta tensor met a real one: reported with its cause below
            raised.append(f"raised {exc!r}")
    return result, [*calls, *recorder.problems(device), *raised]


def test_every_quantizer_is_checked() -> None:
    names = {(spec.values[0] if hasattr(spec, "values") else spec).split(":")[0] for spec in SPECS}
    assert names == set(METHODS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("spec", SPECS)
def test_quantizer_computes_on_the_weights_device(spec: str, dtype: torch.dtype, device: torch.device,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    W, X = _inputs(device, dtype)
    result, problems = watched(lambda: quantize_weight(W, spec, X), device, monkeypatch)
    assert not problems, problems
    assert result.device == W.device and result.dtype == W.dtype and result.shape == W.shape


def test_inputs_captured_elsewhere_move_to_the_weight_once(device: torch.device) -> None:
    """Calibration rows on the CPU for a weight on ``device``: moved once, shared by the weights that read them."""
    from interp.quant.methods import LayerInputs

    W, X = _inputs(device, torch.float32)
    inputs = LayerInputs.checked(X.to("cpu"), X.shape[1], "gptq")
    moved = inputs.on(W.device)
    assert moved.X.device == W.device and inputs.on(W.device) is moved
    assert torch.equal(quantize_weight(W, "gptq:bits=3,group=32", inputs),
                       quantize_weight(W, "gptq:bits=3,group=32", X))


def test_calibration_rows_stay_on_the_models_device(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration feeder hands each layer its inputs where the block computed them (no host copy)."""
    import interp
    from interp.quant.calibration import LayerFeeder

    model = interp.tiny_model("llama", seed=0)
    model.original_model.to(device)
    tokens = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(1))
    feeder = LayerFeeder(model, tokens, batch_size=2)
    with host_spies(monkeypatch, device) as calls:
        rows = feeder.inputs(0, "q")
        with feeder.paused(0, [["q", "k", "v"]]) as block:
            paused = block.inputs(0)
    assert rows.device.type == device.type and paused.device.type == device.type and not calls, calls


def test_the_check_catches_a_host_round_trip(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantizer that does what they all did before (weight and inputs to the CPU in float32, a buffer made
    without a device, the result moved back) fails the check, on the CPU too."""
    from interp.quant.methods._common import rtn_weights

    def round_trip(W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        host_w = W.detach().to(device="cpu", dtype=torch.float32)
        buffer = torch.empty(host_w.shape)  # names no device
        buffer.copy_(rtn_weights(host_w, 3, 32))
        return buffer.to(device=W.device, dtype=W.dtype)

    W, X = _inputs(device, torch.float32)
    _, problems = watched(lambda: round_trip(W, X), device, monkeypatch)
    assert any("names no device" in p for p in problems), problems
    if device.type != "cpu":
        assert any("made one on ['cpu']" in p for p in problems), problems
