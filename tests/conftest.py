"""Shared fixtures: tiny random models (unit tier) and the bundled real models (integration tier)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# At most 2 torch threads (CI's machine has 2 cores); OMP_NUM_THREADS, when set, wins, so that
# `.ci/run`'s one-thread pass of the numerical tests really runs on one thread.
torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])) if os.environ.get("OMP_NUM_THREADS", "").isdigit()
                      else max(1, min(2, os.cpu_count() or 1)))

import float64_attention  # noqa: E402  (after the environment above)

float64_attention.install()  # float64 test models keep their attention softmax in float64


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="the device the device suite runs on (cpu, cuda, cuda:N; default cpu): "
                          "pytest --device cuda -m device_suite (tests/test_device_suite.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "device_suite: runs on the device --device names, checked against the CPU "
                                       "float32 result (tests/test_device_suite.py)")
    # pytest-xdist registers it; a machine without xdist (the GPU image runs the device suite with plain pytest)
    # would otherwise refuse the marker pytest_collection_modifyitems puts on every test under --strict-markers
    config.addinivalue_line("markers", "xdist_group(name): run the tests of one group on one xdist worker")


@pytest.fixture(scope="session")
def device(request):
    """The torch device of ``--device`` (default ``cpu``); a device this machine lacks stops the run with why."""
    name = request.config.getoption("--device")
    try:
        chosen = torch.device(name)
    except (RuntimeError, ValueError):
        pytest.exit(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N", returncode=4)
    if chosen.type == "cuda" and not (torch.cuda.is_available() and (chosen.index or 0) < torch.cuda.device_count()):
        pytest.exit(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)", returncode=4)
    if chosen.type not in ("cpu", "cuda"):
        pytest.exit(f"--device {name}: the device suite runs on cpu or cuda", returncode=4)
    if chosen.type == "cuda":
        # the suite's tolerances assume IEEE float32 matmuls and float32 accumulation of bfloat16 products
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return chosen


@pytest.fixture(scope="session")
def smol():
    """The bundled SmolLM2-135M (converted once into the user cache, then loaded in ~2 s)."""
    import interp

    return interp.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma():
    import interp

    return interp.load_model("gemma3-270m")


@pytest.fixture(scope="session")
def wiki_small(smol):
    import interp

    return interp.load_examples("wiki", smol.tokenizer, n=16, seq_len=64, seed=0)


@pytest.fixture(scope="module")
def tiny_llama():
    import interp

    return interp.tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def tiny_gpt2():
    import interp

    return interp.tiny_model("gpt2", seed=0)


@pytest.fixture(scope="module")
def model64():
    """A tiny llama in float64 (attention included: see float64_attention.py), for exactness tests."""
    import interp

    model = interp.tiny_model("llama", seed=0)
    model.original_model.to(torch.float64)
    return model


@pytest.fixture(scope="module")
def tok():
    """The tiny models' byte tokenizer (256 bytes + BOS/EOS/PAD), built offline."""
    import interp

    return interp.models.tiny_tokenizer()


@pytest.fixture
def no_network(monkeypatch):
    """Make every attempt to open a network connection fail loudly."""

    class NetworkBlocked(RuntimeError):
        pass

    def refuse(*args, **kwargs):
        raise NetworkBlocked("network access attempted while sockets are blocked")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return NetworkBlocked


# Shared by test_lens and test_patching: a tiny llama reference and its 3-bit RTN copy
# (embeddings and head untouched), and a few token rows.


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model ops are dominated by thread hand-offs on a loaded 2-core machine (20x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(one_thread):
    import interp
    from interp.quant.apply import quantize

    reference = interp.tiny_model("llama", seed=0, n_layers=4)
    return reference, quantize(reference, "rtn:bits=3,group=64", progress=False)


@pytest.fixture(scope="module")
def rows():
    import torch

    import interp

    return interp.Examples.from_tokens(torch.randint(0, 256, (5, 12), generator=torch.Generator().manual_seed(0)))


# -- running the suite on two workers (make test: pytest -n 2 --dist loadgroup) -------------------
# Each test module runs whole on one worker, so its module-scoped fixtures (the quick report, the
# quantized models) are built once; the notebook executions, which share nothing but the session's
# model, are spread over both workers one by one.
SPREAD_MODULES = {"test_notebooks.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.name
        if module not in SPREAD_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
