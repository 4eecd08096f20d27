"""Timing collective custom-op choices in lockstep on every rank of a process group.

A collective step is as slow as its slowest participant, and collectives of 5-50 us
are easily swamped by how far apart the ranks start and by launch gaps. So each
sample here starts after a barrier on the op's own group and a device sync, and
times a batch of back-to-back calls (or the replay of a captured CUDA graph of such a
batch) sized so that skew and launch gaps are a small part of it. Per-rank medians
are reduced with MAX in one all-reduce of the whole vector, so every rank holds the
same numbers and so the same winner.

Device work happens only after the group agreed to benchmark (collective_protocol);
every step that can fail ends in a vote, so a choice that fails on any rank is
infinite on all of them, and a rank that cannot take part any more turns into one
CollectiveAutotuneError on every rank within the session's deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, TYPE_CHECKING

import torch

from .collective_protocol import CollectiveAutotuneError, Deadline


if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .collective_protocol import CollectiveSession


log = logging.getLogger(__name__)

# Namespaces whose every op (but waiting) communicates.
_COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "_c10d_functional_autograd", "c10d", "symm_mem"}
)
_NON_COLLECTIVE_OPS = frozenset({"wait_tensor", "wait"})
# Words that name a collective inside an opaque op whose graph hides its communication.
_COLLECTIVE_WORDS = (
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "reducescatter",
    "all_to_all",
    "alltoall",
    "broadcast",
)
# An upper bound on calls per sample, whatever the warm-up estimate says.
_MAX_CALLS_PER_SAMPLE = 1024
# Relative tolerance of the correctness screen by dtype; summation order differs
# between implementations (ring, one-shot, two-shot), and more so at low precision.
_SCREEN_TOLERANCE = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}
BENCHMARK_MODES = ("auto", "eager", "graph")
# Errors that mean the communication itself broke, not the choice's own code.
_COMMUNICATION_FAILURE = re.compile(
    r"timed out|timeout|connection (reset|closed|refused)|closed by peer|"
    r"broken pipe|nccl error|ncclRemoteError|watchdog",
    re.IGNORECASE,
)
# How often a rank waiting on its device looks for an abort of its session.
_STORE_CHECK_INTERVAL_S = 0.05


def _op_namespace_and_name(op: Any) -> tuple[str, str]:
    if isinstance(op, torch._ops.OpOverload):
        return op.namespace, op._opname
    # "torch.ops.ns.name.overload", "ns::name" or "ns.name.overload"
    text = str(op).removeprefix("torch.ops.").replace("::", ".")
    parts = text.split(".")
    return (parts[0], parts[1]) if len(parts) >= 2 else ("", text)


def is_collective_op(op: Any) -> bool:
    """Whether ``op`` (an OpOverload or its name) communicates across ranks.

    Every op of the functional, legacy c10d and symmetric-memory namespaces counts,
    waits excepted; any other op counts when its name says it is a collective, so
    that an opaque custom op hiding its communication is still recognised.
    """
    namespace, name = _op_namespace_and_name(op)
    if namespace in _COLLECTIVE_NAMESPACES:
        return name not in _NON_COLLECTIVE_OPS
    lowered = name.lower()
    return any(word in lowered for word in _COLLECTIVE_WORDS)


def uses_symmetric_memory(op: Any) -> bool:
    """Whether ``op`` needs its input in symmetric memory of its group."""
    return _op_namespace_and_name(op)[0] == "symm_mem"


@dataclasses.dataclass(frozen=True)
class BenchmarkSettings:
    """The collective benchmarking knobs of torch._inductor.config, validated."""

    nruns: int
    warmup: int
    timeout: float
    sample_us: float
    mode: str

    @staticmethod
    def from_config() -> BenchmarkSettings:
        from torch._inductor import config

        settings = BenchmarkSettings(
            nruns=config.collective_benchmark_nruns,
            warmup=config.collective_benchmark_warmup,
            timeout=config.collective_benchmark_timeout,
            sample_us=config.collective_benchmark_sample_us,
            mode=config.collective_benchmark_mode,
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        problems = []
        if not (isinstance(self.nruns, int) and self.nruns >= 1):
            problems.append(f"collective_benchmark_nruns={self.nruns!r}: an int >= 1")
        if not (isinstance(self.warmup, int) and self.warmup >= 1):
            problems.append(f"collective_benchmark_warmup={self.warmup!r}: an int >= 1")
        if not (_is_number(self.timeout) and self.timeout > 0):
            problems.append(
                f"collective_benchmark_timeout={self.timeout!r}: seconds, > 0"
            )
        if not (_is_number(self.sample_us) and self.sample_us > 0):
            problems.append(
                f"collective_benchmark_sample_us={self.sample_us!r}: microseconds, > 0"
            )
        if self.mode not in BENCHMARK_MODES:
            problems.append(
                f"collective_benchmark_mode={self.mode!r}: one of {BENCHMARK_MODES}"
            )
        if problems:
            raise ValueError(
                "invalid collective autotuning configuration (torch._inductor.config "
                "or its TORCHINDUCTOR_* variable); expected "
                + "; ".join(problems)
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One choice to time. ``run`` performs one call and returns its output."""

    name: str
    run: Callable[[], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ChoiceTiming:
    """A choice's result, identical on every rank of the group."""

    name: str
    # Per-call time of the slowest and of the fastest rank, in microseconds
    # (each rank's median over samples); inf when the choice was dropped.
    max_us: float
    min_us: float
    calls_per_sample: int
    # "ok", or why the choice was dropped on every rank.
    status: str


class CollectiveBenchmarker:
    """Times choices of one collective op on every rank of ``process_group``.

    All ranks of the group must call :meth:`benchmark` with the same candidates in
    the same order, after their session decided to benchmark.
    """

    def __init__(
        self,
        process_group: ProcessGroup,
        device: torch.device,
        settings: BenchmarkSettings,
        session: CollectiveSession,
    ) -> None:
        self.process_group = process_group
        self.settings = settings
        self.session = session
        # The current device, never one derived from the rank.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device.type == "cuda"
            else device
        )
        self.use_graphs = self.device.type == "cuda" and (
            settings.mode == "graph"
            or (settings.mode == "auto" and _model_runs_under_cuda_graphs())
        )
        self._flag = torch.zeros(1, device=self._comm_device())

    # -- public -----------------------------------------------------------------

    def benchmark(
        self,
        candidates: Sequence[Candidate],
        reset_inputs: Callable[[], None],
        reference: int = 0,
    ) -> list[ChoiceTiming]:
        """Screen, warm up and time ``candidates``; identical result on every rank.

        ``candidates[reference]`` (the op's default implementation) runs first and is
        the reference of the correctness screen: every other candidate must
        reproduce its output on the same inputs, restored by ``reset_inputs`` before
        each screened call, or it is dropped on every rank.
        """
        try:
            with _bounded_group_timeout(self.process_group, self.settings.timeout):
                status, estimates = self._screen_and_warm_up(
                    candidates, reset_inputs, reference
                )
                calls = self._calls_per_sample(estimates)
                replays = self._capture_graphs(candidates, status, calls)
                samples = self._sample(candidates, status, calls, replays)
                return self._reduce(candidates, status, calls, samples)
        except CollectiveAutotuneError as e:
            # Peers may wait on this rank in a vote or a device sync: release them.
            self.session.abort(str(e))
            raise

    # -- steps ------------------------------------------------------------------

    def _screen_and_warm_up(
        self,
        candidates: Sequence[Candidate],
        reset_inputs: Callable[[], None],
        reference_index: int,
    ) -> tuple[list[str], list[float]]:
        status = [""] * len(candidates)
        estimates = [math.inf] * len(candidates)
        reference: Optional[torch.Tensor] = None
        order = [reference_index] + [
            i for i in range(len(candidates)) if i != reference_index
        ]
        for i in order:
            candidate = candidates[i]
            topic = f"screen/{candidate.name}"
            out: Optional[torch.Tensor] = None
            try:
                self._barrier(topic)
                reset_inputs()
                out = candidate.run()
                if isinstance(out, torch.Tensor):
                    # Later calls may write the same buffer (out variants, in-place ops).
                    out = out.detach().clone()
                self._device_sync(topic)
                outcome = "ok" if reference is None else _screen(out, reference)
                if outcome == "ok":
                    estimates[i] = self._time_calls(
                        candidate.run, self.settings.warmup, topic, candidate.run
                    )
            except CollectiveAutotuneError:
                raise
            except Exception as e:  # noqa: BLE001 - any local failure drops the choice
                outcome = self._failure(topic, e)
                log.debug("choice %s failed on this rank", candidate.name, exc_info=True)
            reports = self.session.vote(topic, outcome)
            status[i] = "ok" if all(r == "ok" for r in reports) else _describe(reports)
            if status[i] != "ok":
                estimates[i] = math.inf
            elif reference is None:
                # The first choice that ran everywhere is the reference on every rank.
                reference = out
        return status, estimates

    def _calls_per_sample(self, estimates: list[float]) -> list[int]:
        # One all-reduce, so that every rank issues the same number of calls.
        slowest = self._all_reduce_max(estimates)
        return [
            max(1, min(_MAX_CALLS_PER_SAMPLE, math.ceil(self.settings.sample_us / est)))
            if math.isfinite(est) and est > 0
            else 1
            for est in slowest
        ]

    def _capture_graphs(
        self, candidates: Sequence[Candidate], status: list[str], calls: list[int]
    ) -> list[Optional[Callable[[], None]]]:
        """CUDA graphs of each batch, used only where every rank captured."""
        replays: list[Optional[Callable[[], None]]] = [None] * len(candidates)
        if not self.use_graphs:
            return replays
        for i, candidate in enumerate(candidates):
            if status[i] != "ok":
                continue
            topic = f"capture/{candidate.name}"
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    for _ in range(calls[i]):
                        candidate.run()
                outcome = "ok"
            except Exception as e:  # noqa: BLE001
                outcome = self._failure(topic, e)
            if all(o == "ok" for o in self.session.vote(topic, outcome)):
                replays[i] = graph.replay
            else:
                log.warning(
                    "choice %s could not be captured in a CUDA graph on every rank; "
                    "timing it eagerly on all ranks",
                    candidate.name,
                )
        return replays

    def _sample(
        self,
        candidates: Sequence[Candidate],
        status: list[str],
        calls: list[int],
        replays: list[Optional[Callable[[], None]]],
    ) -> list[list[float]]:
        samples: list[list[float]] = [[] for _ in candidates]
        live = [i for i, s in enumerate(status) if s == "ok"]
        outcome = "ok"
        try:
            # Rounds interleave the choices so that drift (clocks, other jobs)
            # spreads over all of them instead of favouring one.
            for _ in range(self.settings.nruns):
                for i in live:
                    run, replay = candidates[i].run, replays[i]
                    if replay is not None:
                        samples[i].append(self._time_calls(replay, 1, "timing", run) / calls[i])
                    else:
                        samples[i].append(self._time_calls(run, calls[i], "timing", run))
        except CollectiveAutotuneError:
            raise
        except Exception as e:  # noqa: BLE001
            outcome = self._failure("timing", e)
        reports = self.session.vote("timing", outcome)
        if any(r != "ok" for r in reports):
            # Peers may have been inside a collective of the failed call: the group's
            # collectives cannot be trusted any more, so nobody goes on.
            raise CollectiveAutotuneError(
                f"a choice failed while being timed: {_describe(reports)}"
            )
        return samples

    def _reduce(
        self,
        candidates: Sequence[Candidate],
        status: list[str],
        calls: list[int],
        samples: list[list[float]],
    ) -> list[ChoiceTiming]:
        medians = [statistics.median(s) if s else math.inf for s in samples]
        # One MAX all-reduce gives both the slowest (max t) and fastest (-max -t) rank.
        reduced = self._all_reduce_max(medians + [-t for t in medians])
        n = len(candidates)
        return [
            ChoiceTiming(
                name=c.name,
                max_us=reduced[i],
                min_us=-reduced[n + i] if math.isfinite(reduced[i]) else math.inf,
                calls_per_sample=calls[i],
                status=status[i],
            )
            for i, c in enumerate(candidates)
        ]

    # -- primitives -------------------------------------------------------------

    def _failure(self, topic: str, error: Exception) -> str:
        """This rank's outcome for a step that raised ``error``.

        A failure of the communication itself (a timed-out or broken collective)
        leaves peers inside a collective that will never complete: nothing can be
        trusted any more, so it raises instead of dropping the choice.
        """
        text = f"{type(error).__name__}: {error}".replace("\n", " ")[:500]
        if _COMMUNICATION_FAILURE.search(text):
            raise CollectiveAutotuneError(
                f"{topic}: the group's collectives failed on this rank ({text}); "
                f"reports from the group so far: {self.session.peer_reports(topic)}"
            ) from error
        return f"failed: {text}"

    def _time_calls(
        self, fn: Callable[[], Any], count: int, topic: str, rendezvous: Callable[[], Any]
    ) -> float:
        """Microseconds per call of ``count`` back-to-back calls of ``fn``.

        On GPUs the ranks leave the barrier apart by host skew comparable to a
        microsecond collective; one untimed ``rendezvous`` call (a collective of the
        choice itself) waits for the last rank, so the timed calls start together.
        A gloo collective blocks the host, so on the CPU the barrier aligns ranks to
        well within a millisecond collective, and each rank's own cost stays its own.
        """
        self._barrier(topic)
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            rendezvous()
            start.record()
            for _ in range(count):
                fn()
            end.record()
            self._device_sync(topic, end)
            return start.elapsed_time(end) * 1e3 / count
        begin = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - begin) * 1e6 / count

    def _barrier(self, topic: str) -> None:
        """All ranks of the group have arrived and the device is idle."""
        import torch.distributed as dist

        dist.all_reduce(self._flag, group=self.process_group)
        self._device_sync(topic)

    def _device_sync(self, topic: str, event: Optional[torch.cuda.Event] = None) -> None:
        """Wait for the device, at most ``timeout``, and stop if some rank aborted.

        On the CPU the collectives themselves block, bounded by the group timeout.
        """
        if self.device.type != "cuda":
            return
        if event is None:
            event = torch.cuda.Event()
            event.record()
        deadline = Deadline(self.settings.timeout)
        next_store_check = time.monotonic() + _STORE_CHECK_INTERVAL_S
        while not event.query():
            now = time.monotonic()
            if deadline.expired():
                raise CollectiveAutotuneError(
                    f"{topic}: device work did not finish within "
                    f"{self.settings.timeout:g} s (collective_benchmark_timeout); "
                    f"reports from the group: {self.session.peer_reports(topic)}"
                )
            if now >= next_store_check:
                self.session.check_abort()
                next_store_check = now + _STORE_CHECK_INTERVAL_S

    def _all_reduce_max(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.process_group)
        return tensor.tolist()

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def _screen(out: Any, reference: torch.Tensor) -> str:
    if not isinstance(out, torch.Tensor):
        return f"rejected: returned {type(out).__name__}, not a tensor"
    if out.shape != reference.shape or out.dtype != reference.dtype:
        return (
            f"rejected: output {tuple(out.shape)} {out.dtype} differs from the "
            f"reference's {tuple(reference.shape)} {reference.dtype}"
        )
    tol = _SCREEN_TOLERANCE.get(out.dtype, 0.0)
    scale = max(1.0, reference.abs().max().item()) if reference.numel() else 1.0
    if not torch.allclose(out, reference, rtol=tol, atol=tol * scale):
        err = (out.double() - reference.double()).abs().max().item()
        return f"rejected: output differs from the reference (max abs error {err:.3g})"
    return "ok"


def _describe(reports: list[str]) -> str:
    """The group ranks' reports that are not "ok", one clause each."""
    return "; ".join(f"group rank {r}: {o}" for r, o in enumerate(reports) if o != "ok")


def _model_runs_under_cuda_graphs() -> bool:
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


class _bounded_group_timeout:
    """Within the block, a collective of ``group`` that waits longer than
    ``seconds`` fails instead of hanging (gloo raises; NCCL's watchdog aborts)."""

    def __init__(self, group: ProcessGroup, seconds: float) -> None:
        self.group = group
        self.timeout = timedelta(seconds=seconds)
        self.saved: Optional[timedelta] = None

    def __enter__(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.saved = _group_timeout(self.group)
        if self.saved is not None:
            c10d._set_pg_timeout(self.timeout, self.group)

    def __exit__(self, *exc: object) -> None:
        from torch.distributed import distributed_c10d as c10d

        if self.saved is not None:
            c10d._set_pg_timeout(self.saved, self.group)


def _group_timeout(group: ProcessGroup) -> Optional[timedelta]:
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    return None
