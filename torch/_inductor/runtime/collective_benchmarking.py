"""Timing collective custom-op choices in lockstep on every rank of a process group.

A collective step is as slow as its slowest participant, and collectives of 5-50 us
are easily swamped by how far apart the ranks start and by launch gaps. So every
timed batch here is preceded by an untimed *rendezvous* of the same choice, which
waits for the last rank: the timed calls then start together, and how late each rank
arrived (the rendezvous' spread across the group, reported as ``skew_us``) stays
outside the measurement. What a batch holds depends on how the model runs:

* graph mode (the model runs under CUDA graphs): one captured CUDA graph of the
  choice's calls, sized from the GPU time of its first call. A round enqueues, behind a
  short GPU sleep that lets the host get ahead, ``replay; start; replay; end`` for every
  live choice: the GPU runs them back to back as it runs the model's graph, the first
  replay being the rendezvous.
* eager mode: after a barrier on the group and a device sync, a rendezvous call and
  then back-to-back eager calls, host-paced as the eager model is.
* CPU (gloo): a barrier (which blocks the host) and back-to-back calls on a monotonic
  clock.

Rounds interleave the choices. After a few rounds, one MAX all-reduce of every choice's
quartiles makes the ranks' views identical; a choice whose lower quartile on its
slowest rank is above the leader's upper quartile is dropped, and sampling stops once
the leader is alone, or the rest are within a hair of it, or the round budget is
spent. Per-rank medians are finally reduced with MAX, so every rank holds the same
numbers and so the same winner.

Device work happens only after the group agreed to benchmark (collective_protocol).
Every choice's first call is screened against the reference and the outcomes of all
choices go into one vote: a choice that fails or is rejected everywhere is dropped
everywhere, and one that raises on some ranks only (its peers may have paired its
collectives with another choice's) makes every rank stop with a
CollectiveAutotuneError within the session's deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import re
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, TYPE_CHECKING

import torch

from .collective_protocol import CollectiveAutotuneError, Deadline, liveness


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
# Bounds on calls per eager sample and per captured batch, whatever the estimates say.
_MAX_CALLS_PER_SAMPLE = 1024
# Fewest calls per captured batch: a replay's launch costs a few microseconds, which a
# batch of many calls makes a small part of each call.
_MIN_GRAPH_CALLS = 8
# Rounds before the first comparison across ranks (quartiles need a few samples);
# host-paced eager samples on GPUs jitter more.
_MIN_ROUNDS = 3
_MIN_EAGER_GPU_ROUNDS = 5
# Choices within this fraction of the leader's median are a tie: more samples would
# not change which is faster by a margin that matters.
TIE_FRACTION = 0.02
# A choice is clearly slower when its lower quartile is above the leader's upper
# quartile by at least this fraction: quartiles of a few samples still move.
_DROP_MARGIN = 0.02
# GPU time (us) that the host gets to enqueue a graph round before the GPU reaches it:
# a few launches and event records per choice.
_HOST_LEAD_US = 400.0
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
    graph_sample_us: float
    mode: str

    @staticmethod
    def from_config() -> BenchmarkSettings:
        from torch._inductor import config

        settings = BenchmarkSettings(
            nruns=config.collective_benchmark_nruns,
            warmup=config.collective_benchmark_warmup,
            timeout=config.collective_benchmark_timeout,
            sample_us=config.collective_benchmark_sample_us,
            graph_sample_us=config.collective_benchmark_graph_sample_us,
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
        for knob, value in (
            ("collective_benchmark_sample_us", self.sample_us),
            ("collective_benchmark_graph_sample_us", self.graph_sample_us),
        ):
            if not (_is_number(value) and value > 0):
                problems.append(f"{knob}={value!r}: microseconds, > 0")
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

    def timing_mode(self, device: torch.device) -> str:
        """"graph" or "eager": how the op's choices are timed on ``device``."""
        if device.type != "cuda":
            return "eager"
        if self.mode == "auto":
            return "graph" if _model_runs_under_cuda_graphs() else "eager"
        return self.mode


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
    # Timed samples (fewer than the budget once a choice was clearly slower).
    samples: int = 0
    # How far apart the ranks reached this choice's rendezvous call (median, us).
    skew_us: float = 0.0


@dataclasses.dataclass
class _Batch:
    """How one choice is timed: ``calls`` calls per sample, by ``run`` (or replays)."""

    calls: int
    rendezvous: Callable[[], Any]
    timed: Callable[[], Any]
    graph: bool


