"""Compile non-collective custom ops registered for autotuning; report what Inductor did.

Run as a script, by ``test_collective_op_tuning_noncollective.py``::

    python noncollective_probe.py SCENARIO[,SCENARIO...] [--pristine]

With ``--pristine`` every upstream module the overlay patched (the files named in the
overlay's ``manifest.json``) is served, before torch is imported, from the pristine copy
the overlay kept of it, and the overlay's new files linked into torch are hidden from
directory listings (upstream's lowering.py imports every module it finds in
torch/_inductor/kernel/): the process runs the upstream torch it was installed as, byte
for byte, and asserts that none of the overlay's ``collective_*`` modules was imported.
Without it, the overlay as installed.

Each scenario registers its own op (no torch.distributed anywhere), compiles a function
calling it in a fresh Dynamo and a fresh Inductor cache, and reports: whether the compile
and run succeeded (else the exception), the choices each autotuning call saw, the choices
it benchmarked, the winner of each call, the autotuning counters, the generated code
(normalized: temporary paths, addresses), and the result checked against eager. The
implementations' costs differ by far more than 20x (sleeps against microseconds), so the
winner does not depend on how busy the machine is.

Prints one line ``NONCOLLECTIVE_PROBE <json>``: {"mode", "torch", "scenarios": {name:
report}, "collective_modules": [the collective_* modules this process imported],
"pristine_served" / "pristine_not_imported": [the patched modules served from their
pristine copies / not imported at all]}. Several scenarios run in one process, each
with a fresh Dynamo, a fresh Inductor cache and its process-wide counters (choice and
AOT graph numbers) started afresh, as in a process of its own.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.abc
import importlib.util
import itertools
import json
import linecache
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any
from collections.abc import Callable

MARKER = "NONCOLLECTIVE_PROBE "
STATE_DIR = ".collective_autotuning_overlay"  # tools/overlay.py's STATE_DIR


# -- pristine mode: upstream's own files, served before torch is imported --------------


class _PristineLoader(importlib.abc.Loader):
    """Executes the pristine source of a module the overlay patched, under the module's
    real path (``__file__``, code objects, tracebacks): only the contents are upstream's."""

    def __init__(self, real: Path, pristine: Path, source: bytes) -> None:
        self.real = real
        self.pristine = pristine
        self.source = source

    def create_module(self, spec):  # default module creation
        return None

    def exec_module(self, module) -> None:
        code = compile(self.source, str(self.real), "exec", dont_inherit=True)
        exec(code, module.__dict__)

    def get_source(self, fullname: str) -> str:
        return self.source.decode()


class _PristineFinder(importlib.abc.MetaPathFinder):
    def __init__(self, modules: dict[str, tuple[Path, Path, bytes, bool]]) -> None:
        self.modules = modules
        self.served: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        entry = self.modules.get(fullname)
        if entry is None:
            return None
        real, pristine, source, is_package = entry
        loader = _PristineLoader(real, pristine, source)
        spec = importlib.util.spec_from_file_location(
            fullname,
            str(real),
            loader=loader,
            submodule_search_locations=[str(real.parent)] if is_package else None,
        )
        self.served.append(fullname)
        return spec


def install_pristine_finder() -> _PristineFinder:
    """Serve every module the overlay patched from its pristine copy. Must run before
    torch is imported (it asserts so)."""
    assert "torch" not in sys.modules, (
        "--pristine must take effect before torch is imported"
    )
    spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no torch installed for this interpreter")
    torch_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    state = torch_dir / STATE_DIR
    manifest_path = state / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(
            f"the overlay is not applied to {torch_dir}: no {manifest_path}"
        )
    manifest = json.loads(manifest_path.read_text())
    site = torch_dir.parent
    modules: dict[str, tuple[Path, Path, bytes, bool]] = {}
    for rel, shas in manifest["files"].items():
        pristine = state / "pristine" / rel
        source = pristine.read_bytes()
        if hashlib.sha256(source).hexdigest() != shas["pristine"]:
            raise SystemExit(f"the pristine copy of {rel} does not match the manifest")
        parts = rel[: -len(".py")].split("/")
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        real = site / rel
        modules[".".join(parts)] = (real, pristine, source, is_package)
        # Tracebacks and inspect read the code that runs, not the patched file on disk
        # (an entry without an mtime is never invalidated by linecache.checkcache).
        lines = source.decode().splitlines(keepends=True)
        linecache.cache[str(real)] = (len(source), None, lines, str(real))
    finder = _PristineFinder(modules)
    sys.meta_path.insert(0, finder)
    _hide_links(site, manifest["links"])
    return finder


