"""Run a test body on every rank of a real process group, in one of two ways.

* Plain ``pytest``: the harness spawns one process per rank, each with a real gloo
  (and, on GPUs, NCCL) process group, waits a bounded time and kills stragglers, so
  a hang is a test failure, never a stuck CI job.
* ``torchrun --nproc_per_node=N -m pytest``: every rank runs pytest; a test whose
  world size is N runs its body in-process on each rank, and skips otherwise.

Either way the test receives every rank's result and asserts on all of them.
Also here: the small helpers that test bodies share.

Why not upstream's ``MultiProcessTestCase``: it always spawns (or forks) its own
processes from the test process and builds the group in each, so under ``torchrun``
every rank of the job would spawn a world of its own, and a test could never run on
the job's real ranks (its rendezvous, its Store, torchrun's environment), which is
what ``make test`` checks with 2 and 4 ranks. ``run_ranks`` runs the same body either
way, from the test methods of ordinary ``TestCase`` classes; skips are raised as
``unittest.SkipTest``, which both ``run_tests()`` and pytest report as skips.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import functools
import multiprocessing
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
import unittest
from unittest import mock
from datetime import timedelta
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch._inductor.kernel.collective.api import collective_autotune_records
from torch._inductor.utils import clear_caches
from torch.testing._internal.common_utils import subtest, TestCase


# For code that runs outside a test method (a rank's body, a helper it calls):
# check.assertEqual(...) and the rest, as a test method's self.assertEqual(...).
check = TestCase()


class CollectiveTestCase(TestCase):
    """A test case with an empty folder of its own, ``self.tmp_path``, for the caches
    and decisions its ranks keep (removed after the test)."""

    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory(
            prefix="collective_test_", ignore_cleanup_errors=True
        )
        self.addCleanup(tmp.cleanup)
        self.tmp_path = Path(tmp.name)


@dataclasses.dataclass
class Rank:
    """What a test body sees."""

    rank: int
    world_size: int
    device: torch.device
    # The group of every rank that the test's ops run on: WORLD when self-spawned.
    # Under torchrun one process runs every test over one store, and some scenarios
    # leave an op's sessions shifted on purpose (a rank tunes an op its peer never
    # compiles), so each test gets a group, and store keys, of its own.
    group: dist.ProcessGroup


@dataclasses.dataclass
class RankResult:
    rank: int
    value: Any = None
    # The formatted exception when the body raised; None when it returned.
    error: str | None = None
    # Seconds the body ran, or None when the process died without reporting.
    wall_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.wall_s is not None


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def single_process(test: Any) -> Any:
    """Marks a test of a rank-test file that runs no rank body: under torchrun every
    rank would run it again, side by side, so it skips there and runs once outside."""
    return unittest.skipIf(
        under_torchrun(), "uses no rank: runs once, outside torchrun"
    )(test)


def run_ranks(
    world_size: int,
    body: Callable[..., Any],
    *args: Any,
    device: str = "cpu",
    env: dict[str, str] | None = None,
    timeout_s: float = 240.0,
    breaks_the_group: bool = False,
    restarts: bool = False,
    fresh_processes: bool = False,
    timing: Callable[[str, int], float] | str | None = None,
) -> list[RankResult]:
    """``body(Rank, *args)`` on ``world_size`` ranks; every rank's result, by rank.

    The ranks' benchmarks read the costs ``timing`` gives (:func:`given_timings`; by
    default :class:`Costs`: every registered choice alike, the op's own far behind),
    so that what a test checks follows from winners it fixed; ``timing=REAL`` times
    the choices for real, for the tests of the timing itself.

    ``env`` is set on every rank for the body's duration; ``{rank}`` in a value is
    replaced by the rank. Unless ``env`` names one, each rank gets a new Inductor cache
    dir: compiled graphs and stored decisions of other tests (or of a peer rank, on a
    CPU where their cache keys coincide) must not stand in for this test's tuning; its
    compiled kernels are shared (:func:`_share_kernels`). Its decisions are kept in
    that dir as the rank starts (:func:`_decisions_folder`), where a body moves it. Self-spawned ranks that
    outlive ``timeout_s`` are killed and reported as having died. A body that
    ``breaks_the_group`` (a rank dies, a collective is left hanging) only runs
    self-spawned, where the job ends with it, as does one that ``restarts`` a job (a
    second call on the same cache dirs must meet fresh processes and process groups of
    the same names), or that needs ``fresh_processes`` (``env`` read at start-up, such
    as TORCH_TRACE or a config knob, or nothing of ours run before the body).
    """
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise unittest.SkipTest(
            f"needs {world_size} CUDA devices, found {torch.cuda.device_count()}"
        )
    if breaks_the_group and under_torchrun():
        raise unittest.SkipTest("ends the job by design; runs self-spawned only")
    if restarts and under_torchrun():
        raise unittest.SkipTest(
            "restarts the job: needs fresh processes; runs self-spawned only"
        )
    if fresh_processes and under_torchrun():
        raise unittest.SkipTest(
            "needs processes that start with its environment; runs self-spawned only"
        )
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise unittest.SkipTest(f"needs WORLD_SIZE={world_size}")
    timing = Costs() if timing is None else timing
    caches = tempfile.mkdtemp(prefix="collective_test_")
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "{rank}"), **(env or {})}
    try:
        if under_torchrun():
            return _run_in_process(world_size, body, args, device, env, timing)
        return _spawn(world_size, body, args, device, env, timeout_s, timing)
    finally:
        shutil.rmtree(caches, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Given costs of a benchmark's choices (:func:`given_timings`), µs per call
    whatever the size: ``us`` by choice label (a tuple: by global rank, its last value
    for the ranks after), else ``own_us`` for the op's own implementation ("default")
    and ``other_us`` for any other choice; and the host's contention while every
    choice is timed (seconds per second its timing thread waited for a CPU)."""

    us: dict[str, float | tuple[float, ...]] = dataclasses.field(default_factory=dict)
    own_us: float = 1000.0
    other_us: float = 10.0
    host_contention: float = 0.0

    def __call__(self, choice: str, rows: int) -> float:
        value = self.us.get(
            choice, self.own_us if choice == "default" else self.other_us
        )
        if isinstance(value, tuple):
            return value[min(dist.get_rank(), len(value) - 1)]
        return value

    def contention(self, choice: str, rows: int) -> float:
        return self.host_contention


