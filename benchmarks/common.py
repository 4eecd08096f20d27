"""What the benchmarks share: their prelude, process group, inputs, timing, result
header and the arithmetic of their reports.

Each benchmark is a script (``python benchmarks/X.py``, or under torchrun), so its own
directory is on sys.path and ``import common`` finds this module. Importing it puts the
repository root on sys.path (``from examples.tp_allreduce import ops``) and imports torch,
but not Inductor: :func:`fresh_state` must run before Inductor's config is imported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist


REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

KiB, MiB = 1 << 10, 1 << 20

# Nothing from disk: neither a decision persisted by an earlier run nor a compiled graph
# from Inductor's caches (a cached graph inlines its decisions and skips tuning).
FRESH_STATE_ENV = {
    "TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_PERSIST": "0",
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
}
# The configs that read FRESH_STATE_ENV, once, when they are imported.
_CONFIGS = ("torch._inductor.config", "torch._functorch.config")


def fresh_state() -> None:
    """Every tuning from fresh state, every compile time a cold compile's."""
    if all(os.environ.get(k) == v for k, v in FRESH_STATE_ENV.items()):
        return  # already so: a benchmark imports another (dynamic_sweep, allreduce_sweep)
    read = [name for name in _CONFIGS if name in sys.modules]
    if read:
        raise RuntimeError(
            f"fresh_state() comes too late: {read} already read the environment"
        )
    os.environ.update(FRESH_STATE_ENV)


# -- the process group and the result's header -------------------------------------------


def init_process_group(device_kind: str) -> torch.device:
    """This rank's process group (gloo on "cpu", NCCL on "cuda") and its device."""
    if device_kind == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"


def git_commit() -> str | None:
    """The code's commit, "-dirty" where tracked files differ from it; None outside a
    git checkout (a copy of the working tree on another machine)."""
    try:
        head = _git("rev-parse", "--short=12", "HEAD")
        if head.returncode != 0:
            return None
        dirty = _git("diff", "--quiet", "HEAD").returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30
    )


def header(device: torch.device) -> dict[str, Any]:
    """What every result starts with: the machine, the group and the code that made it."""
    return {
        "device": device_name(device),
        **({"world_size": dist.get_world_size()} if dist.is_initialized() else {}),
        "torch": torch.__version__,
        "commit": git_commit(),
    }


def write_json(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


# -- inputs ------------------------------------------------------------------------------


def rank_randn(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Random values seeded by the rank: ranks differ, so a wrong sum shows."""
    gen = torch.Generator(device).manual_seed(dist.get_rank())
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=dtype)


def token_input(
    tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, dynamic: bool
) -> torch.Tensor:
    """A model's input of ``tokens`` rows. ``dynamic``: its token dimension is, through
    ``maybe_mark_dynamic``, so that a specialisation shows as a recompile in the results
    rather than as an error that ends the run."""
    x = rank_randn((tokens, hidden), dtype, device)
    if dynamic:
        torch._dynamo.maybe_mark_dynamic(x, 0)
    return x


def assert_close_sum(out: torch.Tensor, reference: torch.Tensor) -> None:
    """``out`` equals ``reference``, a sum over ranks, up to the order of the sum, which
    differs from one implementation to another."""
    tol = 3e-2 if out.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(
        out, reference, rtol=tol, atol=tol * reference.abs().max().item()
    )


# -- collectives of the harness, and timing ----------------------------------------------


def sampling_order(names: Sequence[str], rounds: int) -> Iterator[str]:
    """Which variant to sample next: every variant once a round, each round in an order
    of its own, seeded by the round (the same on every rank: collective samples stay in
    lockstep). A power-capped GPU clocks a sample by what ran just before it, and a fixed
    cycle gives each variant the same predecessor in every round: on one H200 at 16384
    tokens the variant after a light one sampled at 22% higher clocks
    (results/power_cap_order_h200x1_2026-12-03.md). Callers also run each variant untimed
    before its sample, so that the GPU has settled on it."""
    for r in range(rounds):
        yield from random.Random(r).sample(list(names), len(names))


def group_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks: the slowest rank decides a collective."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier(device: torch.device) -> None:
    dist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_call(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> tuple[float, Any]:
    """Seconds of one call, all ranks starting together and its device work included,
    and what it returned."""
    barrier(x.device)
    start = time.perf_counter()
    out = fn(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


@contextlib.contextmanager
def compile_phases(into: dict[str, float], least_s: float = 0.02) -> Iterator[None]:
    """Seconds each ``dynamo_timed`` phase of the compiles inside the block took (this
    rank's; phases nest, so they overlap), into ``into``: those of at least
    ``least_s``."""
    from torch._dynamo.utils import compilation_time_metrics

    before = {k: len(v) for k, v in compilation_time_metrics.items()}
    yield
    for key, times in compilation_time_metrics.items():
        spent = sum(times[before.get(key, 0) :])
        if spent >= least_s:
            into[key] = round(into.get(key, 0.0) + spent, 3)


def first_call_s(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    """What the first call adds (compiling): its wall time less the faster of two later
    calls (in graph mode the second records the CUDA graph, the third replays it),
    slowest rank."""
    first, *later = (timed_call(fn, x)[0] for _ in range(3))
    (seconds,) = group_max([first - min(later)], x.device)
    return seconds


class CountedInductor:
    """Inductor as ``torch.compile(mode=...)`` runs it ("graph": reduce-overhead; else the
    default mode), counting the graphs it compiles.

    CompileCounterWithBackend("inductor") takes no mode, and Dynamo's
    counters["stats"]["unique_graphs"] also counts the graph Dynamo traces for the size
    dispatch's torch.cond while Inductor lowers it: 2 for one compile.
    """

    def __init__(self, mode: str) -> None:
        from torch._inductor import list_mode_options  # not at import: see fresh_state

        self.options = list_mode_options(
            "reduce-overhead" if mode == "graph" else "default"
        )
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        self.compiles += 1
        return torch._inductor.compile(gm, list(example_inputs), options=self.options)


# -- reports -----------------------------------------------------------------------------


def pct(value: float, reference: float) -> float:
    return (value - reference) / reference * 100


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity


def rounded(value: Any) -> Any:
    """``value`` with its floats to 0.01 (µs, ms, %): finer is noise."""
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def verdict(met: bool) -> str:
    return "met" if met else "NOT MET"


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