def _hide_links(site: Path, links: list[str]) -> None:
    """Hide the overlay's new files from directory listings: upstream imports every
    module of torch/_inductor/kernel/ it finds there (lowering.py's
    ``import_submodule(kernel)``), so upstream exactly is upstream without them."""
    hidden: dict[str, set[str]] = {}
    for rel in links:
        path = site / rel
        hidden.setdefault(os.path.realpath(path.parent), set()).add(path.name)
    listdir = os.listdir

    def pristine_listdir(path: Any = ".") -> list:
        names = listdir(path)
        if isinstance(path, int):
            return names
        drop = hidden.get(os.path.realpath(os.fsdecode(path)))
        if not drop:
            return names
        return [n for n in names if os.fsdecode(n) not in drop]

    os.listdir = pristine_listdir


if os.environ.get("PYTHONHASHSEED") != "0" and __name__ == "__main__":
    # Sets of symbols iterate in hash order, which orders the symbolic arguments of
    # generated code: one seed for both modes, so that only the code differs.
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

PRISTINE = "--pristine" in sys.argv[1:]
FINDER = install_pristine_finder() if PRISTINE else None
# A fresh Inductor cache for the whole process, before torch reads it; each scenario
# then runs in a fresh cache below it.
CACHE_ROOT = tempfile.mkdtemp(prefix="noncollective_probe_")
atexit.register(shutil.rmtree, CACHE_ROOT, ignore_errors=True)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(CACHE_ROOT, "inductor")
os.environ.pop("TORCHINDUCTOR_MAX_AUTOTUNE", None)
# One thread: an OpenMP barrier on a busy 2-core machine costs milliseconds, as much as
# the sleeps that make the winners clear.
os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch._inductor.select_algorithm as select_algorithm
from torch._dynamo.utils import counters
from torch._functorch import aot_autograd
from torch._inductor.kernel.custom_op import (
    CustomOpConfig,
    register_custom_op_autotuning,
)
from torch._inductor.codegen.subgraph import SubgraphTemplate
from torch._inductor.utils import fresh_cache, run_and_get_code

if FINDER is not None:
    for name in FINDER.modules:
        assert name in FINDER.served or name not in sys.modules, name


# -- helpers the implementations call: costs that a busy CPU cannot reorder -----------


@torch.library.custom_op("ncprobe::sleep_us", mutates_args=())
def sleep_us(x: torch.Tensor, us: int) -> torch.Tensor:
    time.sleep(us / 1e6)
    return x.clone()