# run_ranks(timing=REAL): the choices are timed for real.
REAL = "real"


@functools.cache
def _shared_kernels() -> str:
    """The kernels this process's tests share (see :func:`_share_kernels`)."""
    path = tempfile.mkdtemp(prefix="collective_test_kernels_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# Inductor keeps what it builds by content hash in two-character folders of its cache
# dir (C++ and Triton kernels, generated modules), named by the hash's second and third
# characters (base32); its build locks sit beside them. A folder of another name stays
# the test's own: built afresh, as before.
_BASE32 = "abcdefghijklmnopqrstuvwxyz234567"
_KERNEL_FOLDERS = [a + b for a in _BASE32 for b in _BASE32]


def _share_kernels(cache_dir: str, kernels: str) -> None:
    """Let the Inductor cache dir ``cache_dir`` build into and load from ``kernels``.

    What a test's tuning must not inherit from other tests (the FX-graph and
    AOTAutograd caches, stored decisions) stays in each rank's own dir; compiled kernels
    are found by their content, so sharing them, as the ranks of a job on one host do,
    changes no decision. Building a test's kernels afresh was more than half its wall
    time on the 2-core CI machine (a two-rank test of one op: 14 s, 6 s with them built).
    """
    os.makedirs(cache_dir, exist_ok=True)
    for name in (*_KERNEL_FOLDERS, "locks"):
        link = os.path.join(cache_dir, name)
        if not os.path.lexists(link):
            os.makedirs(os.path.join(kernels, name), exist_ok=True)
            # Ranks given one dir (as on one host) link it at once: one of them wins.
            with contextlib.suppress(FileExistsError):
                os.symlink(os.path.join(kernels, name), link)


# -- torchrun: this process is one rank ----------------------------------------------


def _run_in_process(
    world_size: int,
    body: Callable[..., Any],
    args: tuple,
    device: str,
    env: dict[str, str],
    timing: Callable[[str, int], float] | str,
) -> list[RankResult]:
    if not dist.is_initialized():
        _init(int(os.environ["RANK"]), world_size, "env://", device)
    rank = dist.get_rank()
    # The world's timeout, not new_group's default (30 minutes): a rank whose test
    # failed before its collectives leaves its peer waiting at most this long.
    group = dist.new_group(list(range(world_size)), timeout=_GROUP_TIMEOUT)
    # What a spawned rank starts without: Dynamo's frames, Inductor's in-memory caches
    # (ours among them: the records, the size paths) and the test ops' notes.
    import collective_ops

    torch._dynamo.reset()
    clear_caches()
    collective_ops.forget_runs()
    env = {k: v.replace("{rank}", str(rank)) for k, v in env.items()}
    _share_kernels(env["TORCHINDUCTOR_CACHE_DIR"], _shared_kernels())
    with (
        environment(env),
        torch._inductor.config.patch(
            collective_autotune_decisions_dir=_decisions_folder(env)
        ),
    ):
        result = _call(rank, world_size, group, body, args, device, timing)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    return gathered


# -- plain pytest: spawn the ranks -----------------------------------------------------


def _spawn(
    world_size: int,
    body: Callable[..., Any],
    args: tuple,
    device: str,
    env: dict[str, str],
    timeout_s: float,
    timing: Callable[[str, int], float] | str,
) -> list[RankResult]:
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                rank,
                world_size,
                port,
                device,
                env,
                _shared_kernels(),
                body,
                args,
                results,
                timeout_s,
                timing,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    # Variables the same on every rank are in the children's environment from the
    # start, so that torch reads those it reads at import (config knobs); per-rank
    # ones ("{rank}") are set by each child before it initialises.
    with environment({k: v for k, v in env.items() if "{rank}" not in v}):
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout_s
    collected: dict[int, RankResult] = {}

    def settled() -> bool:  # every rank reported or died
        return all(
            rank in collected or not p.is_alive() for rank, p in enumerate(procs)
        )

    while not settled() and time.monotonic() < deadline:
        try:
            r = results.get(timeout=0.2)
            collected[r.rank] = r
        except queue.Empty:
            pass
    # What ranks reported just before exiting may still be in the queue.
    while True:
        try:
            r = results.get(timeout=0.5)
            collected[r.rank] = r
        except queue.Empty:
            break
    for p in procs:
        # A rank that reported may still serve the store to its peers (rank 0 hosts
        # it); once all have settled nobody needs it.
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()
    return [
        collected.get(
            rank,
            RankResult(
                rank, error=f"rank died or hung (exit code {procs[rank].exitcode})"
            ),
        )
        for rank in range(world_size)
    ]


DECISIONS_DIR = "TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_DECISIONS_DIR"


def _decisions_folder(env: dict[str, str]) -> str:
    """Where the rank keeps its decisions: under its cache dir of ``env``, as the tests
    find them, unless ``env`` names a folder. By default they are kept in one folder of
    the host (collective_decisions.decisions_dir), which every test would share; a
    body that moves TORCHINDUCTOR_CACHE_DIR (an engine) keeps them where they were."""
    return env.get(DECISIONS_DIR) or os.path.join(
        env["TORCHINDUCTOR_CACHE_DIR"], "collective_autotuning", "decisions"
    )


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set for the block, each variable restored (or removed) after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    env: dict[str, str],
    kernels: str,
    body: Callable[..., Any],
    args: tuple,
    results: multiprocessing.Queue,
    timeout_s: float,
    timing: Callable[[str, int], float] | str,
) -> None:
    env = {k: v.replace("{rank}", str(rank)) for k, v in env.items()}
    os.environ.update(env)
    torch._inductor.config.collective_autotune_decisions_dir = _decisions_folder(env)
    _share_kernels(os.environ["TORCHINDUCTOR_CACHE_DIR"], kernels)
    # A rank still running when the harness kills it says where it was.
    faulthandler.dump_traceback_later(timeout_s - 5, exit=False)
    _init(rank, world_size, f"tcp://127.0.0.1:{port}", device)
    result = _call(rank, world_size, dist.group.WORLD, body, args, device, timing)
    results.put(result)
    # Give the queue's feeder thread time to flush before the process goes away.
    results.close()
    results.join_thread()
    _leave(rank, world_size)
    if result.ok:
        dist.destroy_process_group()
    # Exit without waiting on peers that may be gone (their collectives would hang).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave(rank: int, world_size: int, patience_s: float = 120.0) -> None:
    """Rank 0 hosts the store: it stays until every live rank is done with it."""
    store = dist.distributed_c10d._get_default_store()
    store.add("harness/done", 1)
    if rank != 0:
        return
    deadline = time.monotonic() + patience_s
    while store.add("harness/done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)


# Every rank test's process group times out after this: a test whose ranks part ways
# fails instead of holding the lane.
_GROUP_TIMEOUT = timedelta(seconds=120)


def _init(rank: int, world_size: int, init_method: str, device: str) -> None:
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=_GROUP_TIMEOUT,
    )


