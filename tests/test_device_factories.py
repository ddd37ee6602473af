"""Every tensor interp creates names its device, or its line says why it is host-side.

The rule (docs/DESIGN "Devices"): a tensor made on a compute path is made on the device of the data it meets
(``torch.zeros(n, device=x.device, dtype=x.dtype)``, or ``torch.zeros_like(x)``). A factory call that names no
device makes a CPU tensor; on a CUDA model that is either a silent host round trip or a device-mismatch error
far from its cause. Some host tensors are right (index lists built before a batch moves, results bound for disk,
inputs of CPU-only libraries such as numpy or gguf); those carry a marker comment that says so.

The checker walks the AST of every ``interp/**/*.py`` file. A call is flagged when:

* it calls a torch tensor factory (:data:`FACTORIES`), by ``torch.NAME(...)``, through an ``import torch as t``
  alias, or after ``from torch import NAME``;
* it passes no ``device=`` keyword, or passes the literal ``device=None`` (which means the default device); and
* neither the line above the call nor any line of the call carries a comment ``# host: <reason>`` with a
  non-empty reason.

Which calls count as factories: those that make a new tensor from sizes, scalars or Python/numpy data. The
``*_like`` and ``Tensor.new_*`` variants take their device from the tensor they are given, so they are right by
construction and not listed. ``torch.from_numpy`` and ``torch.frombuffer`` always make a CPU tensor (they share
host memory and take no ``device=``), so every use needs the marker. ``torch.normal`` is not listed: its usual form
draws around tensors it is given and inherits their device. ``torch.Generator`` is not a tensor: a CPU generator
handed to a CUDA draw raises in torch itself rather than computing on the wrong device.

Functions whose source is pinned by a pre-registration's code fingerprint
(``interp.report.confirm._judging_functions``) cannot be edited without invalidating the registrations; a factory
inside one is exempted by qualname in :data:`PINNED`, and a test keeps that list honest.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "interp"

FACTORIES = frozenset({
    "empty", "empty_strided", "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "eye",
    "tensor", "as_tensor", "asarray", "scalar_tensor", "rand", "randn", "randint", "randperm",
    "tril_indices", "triu_indices", "from_numpy", "frombuffer",
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor", "IntTensor",
    "BoolTensor", "ByteTensor",
})
MARKER = "# host:"
PINNED_REASON = "pinned by a registration's code fingerprint"

# (file relative to the repository root, function qualname) -> why a factory inside may name no device.
PINNED: dict[tuple[str, str], str] = {
    # token rows of zeros standing in for the examples' ids (a host placeholder, never run through a model)
    ("interp/report/confirm.py", "analyse"): PINNED_REASON,
}


@dataclass(frozen=True)
class Finding:
    """One factory call that names no device and carries no host marker."""

    path: str
    line: int
    call: str
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: torch.{self.call}(...) names no device (in {self.function or '<module>'})"


def _comments(source: str) -> dict[int, str]:
    """Comment text by line number, from the tokenizer (a ``#`` inside a string is not a comment)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def _has_reason(comment: str) -> bool:
    at = comment.find(MARKER)
    return at >= 0 and comment[at + len(MARKER):].strip() != ""


def _torch_names(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to the torch module, and names bound to a torch factory (local name -> factory)."""
    modules, factories = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch":
                    modules.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for alias in node.names:
                if alias.name in FACTORIES:
                    factories[alias.asname or alias.name] = alias.name
    return modules, factories


def _names_device(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "device":
            return not (isinstance(kw.value, ast.Constant) and kw.value.value is None)
    return False


class _Walker(ast.NodeVisitor):
    def __init__(self, modules: set[str], factories: dict[str, str]) -> None:
        self.modules, self.factories = modules, factories
        self.scope: list[str] = []
        self.calls: list[tuple[ast.Call, str, tuple[str, ...]]] = []  # (call, factory, enclosing qualnames)

    def _qualnames(self) -> tuple[str, ...]:
        return tuple(".".join(self.scope[:i]) for i in range(1, len(self.scope) + 1))

    def _visit_scope(self, node: ast.AST, name: str, is_function: bool) -> None:
        self.scope.append(name)
        if is_function:
            self.scope.append("<locals>")
        self.generic_visit(node)
        del self.scope[-(2 if is_function else 1):]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_scope(node, node.name, True)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_scope(node, node.name, False)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in self.modules:
            name = f.attr if f.attr in FACTORIES else None
        elif isinstance(f, ast.Name):
            name = self.factories.get(f.id)
        if name is not None and not _names_device(node):
            names = tuple(q for q in self._qualnames() if not q.endswith("<locals>"))
            self.calls.append((node, name, names))
        self.generic_visit(node)


def unmarked_factories(source: str, path: str = "<source>",
                       exempt: dict[tuple[str, str], str] | None = None) -> list[Finding]:
    """The torch factory calls in ``source`` that name no device and carry no ``# host: <reason>`` marker.

    ``exempt`` maps (path, function qualname) to a reason: calls inside those functions are not reported.
    """
    tree = ast.parse(source)
    comments = _comments(source)
    walker = _Walker(*_torch_names(tree))
    walker.visit(tree)
    exempt = exempt or {}
    found = []
    for call, name, qualnames in walker.calls:
        lines = range(call.lineno - 1, (call.end_lineno or call.lineno) + 1)
        if any(_has_reason(comments.get(i, "")) for i in lines):
            continue
        if any((path, q) in exempt for q in qualnames):
            continue
        found.append(Finding(path, call.lineno, name, qualnames[-1] if qualnames else ""))
    return found


def _package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_factory_in_interp_names_its_device_or_says_why_not():
    findings = []
    for file in _package_files():
        rel = file.relative_to(ROOT).as_posix()
        findings += unmarked_factories(file.read_text(encoding="utf-8"), rel, PINNED)
    assert not findings, (f"{len(findings)} tensor factories name no device. Give each the device (and dtype) of "
                          "the data it meets, or mark a host-side one with `# host: <why>`:\n"
                          + "\n".join(map(str, findings)))


def test_the_walk_covers_the_whole_package():
    files = {f.relative_to(PACKAGE).as_posix() for f in _package_files()}
    # the quantizers and the attention/localize subpackages are where most factories live
    assert {"quant/methods/gptq.py", "quant/calibration.py", "localize/patching/engine.py", "probes.py"} <= files


PLANTED = '''\
import torch
from torch import zeros as z


def f(x):
    y = x + 1
    PLANT
    return y
'''


@pytest.mark.parametrize("plant", [
    "w = torch.zeros(3)",
    "w = torch.arange(len(y), dtype=torch.long)",
    "w = torch.tensor([1.0, 2.0])",
    "w = z(4)",
    "w = torch.full((2,), 0.5, device=None)",
    "w = torch.from_numpy(y)",
    "w = torch.randn(3)  # host:",
    "w = torch.ones(3)  # a note, not a host marker",
    "w = torch.empty(\n        3,\n        dtype=x.dtype,\n    )",
    "s = '# host: inside a string is not a comment'; w = torch.eye(2)",
])
def test_a_planted_unmarked_factory_is_caught(plant):
    source = PLANTED.replace("PLANT", plant)
    found = unmarked_factories(source, "planted.py")
    assert len(found) == 1, found
    assert found[0].line == 7
    assert found[0].function == "f"


@pytest.mark.parametrize("plant", [
    "w = torch.zeros(3, device=x.device)",
    "w = torch.zeros(3, device=x.device, dtype=x.dtype)",
    "w = torch.zeros_like(x)",
    "w = x.new_zeros(3)",
    "w = torch.tensor([1, 2])  # host: an index list, moved with the batch",
    "# host: built on the CPU before the batch moves\n    w = torch.arange(4)",
    "w = torch.empty(\n        3,  # host: written to disk\n    )",
    "w = torch.from_numpy(y).to(x.device)  # host: numpy shares host memory; moved once here",
    "w = other.zeros(3)",
])
def test_a_device_or_a_marked_factory_passes(plant):
    assert unmarked_factories(PLANTED.replace("PLANT", plant), "planted.py") == []


def test_the_checker_catches_a_call_planted_in_real_interp_source():
    """Plant an unmarked call at the top of a real function of the package: the checker flags exactly that one."""
    file = PACKAGE / "probes.py"
    source = file.read_text(encoding="utf-8")
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.body)
    first = fn.body[0]
    lines = source.splitlines(keepends=True)
    indent = " " * first.col_offset
    planted_at = first.lineno  # 1-based line of the first body statement; the plant goes before it
    lines.insert(planted_at - 1, f"{indent}_planted = torch.zeros(3)\n")
    before = unmarked_factories(source, "interp/probes.py", PINNED)
    after = unmarked_factories("".join(lines), "interp/probes.py", PINNED)
    shifted = {(f.line + (f.line >= planted_at), f.call) for f in before}
    new = [f for f in after if (f.line, f.call) not in shifted]
    assert [(f.line, f.call, f.function) for f in new] == [(planted_at, "zeros", fn.name)]
    lines[planted_at - 1] = f"{indent}_planted = torch.zeros(3)  # host: a planted, marked call\n"
    assert len(unmarked_factories("".join(lines), "interp/probes.py", PINNED)) == len(before)


def test_exemptions_name_only_functions_a_registration_pins():
    """Each PINNED entry is a function the registrations' fingerprint hashes, and holds a factory that needs it."""
    import inspect

    from interp.report import confirm

    pinned = set()
    for f in confirm._judging_functions():
        f = inspect.unwrap(f)
        pinned.add((Path(inspect.getsourcefile(f)).resolve().relative_to(ROOT).as_posix(), f.__qualname__))
    for key, reason in PINNED.items():
        assert key in pinned, f"{key} is exempted but no registration pins it"
        assert reason == PINNED_REASON
        source = (ROOT / key[0]).read_text(encoding="utf-8")
        assert any(f.function == key[1] or f.function.startswith(key[1] + ".")
                   for f in unmarked_factories(source, key[0])), f"{key} is exempted but needs no exemption"