class CollectiveBenchmarker:
    """Times choices of one collective op on every rank of ``process_group``.

    All ranks of the group must call :meth:`benchmark` with the same candidates in
    the same order, after their session decided to benchmark. ``device`` is the
    device of the op's own tensors: it is made current while benchmarking, whatever
    device the program left current.
    """

    def __init__(
        self,
        process_group: ProcessGroup,
        device: torch.device,
        settings: BenchmarkSettings,
        session: CollectiveSession,
        mode: Optional[str] = None,
    ) -> None:
        self.process_group = process_group
        self.settings = settings
        self.session = session
        self.device = benchmark_device(device)
        self.mode = mode or settings.timing_mode(self.device)
        self._min_rounds = (
            _MIN_EAGER_GPU_ROUNDS if self.mode == "eager" and self.device.type == "cuda" else _MIN_ROUNDS
        )
        self._flag = torch.zeros(1, device=self._comm_device())

    # -- public -----------------------------------------------------------------

    def benchmark(
        self,
        candidates: Sequence[Candidate],
        reset_inputs: Callable[[], None],
        reference: int = 0,
        keep: Sequence[int] = (),
    ) -> list[ChoiceTiming]:
        """Screen, calibrate and time ``candidates``; identical result on every rank.

        ``candidates[reference]`` (the op's default implementation) runs first and is
        the reference of the correctness screen: every other candidate must
        reproduce its output on the same inputs, restored by ``reset_inputs`` before
        each screened call, or it is dropped on every rank. Candidates in ``keep``
        are timed to the end even when clearly slower (a threshold compares them).
        """
        doing = f"benchmarking {', '.join(c.name for c in candidates)}"
        try:
            with liveness.working(doing), self._on_device(), _bounded_group_timeout(
                self.process_group, self.settings.timeout
            ):
                phases = [time.perf_counter()]
                status, first_call_us = self._screen(candidates, reset_inputs, reference)
                phases.append(time.perf_counter())
                batches = self._prepare_batches(candidates, status, first_call_us)
                phases.append(time.perf_counter())
                samples, skews = self._sample(candidates, batches, set(keep))
                phases.append(time.perf_counter())
                timings = self._reduce(candidates, status, batches, samples, skews)
                phases.append(time.perf_counter())
                ms = [1e3 * (b - a) for a, b in zip(phases, phases[1:])]
                log.info(
                    "timed %d choices (%s) in %.1f ms: screen %.1f, batches %.1f, "
                    "%d rounds %.1f, reduce %.1f",
                    len(candidates), self.mode, sum(ms), ms[0], ms[1],
                    max(len(s) for s in samples), ms[2], ms[3],
                )
                return timings
        except CollectiveAutotuneError as e:
            # Peers may wait on this rank in a vote or a device sync: release them.
            self.session.abort(str(e))
            raise

    # -- steps ------------------------------------------------------------------

    def _screen(
        self,
        candidates: Sequence[Candidate],
        reset_inputs: Callable[[], None],
        reference_index: int,
    ) -> tuple[list[str], list[float]]:
        """Each candidate's status on every rank, and this rank's time of its first call.

        Every candidate runs once on restored inputs, the reference first; the others
        must reproduce the reference's output. One vote carries the outcomes; a rank
        whose candidate raised votes at once (its later collectives would be paired
        with its peers' calls of that candidate), so where every rank raised the group
        drops it and screens the rest, and where only some did, every rank stops.
        """
        status: dict[int, str] = {}
        first_call_us = [math.inf] * len(candidates)
        reference: Optional[torch.Tensor] = None
        remaining = [reference_index] + [i for i in range(len(candidates)) if i != reference_index]
        while remaining:
            topic = f"screen/{len(status)}"
            outcomes: dict[str, str] = {}
            for i in remaining:
                candidate = candidates[i]
                try:
                    self._barrier(topic)
                    reset_inputs()
                    out, first_call_us[i] = self._time_once(
                        candidate.run, topic, f"screening choice {candidate.name}"
                    )
                    outcome = "ok" if reference is None else _screen(out, reference)
                    if reference is None:
                        reference = out
                except CollectiveAutotuneError:
                    raise
                except Exception as e:  # noqa: BLE001 - any local failure drops the choice
                    outcome = self._failure(f"screen/{candidate.name}", e, topic)
                    log.debug("choice %s failed on this rank", candidate.name, exc_info=True)
                outcomes[candidate.name] = outcome
                if outcome.startswith("failed"):
                    break
            reports = [json.loads(r) for r in self.session.vote(topic, json.dumps(outcomes))]
            for i in remaining[: len(outcomes)]:
                name = candidates[i].name
                mine = [r.get(name, "not run: an earlier choice raised") for r in reports]
                if any(o.startswith("failed") for o in mine) and not all(
                    o.startswith("failed") for o in mine
                ):
                    # Its peers were inside its collectives when it raised here: they may
                    # have been paired with another choice's, and cannot be trusted.
                    raise CollectiveAutotuneError(
                        f"choice {name} raised on some ranks of the group only: {_describe(mine)}"
                    )
                status[i] = "ok" if all(o == "ok" for o in mine) else _rejection(mine)
            remaining = remaining[len(outcomes):]
        ordered = [status[i] for i in range(len(candidates))]
        return ordered, [t if s == "ok" else math.inf for t, s in zip(first_call_us, ordered)]

    def _prepare_batches(
        self, candidates: Sequence[Candidate], status: list[str], first_call_us: list[float]
    ) -> list[Optional[_Batch]]:
        live = [i for i, s in enumerate(status) if s == "ok"]
        batches: list[Optional[_Batch]] = [None] * len(candidates)
        if self.mode == "graph":
            # One all-reduce, so that every rank captures as many calls.
            slowest = self._all_reduce_max(first_call_us)
            calls = [_calls(self.settings.graph_sample_us, t, _MIN_GRAPH_CALLS) for t in slowest]
            for i, graph in self._capture(candidates, live, calls).items():
                if graph is not None:
                    batches[i] = _Batch(calls[i], graph.replay, graph.replay, graph=True)
            eager = [i for i in live if batches[i] is None]
            if eager:
                log.warning(
                    "choices %s could not be captured in a CUDA graph on every rank; "
                    "timing them eagerly on all ranks",
                    [candidates[i].name for i in eager],
                )
        else:
            eager = live
        estimates = [math.inf] * len(candidates)
        for i in eager:
            run = candidates[i].run
            estimates[i] = self._time_eager(run, self.settings.warmup, "warmup", run)[0]
        # One all-reduce of the estimates, so that every rank issues as many calls.
        slowest = self._all_reduce_max(estimates)
        for i in eager:
            run = candidates[i].run
            batches[i] = _Batch(_calls(self.settings.sample_us, slowest[i], 1), run, run, graph=False)
        return batches

    def _sample(
        self,
        candidates: Sequence[Candidate],
        batches: list[Optional[_Batch]],
        keep: set[int],
    ) -> tuple[list[list[float]], list[list[float]]]:
        samples: list[list[float]] = [[] for _ in candidates]
        skews: list[list[float]] = [[] for _ in candidates]
        live = [i for i, b in enumerate(batches) if b is not None]
        outcome = "ok"
        rounds = 0
        try:
            while live and rounds < self.settings.nruns:
                times, skew = self._round(batches, live)
                for i in live:
                    samples[i].append(times[i])
                    skews[i].append(skew[i])
                rounds += 1
                if rounds >= self._min_rounds and len(live) > 1:
                    live, settled = self._prune(candidates, samples, live, keep)
                    if settled:
                        break
        except CollectiveAutotuneError:
            raise
        except Exception as e:  # noqa: BLE001
            outcome = self._failure("timing", e, "timing")
        reports = self.session.vote("timing", outcome)
        if any(r != "ok" for r in reports):
            # Peers may have been inside a collective of the failed call: the group's
            # collectives cannot be trusted any more, so nobody goes on.
            raise CollectiveAutotuneError(
                f"a choice failed while being timed: {_describe(reports)}"
            )
        return samples, skews

    def _prune(
        self,
        candidates: Sequence[Candidate],
        samples: list[list[float]],
        live: list[int],
        keep: set[int],
    ) -> tuple[list[int], bool]:
        """Drop the clearly slower choices; whether sampling can stop.

        A pure function of one MAX all-reduce, so identical on every rank.
        """
        n = len(candidates)
        stats = [_quartiles(samples[i]) if i in live else (math.inf,) * 3 for i in range(n)]
        reduced = self._all_reduce_max([q for s in stats for q in s])
        low, mid, high = (reduced[k::3] for k in range(3))
        leader = min(live, key=lambda i: mid[i])
        dropped = [
            i for i in live
            if i != leader and i not in keep and low[i] > high[leader] * (1 + _DROP_MARGIN)
        ]
        if dropped:
            log.debug(
                "dropping %s: clearly slower than %s on their slowest rank",
                [candidates[i].name for i in dropped],
                candidates[leader].name,
            )
        live = [i for i in live if i not in dropped]
        rest = [i for i in live if i != leader and i not in keep]
        # A tie needs more samples than a clear gap: medians of three move by more.
        tied = len(samples[leader]) >= 2 * self._min_rounds and all(
            mid[i] <= mid[leader] * (1 + TIE_FRACTION) for i in rest
        )
        return live, not rest or tied

    def _reduce(
        self,
        candidates: Sequence[Candidate],
        status: list[str],
        batches: list[Optional[_Batch]],
        samples: list[list[float]],
        skews: list[list[float]],
    ) -> list[ChoiceTiming]:
        medians = [statistics.median(s) if s else math.inf for s in samples]
        skew = [statistics.median(s) if s else 0.0 for s in skews]
        n = len(candidates)
        # One MAX all-reduce gives both the slowest (max t) and fastest (-max -t) rank,
        # and the spread of the rendezvous' duration.
        reduced = self._all_reduce_max(medians + [-t for t in medians] + skew + [-s for s in skew])
        return [
            ChoiceTiming(
                name=c.name,
                max_us=reduced[i],
                min_us=-reduced[n + i] if math.isfinite(reduced[i]) else math.inf,
                calls_per_sample=batches[i].calls if batches[i] is not None else 0,
                status=status[i],
                samples=len(samples[i]),
                skew_us=reduced[2 * n + i] + reduced[3 * n + i],
            )
            for i, c in enumerate(candidates)
        ]

    # -- rounds -----------------------------------------------------------------

    def _round(
        self, batches: list[Optional[_Batch]], live: list[int]
    ) -> tuple[dict[int, float], dict[int, float]]:
        """One sample of every live choice: per-call us and rendezvous spread."""
        graphs = {i: b for i in live if (b := batches[i]) is not None and b.graph}
        times, skews = self._graph_round(graphs)
        for i in live:
            if i not in graphs:
                b = batches[i]
                assert b is not None
                times[i], skews[i] = self._time_eager(b.timed, b.calls, "timing", b.rendezvous)
        return times, skews

    def _graph_round(
        self, graphs: dict[int, _Batch]
    ) -> tuple[dict[int, float], dict[int, float]]:
        """Replay every choice's batch in ``graphs`` once, back to back on the GPU.

        The host enqueues the whole round behind a GPU sleep, so no launch gap of its
        own enters a timed replay; each timed replay follows an untimed one of the same
        graph, which absorbs how far apart the ranks reached it.
        """
        if not graphs:
            return {}, {}
        events = {i: [torch.cuda.Event(enable_timing=True) for _ in range(3)] for i in graphs}
        torch.cuda._sleep(_sleep_cycles(_HOST_LEAD_US))
        for i, batch in graphs.items():
            before, start, end = events[i]
            before.record()
            batch.rendezvous()
            start.record()
            batch.timed()
            end.record()
        self._device_sync("timing", events[next(reversed(events))][2])
        return (
            {i: e[1].elapsed_time(e[2]) * 1e3 / graphs[i].calls for i, e in events.items()},
            {i: e[0].elapsed_time(e[1]) * 1e3 for i, e in events.items()},
        )

    def _time_once(self, fn: Callable[[], Any], topic: str, doing: str) -> tuple[Any, float]:
        """One call's output (a copy: later calls may write the same buffer) and its
        time in microseconds: GPU time on GPUs, wall time on the CPU. ``topic`` is the
        vote that follows, whose reports a stuck device names."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
        else:
            begin = time.perf_counter()
            out = fn()
        out = out.detach().clone() if isinstance(out, torch.Tensor) else out
        if self.device.type == "cuda":
            self._device_sync(topic, end, doing)
            return out, start.elapsed_time(end) * 1e3
        return out, (time.perf_counter() - begin) * 1e6

    def _time_eager(
        self, fn: Callable[[], Any], count: int, topic: str, rendezvous: Callable[[], Any]
    ) -> tuple[float, float]:
        """Microseconds per call of ``count`` back-to-back calls of ``fn``, and how long
        the untimed ``rendezvous`` call waited for the group.

        A gloo collective blocks the host, so on the CPU the barrier aligns ranks to
        well within a millisecond collective, and no rendezvous is needed.
        """
        self._barrier(topic)
        if self.device.type == "cuda":
            before, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            before.record()
            rendezvous()
            start.record()
            for _ in range(count):
                fn()
            end.record()
            self._device_sync(topic, end)
            return start.elapsed_time(end) * 1e3 / count, before.elapsed_time(start) * 1e3
        begin = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - begin) * 1e6 / count, 0.0

    def _capture(
        self, candidates: Sequence[Candidate], indices: list[int], calls: list[int]
    ) -> dict[int, Optional[torch.cuda.CUDAGraph]]:
        """A CUDA graph of ``calls[i]`` calls of each choice in ``indices``; None where
        some rank could not capture it."""
        captured: dict[int, torch.cuda.CUDAGraph] = {}
        failed = [0.0] * len(candidates)
        for i in indices:
            try:
                captured[i] = _capture_graph(candidates[i].run, calls[i])
            except Exception as e:  # noqa: BLE001 - capture records, it runs nothing
                log.warning(
                    "choice %s could not be captured in a CUDA graph on this rank (%s)",
                    candidates[i].name, self._failure("capture", e, "capture"),
                )
                failed[i] = 1.0
        # Capturing issues no collective, so a failure leaves no peer waiting: one flag
        # all-reduce tells every rank which captures to give up.
        failed = self._all_reduce_max(failed)
        return {i: captured.get(i) if failed[i] == 0.0 else None for i in indices}

    # -- primitives -------------------------------------------------------------

    def _failure(self, step: str, error: Exception, topic: str) -> str:
        """This rank's outcome for a ``step`` that raised ``error``, to vote on ``topic``.

        A failure of the communication itself (a timed-out or broken collective)
        leaves peers inside a collective that will never complete: nothing can be
        trusted any more, so it raises instead of dropping the choice, with what the
        group reported on ``topic`` so far.
        """
        text = f"{type(error).__name__}: {error}".replace("\n", " ")[:500]
        if _COMMUNICATION_FAILURE.search(text):
            raise CollectiveAutotuneError(
                f"{step}: the group's collectives failed on this rank ({text}); "
                f"reports from the group so far: {self.session.peer_reports(topic)}"
            ) from error
        return f"failed: {text}"

    def _barrier(self, topic: str) -> None:
        """All ranks of the group have arrived and the device is idle."""
        import torch.distributed as dist

        dist.all_reduce(self._flag, group=self.process_group)
        self._device_sync(topic)

    def _device_sync(
        self, topic: str, event: Optional[torch.cuda.Event] = None, doing: Optional[str] = None
    ) -> None:
        """Wait for the device, at most ``timeout``, and stop if some rank aborted.

        A timeout names ``doing`` (what the device was running) and what the group
        reported on ``topic``, the vote that follows. On the CPU the collectives
        themselves block, bounded by the group timeout.
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
                    f"{doing or topic}: device work did not finish within "
                    f"{self.settings.timeout:g} s (collective_benchmark_timeout); "
                    f"reports from the group on {topic}: {self.session.peer_reports(topic)}"
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

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()


