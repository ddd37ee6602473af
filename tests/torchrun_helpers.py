"""What the torchrun tests share: a free port, a small text file, a 2-rank CPU launch, and one
process set up as each rank is (one torch thread, the ranks' model cache)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def documents(path: Path, n: int = 40) -> Path:
    """``n`` documents of 40 random words, separated by blank lines."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho sigma tau".split()
    rng = random.Random(0)
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(n)))
    return path


def torchrun(argv: Sequence[str], cache: Path, ranks: int = 2, timeout: int = 400) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node ranks ARGV`` on CPU (gloo), one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "INTERP_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@contextmanager
def one_process_like_a_rank(cache: Path) -> Iterator[None]:
    """One thread and the ranks' model cache, as each torchrun rank has them; both restored afterwards."""
    threads, old_cache = torch.get_num_threads(), os.environ.get("INTERP_CACHE")
    torch.set_num_threads(1)
    os.environ["INTERP_CACHE"] = str(cache)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if old_cache is None:
            os.environ.pop("INTERP_CACHE", None)
        else:
            os.environ["INTERP_CACHE"] = old_cache