@sleep_us.register_fake
def _(x: torch.Tensor, us: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("ncprobe::sleep_rows", mutates_args=())
def sleep_rows(x: torch.Tensor, free_rows: int, us_per_row: int) -> torch.Tensor:
    """Free up to ``free_rows`` rows of ``x``, then ``us_per_row`` for each further one."""
    extra = max(0, x.shape[0] - free_rows)
    if extra:
        time.sleep(extra * us_per_row / 1e6)
    return x.clone()


@sleep_rows.register_fake
def _(x: torch.Tensor, free_rows: int, us_per_row: int) -> torch.Tensor:
    return torch.empty_like(x)


def define_op(scenario: str, eager_sleep_us: int) -> Any:
    """The scenario's op: ``2 * x``, whose own (eager) implementation is slow."""

    @torch.library.custom_op(f"ncprobe_{scenario}::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        time.sleep(eager_sleep_us / 1e6)
        return x * 2

    @double.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return double


# The implementations: each computes 2 * x.


def double_by_mul(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def double_after_sleep(x: torch.Tensor, delay_us: int = 2000) -> torch.Tensor:
    return torch.ops.ncprobe.sleep_us(x, delay_us) * 2


def double_by_add_after_rows(x: torch.Tensor) -> torch.Tensor:
    # Free up to 64 rows, then 40 us a row (38 ms at 1024 rows).
    y = torch.ops.ncprobe.sleep_rows(x, 64, 40)
    return y + y


def double_after_1ms(x: torch.Tensor) -> torch.Tensor:
    # No config parameters: on 2.11 a parameter becomes a non-tensor operand of the
    # range dispatch's torch.cond, which 2.11's cond lowering refuses (an upstream
    # limitation that is not this test's concern).
    return torch.ops.ncprobe.sleep_us(x, 1000) * 2


def double_needs_capability(x: torch.Tensor) -> torch.Tensor:
    # What a capability check does when the build lacks it: raise while traced.
    raise NotImplementedError(
        "double_needs_capability: this build lacks the capability"
    )


# -- scenarios ------------------------------------------------------------------------


class Scenario:
    """``setup()`` registers the op and returns (fn, example calls, compile kwargs)."""

    def __init__(
        self, name: str, setup: Callable[[], tuple[Callable, list[tuple], dict]]
    ):
        self.name = name
        self.setup = setup


def _registered(name: str, *configs: CustomOpConfig) -> Callable:
    """A fresh op ``name`` (its own implementation sleeps 3 ms) tuned over ``configs``."""
    op = define_op(name, eager_sleep_us=3000)
    register_custom_op_autotuning(op, configs=list(configs))
    return op


def _double_or_sleep(name: str, *more: CustomOpConfig) -> Callable:
    return _registered(
        name,
        CustomOpConfig(double_by_mul),
        *more,
        CustomOpConfig(double_after_sleep, delay_us=2000),
    )


def _static() -> tuple[Callable, list[tuple], dict]:
    op = _double_or_sleep("static")
    return (lambda x: op(x) + 1), [(torch.randn(64, 32),)], {"dynamic": False}


def _pointwise_input() -> tuple[Callable, list[tuple], dict]:
    op = _double_or_sleep("pointwise_input")
    fn = lambda x, w: op(torch.relu(x @ w)) + 1  # noqa: E731
    return fn, [(torch.randn(64, 16), torch.randn(16, 32))], {"dynamic": False}


def _raises_while_traced() -> tuple[Callable, list[tuple], dict]:
    op = _double_or_sleep(
        "raises_while_traced", CustomOpConfig(double_needs_capability)
    )
    return (lambda x: op(x) + 1), [(torch.randn(64, 32),)], {"dynamic": False}


def _one_config() -> tuple[Callable, list[tuple], dict]:
    op = define_op("one_config", eager_sleep_us=100)
    register_custom_op_autotuning(op, configs=[CustomOpConfig(double_needs_capability)])

    def fn(x):
        return op(x) + 1

    return fn, [(torch.randn(64, 32),)], {"dynamic": False}


def _dynamic() -> tuple[Callable, list[tuple], dict]:
    # Upstream's range-based lowering: one autotuning per range, each at the top of its
    # range ([1, 64] at 64 rows, [65, inf) at range_upper_bound rows). The winners differ
    # (rows: ~us at 64 rows, 38 ms at 1024; sleep: ~1 ms; the op itself: 30 ms), so
    # the compiled code dispatches by size.
    op = define_op("dynamic", eager_sleep_us=30000)
    register_custom_op_autotuning(
        op,
        configs=[
            CustomOpConfig(double_by_add_after_rows),
            CustomOpConfig(double_after_1ms),
        ],
        dispatch_on={"tensor_name": "x", "dim": 0, "range_upper_bound": 1024},
        split_points=[64],
    )

    def fn(x):
        return op(x) + 1

    return fn, [(torch.randn(48, 32),), (torch.randn(100, 32),)], {"dynamic": True}


def _dynamic_standard() -> tuple[Callable, list[tuple], dict]:
    # A dynamic size without dispatch_on: upstream's standard lowering, at the size hint.
    op = define_op("dynamic_standard", eager_sleep_us=3000)
    register_custom_op_autotuning(
        op,
        configs=[
            CustomOpConfig(double_by_mul),
            CustomOpConfig(double_after_sleep, delay_us=2000),
        ],
    )

    def fn(x):
        return op(x) + 1

    return fn, [(torch.randn(48, 32),), (torch.randn(100, 32),)], {"dynamic": True}


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("static", _static),
        Scenario("pointwise_input", _pointwise_input),
        Scenario("raises_while_traced", _raises_while_traced),
        Scenario("one_config", _one_config),
        Scenario("dynamic", _dynamic),
        Scenario("dynamic_standard", _dynamic_standard),
    ]
}


# -- what each scenario reports -------------------------------------------------------


def _choice_name(choice: Any) -> str:
    return str(getattr(choice, "name", None) or type(choice).__name__)


class _Recorder:
    """The autotuning calls (feedback savers), and each choice benchmarked."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.benchmarked: list[str] = []

    def feedback(self, timings, name, input_nodes, choices, *rest) -> None:
        finite = {c: t for c, t in timings.items() if t == t and t != float("inf")}
        winner = min(finite, key=finite.get) if finite else None
        ranked = sorted(finite.values())
        self.calls.append(
            {
                "name": name,
                "choices": [_choice_name(c) for c in choices],
                "timed": sorted(_choice_name(c) for c in timings),
                "failed": sorted(_choice_name(c) for c in timings if c not in finite),
                "winner": None if winner is None else _choice_name(winner),
                # How clear the win was (not compared: timings vary from run to run).
                "margin": None
                if len(ranked) < 2 or ranked[0] <= 0
                else ranked[1] / ranked[0],
                "ms": {_choice_name(c): t for c, t in timings.items()},
            }
        )


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
# Kernel files are named by a hash of their contents and of the torch install.
_KERNEL_PATH = re.compile(r"<CACHE>/[\w/.-]+")


def normalize(code: str, cache_dirs: list[str]) -> str:
    for d in sorted({d for d in cache_dirs if d}, key=len, reverse=True):
        code = code.replace(d, "<CACHE>")
    code = code.replace(CACHE_ROOT, "<CACHE>")
    code = code.replace(tempfile.gettempdir(), "<TMP>")
    code = _ADDRESS.sub("0xADDR", code)
    return _KERNEL_PATH.sub("<CACHE>/<kernel>", code)


def _error(e: BaseException) -> dict[str, str]:
    root = e
    seen = {id(root)}
    while (root.__cause__ or root.__context__) is not None:
        nxt = root.__cause__ or root.__context__
        if id(nxt) in seen:
            break
        seen.add(id(nxt))
        root = nxt
    first = (str(root).strip().splitlines() or [""])[0]
    return {
        "type": type(e).__name__,
        "root_type": type(root).__name__,
        "root_message": first[:300],
    }


RELEVANT_COUNTER = re.compile(r"select_algorithm|custom_op|autotun|benchmark")


def run_scenario(name: str) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    recorder = _Recorder()
    report: dict[str, Any] = {"ok": False, "error": None}
    torch._dynamo.reset()
    counters.clear()
    # Choice names end in a process-wide counter: each scenario starts it afresh, as a
    # process of its own would.
    SubgraphTemplate.index_counter = itertools.count()
    aot_autograd.AOT_COUNTER = itertools.count()  # the generated code's "AOT ID"
    original_benchmark_choice = select_algorithm.AlgorithmSelectorCache.__dict__[
        "benchmark_choice"
    ]

    def benchmark_choice(cls, choice, autotune_args):
        recorder.benchmarked.append(_choice_name(choice))
        return original_benchmark_choice.__func__(cls, choice, autotune_args)

    select_algorithm.AlgorithmSelectorCache.benchmark_choice = classmethod(
        benchmark_choice
    )
    cache_dirs = [os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")]
    try:
        with fresh_cache(dir=CACHE_ROOT):
            cache_dirs.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
            cache_dirs.append(os.environ.get("TRITON_CACHE_DIR", ""))
            select_algorithm.add_feedback_saver(recorder.feedback)
            try:
                torch.manual_seed(0)
                fn, calls, compile_kwargs = scenario.setup()
                compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)
                outputs = []
                codes: list[str] = []
                for args in calls:
                    out, code = run_and_get_code(compiled, *args)
                    outputs.append((out, fn(*args)))
                    codes.extend(code)
                report["ok"] = True
                report["code"] = [normalize(c, cache_dirs) for c in codes]
                diffs = [float((o - e).abs().max()) for o, e in outputs]
                report["result"] = {
                    "matches_eager": all(
                        torch.allclose(o, e, rtol=1e-4, atol=1e-4) for o, e in outputs
                    ),
                    "shapes": [list(o.shape) for o, _ in outputs],
                }
                report["max_abs_diff"] = max(diffs)  # not compared: float noise
            except Exception as e:
                report["error"] = _error(e)
                report["traceback_tail"] = traceback.format_exc()[-3000:]
            finally:
                select_algorithm.clear_feedback_savers()
    finally:
        select_algorithm.AlgorithmSelectorCache.benchmark_choice = (
            original_benchmark_choice
        )
    report["autotune_calls"] = recorder.calls
    report["autotune_call_count"] = len(recorder.calls)
    report["benchmarked"] = recorder.benchmarked
    report["winners"] = [c["winner"] for c in recorder.calls]
    report["counters"] = {
        k: v
        for k, v in sorted(counters["inductor"].items())
        if RELEVANT_COUNTER.search(k)
    }
    return report


def main(argv: list[str]) -> int:
    names = [n for a in argv if not a.startswith("--") for n in a.split(",") if n]
    if not names or any(n not in SCENARIOS for n in names):
        print(
            f"usage: noncollective_probe.py SCENARIO[,...] [--pristine]; scenarios: {', '.join(SCENARIOS)}"
        )
        return 2
    results = {}
    for name in names:
        start = time.monotonic()
        results[name] = run_scenario(name)
        results[name]["seconds"] = round(time.monotonic() - start, 1)  # not compared
    collective = sorted(
        m
        for m in sys.modules
        if m.startswith(
            (
                "torch._inductor.kernel.collective.",
                "torch._inductor.runtime.collective_",
                "torch.distributed._store_session",
            )
        )
    )
    if PRISTINE:
        # Upstream exactly: the overlay's modules are linked in, and nothing reached them.
        assert not collective, (
            f"pristine mode imported the overlay's modules: {collective}"
        )
        served = sorted(FINDER.served)
        unserved = sorted(set(FINDER.modules) - set(FINDER.served) - set(sys.modules))
    else:
        served, unserved = [], []
    print(
        MARKER
        + json.dumps(
            {
                "mode": "pristine" if PRISTINE else "overlay",
                "torch": torch.__version__,
                "scenarios": results,
                "collective_modules": collective,
                "pristine_served": served,
                "pristine_not_imported": unserved,
            },
            sort_keys=True,
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