def _call(
    rank: int,
    world_size: int,
    group: dist.ProcessGroup,
    body: Callable[..., Any],
    args: tuple,
    device: str,
    timing: Callable[[str, int], float] | str,
) -> RankResult:
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device("cpu")
    )
    given = (
        contextlib.nullcontext()
        if timing == REAL
        else given_timings(timing, getattr(timing, "contention", None))
    )
    start = time.monotonic()
    try:
        with given:
            value = body(Rank(rank, world_size, dev, group), *args)
        return RankResult(rank, value=value, wall_s=time.monotonic() - start)
    except Exception:
        return RankResult(
            rank, error=traceback.format_exc(), wall_s=time.monotonic() - start
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The devices a test runs on, for ``common_utils.parametrize``: CUDA skips without GPUs.
DEVICE_CASES = [
    "cpu",
    subtest(
        "cuda",
        decorators=[unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")],
    ),
]


def short(choice_name: str) -> str:
    """The implementation's name in a choice label ("chunked_all_reduce(chunks=4)")."""
    return choice_name.split("(")[0]


def compile_and_check(fn, *inputs):
    """Compile ``fn``, check it against eager on ``inputs``; the records it made."""
    start = len(collective_autotune_records())
    out = torch.compile(fn, fullgraph=True, dynamic=False)(*inputs)
    torch.testing.assert_close(out, fn(*inputs), rtol=1e-4, atol=1e-4)
    return collective_autotune_records()[start:]


@contextlib.contextmanager
def given_timings(
    cost: Callable[[str, int], float],
    contention: Callable[[str, int], float] | None = None,
) -> Iterator[None]:
    """In the block, every collective benchmark reads ``cost(choice, rows)``
    microseconds per call for each choice (its label, and the rows of the op's first
    input, a ladder range's top size) where it would time a round of samples, and a
    host as contended as ``contention(choice, rows)`` says (0: quiet).

    Everything else is as users run it: the session, its votes and decisions, the
    correctness screen, sizing the samples, the rounds' early stop and the MAX
    all-reduces, the pick and its confidence, the records, disk and caches. So a test
    that checks what follows from a winner fixes the winner itself, whatever the
    host's speed or load; the few tests of the timing itself time for real."""
    from torch._inductor.runtime.collective_benchmarking import CollectiveBenchmarker

    benchmark = CollectiveBenchmarker.benchmark

    def given_benchmark(self, candidates, inputs, *args, **kwargs):
        self._given = ([c.name for c in candidates], inputs.tensors[0].shape[0])
        return benchmark(self, candidates, inputs, *args, **kwargs)

    def given_round(self, batches, live, contended):
        names, rows = self._given
        if contention is not None:
            for i in live:  # a second of samples, waiting that share of it for a CPU
                contended[i]._delay_s += contention(names[i], rows)
                contended[i]._elapsed_s += 1.0
        return {i: float(cost(names[i], rows)) for i in live}, dict.fromkeys(live, 0.0)

    with (
        mock.patch.object(CollectiveBenchmarker, "benchmark", given_benchmark),
        mock.patch.object(CollectiveBenchmarker, "_round", given_round),
    ):
        yield


def costs(
    us: dict[str, float], default_us: float = 1000.0
) -> Callable[[str, int], float]:
    """Given costs that do not depend on the size: ``us`` by choice, ``default_us``
    for the others (the op's own, by default far behind)."""
    return lambda choice, rows: us.get(choice, default_us)


def assert_all_ok(results: list[RankResult]) -> list[Any]:
    """Every rank's value; fails with every rank's error otherwise."""
    failed = [r for r in results if not r.ok]
    check.assertFalse(failed, "\n\n".join(f"rank {r.rank}:\n{r.error}" for r in failed))
    return [r.value for r in results]