def benchmark_device(device: torch.device) -> torch.device:
    """The device to benchmark on: the op's own, with its index made explicit.

    A program may place its tensors on ``cuda:{local_rank}`` without making that
    device current; flags, events and graphs must live where the tensors do.
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _calls(sample_us: float, per_call_us: float, fewest: int) -> int:
    """Calls per sample: ``sample_us`` of them, at least ``fewest``."""
    if not (math.isfinite(per_call_us) and per_call_us > 0):
        return fewest
    return max(fewest, min(_MAX_CALLS_PER_SAMPLE, math.ceil(sample_us / per_call_us)))


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (math.inf,) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _capture_graph(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


@functools.lru_cache(None)
def _cycles_per_us(device_index: int) -> float:
    """The GPU clock, measured once per device: a sleep's length is given in cycles.
    The highest of a few readings, as an idle GPU boosts its clock only once busy
    (a rate read before the boost would only make sleeps longer, which is harmless)."""
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        rates.append(1_000_000 / (start.elapsed_time(end) * 1e3))
    return max(rates)


def _sleep_cycles(us: float) -> int:
    return int(us * _cycles_per_us(torch.cuda.current_device()))


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


def _rejection(reports: list[str]) -> str:
    """Why the group drops a screened choice: each rank that rejected it, how far off
    it was there, and the ranks that accepted it."""
    accepted = [r for r, o in enumerate(reports) if o == "ok"]
    if not accepted:
        return f"rejected by every rank: {_describe(reports)}"
    return (
        f"rejected by group ranks {[r for r, o in enumerate(reports) if o != 'ok']} "
        f"({_describe(reports)}), accepted by group ranks {accepted}: a result that differs "
        "between ranks suggests it reads data before a collective completed"
    )


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
        self.saved = _group_timeout(self.group)
        if self.saved is not None:
            _set_group_timeout(self.timeout, self.group)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            _set_group_timeout(self.saved, self.group)


def _set_group_timeout(timeout: timedelta, group: ProcessGroup) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    # torch 2.14 made the private setter public (and deprecated the old name).
    setter = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout
    setter(timeout, group)


def _group_timeout(group: ProcessGroup) -> Optional[timedelta]:
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    return None
