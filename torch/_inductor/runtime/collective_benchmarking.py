"""Timing collective custom-op choices in lockstep on every rank of a process group.

A collective is as slow as its slowest rank, so every timed batch follows an untimed
*rendezvous* call of the same choice that absorbs how far apart the ranks arrived
(``skew_us``). Graph mode replays each choice's captured CUDA graph behind a GPU sleep;
eager mode times host-paced calls after a barrier. Rounds interleave the choices, and
MAX all-reduces of their quartiles keep pruning and the winner identical on every rank.

Device work starts only after the group agreed to benchmark (collective_protocol) and
is bounded by ``collective_benchmark_timeout``. Each choice's first call is screened
against the reference's output and for writes into its inputs. A rank whose benchmark
collectives fail aborts the group; failures are told apart by where they happen, never
by their message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TYPE_CHECKING

import torch

from torch.distributed._store_session import Deadline, describe, look_interval

from .collective_protocol import CollectiveAutotuneError, StoreLostError
from .collective_timing_group import (
    discard,
    generations,
    Generations,
    has_timing_group,
    timing_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .collective_protocol import CollectiveSession


log = logging.getLogger(__name__)


# Bounds on calls per eager sample and per captured batch, whatever the estimates say.
_MAX_CALLS_PER_SAMPLE = 1024
# Fewest calls per captured batch, so a replay's launch is a small part of each call; a
# small op's first (eager) call is mostly host launches and would size fewer.
_MIN_GRAPH_CALLS = 8
# Calls per batch of a choice whose first call lasted a sample; recaptured with the
# floor if its first replay shows a shorter call (a first call may pay a one-off cost).
_MIN_LONG_GRAPH_CALLS = 2
# Rounds before the first cross-rank comparison; host-paced GPU samples jitter more.
_MIN_ROUNDS = 3
_MIN_EAGER_GPU_ROUNDS = 5
# Tries to make a timing group together (a connection refused under load is retried).
_TIMING_GROUP_ATTEMPTS = 2
# How far quartiles must part for "clearly slower": few samples' quartiles still move.
DROP_MARGIN = 0.02
# Medians within this fraction of the leader's are a tie.
TIE_FRACTION = DROP_MARGIN
# GPU sleep (us) that lets the host enqueue a whole graph round ahead of the GPU.
_HOST_LEAD_US = 400.0
# Untimed calls (about this long) before each eager GPU sample: the first calls after
# the host waited for an idle device run slower than the steady pace.
_EAGER_LEAD_IN_US = 1000.0
# Screen tolerance by dtype: implementations sum in different orders.
_SCREEN_TOLERANCE = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}
# Longest pause between polls of a device event: short, yet not spinning a core.
_MAX_DEVICE_POLL_S = 2e-4


class TimingMode(str, enum.Enum):
    """How a key's choices are timed; always EAGER on the CPU."""

    GRAPH = "graph"
    EAGER = "eager"


BenchmarkMode = Literal["auto", "eager", "graph"]
BENCHMARK_MODES: tuple[BenchmarkMode, ...] = ("auto", "eager", "graph")

_KNOBS = {
    "rounds": "collective_benchmark_rounds",
    "warmup": "collective_benchmark_warmup",
    "timeout": "collective_benchmark_timeout",
    "sample_us": "collective_benchmark_sample_us",
    "graph_sample_us": "collective_benchmark_graph_sample_us",
    "mode": "collective_benchmark_mode",
    "dynamic": "collective_autotune_dynamic",
    "dynamic_max": "collective_autotune_dynamic_max",
    "dynamic_ratio": "collective_autotune_dynamic_ratio",
    # Where guards are checked, whether a graph is compiled per size range: ranks that
    # differ compile different graphs, and each extra one waits out a session alone.
    "range_graphs": "collective_autotune_range_graphs",
    # The sizes of the graph being compiled: ranks that differ inline different
    # ranges' winners in one graph.
    "compile_range": "collective_autotune_compile_range",
}
# The knobs an engine sets in the config it compiles with, which no variable sets.
_WITHOUT_VARIABLE = frozenset({"collective_autotune_compile_range"})


def describe_knob(knob: str) -> str:
    """How a user sets ``knob``, for messages: its variable and config name."""
    if knob in _WITHOUT_VARIABLE:
        return f"torch._inductor.config.{knob} (set in the config of a compile)"
    return f"TORCHINDUCTOR_{knob.upper()} (torch._inductor.config.{knob})"


@dataclasses.dataclass(frozen=True)
class BenchmarkSettings:
    """The collective autotuning knobs of torch._inductor.config; every rank of a group
    must hold the same."""

    rounds: int
    warmup: int
    timeout: float
    sample_us: float
    graph_sample_us: float
    mode: BenchmarkMode
    dynamic: bool
    dynamic_max: int
    dynamic_ratio: int
    range_graphs: bool
    compile_range: tuple[int, int] | None

    @staticmethod
    def from_config() -> BenchmarkSettings:
        """Raises ValueError naming every knob out of range."""
        from torch._inductor import config

        values = {field: getattr(config, knob) for field, knob in _KNOBS.items()}
        if isinstance(values["compile_range"], list):
            values["compile_range"] = tuple(values["compile_range"])
        settings = BenchmarkSettings(**values)
        settings.validate()
        return settings

    def knobs(self) -> dict[str, Any]:
        return {knob: getattr(self, field) for field, knob in _KNOBS.items()}

    def validate(self) -> None:
        problems = []
        for knob, value, least in (
            ("collective_benchmark_rounds", self.rounds, 1),
            ("collective_benchmark_warmup", self.warmup, 1),
            ("collective_autotune_dynamic_max", self.dynamic_max, 1),
            ("collective_autotune_dynamic_ratio", self.dynamic_ratio, 2),
        ):
            if not (
                isinstance(value, int)
                and not isinstance(value, bool)
                and value >= least
            ):
                problems.append(f"{knob}={value!r}: an int >= {least}")
        for knob, value, unit in (
            ("collective_benchmark_timeout", self.timeout, "seconds"),
            ("collective_benchmark_sample_us", self.sample_us, "microseconds"),
            (
                "collective_benchmark_graph_sample_us",
                self.graph_sample_us,
                "microseconds",
            ),
        ):
            if not (_is_number(value) and value > 0):
                problems.append(f"{knob}={value!r}: {unit}, > 0")
        span = self.compile_range
        if span is not None and not (
            isinstance(span, tuple)
            and len(span) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
            and span[0] <= span[1]
        ):
            problems.append(
                f"collective_autotune_compile_range={span!r}: None or (first, last), "
                "ints, first <= last"
            )
        if self.mode not in BENCHMARK_MODES:
            problems.append(
                f"collective_benchmark_mode={self.mode!r}: one of {BENCHMARK_MODES}"
            )
        if problems:
            raise ValueError(
                "invalid collective autotuning configuration (torch._inductor.config "
                "or its TORCHINDUCTOR_* variable); expected " + "; ".join(problems)
            )

    def timing_mode(self, device: torch.device) -> TimingMode:
        if device.type != "cuda":
            return TimingMode.EAGER
        if self.mode == "auto":
            return (
                TimingMode.GRAPH
                if _model_runs_under_cuda_graphs()
                else TimingMode.EAGER
            )
        return TimingMode(self.mode)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One choice to time. ``run`` performs one call and returns its output."""

    name: str
    run: Callable[[], torch.Tensor]


class ChoiceStatus(str, enum.Enum):
    """Whether a choice is timed, or why the group dropped it."""

    OK = "ok"
    # Its output, or what it wrote, differs from the reference's on some rank.
    REJECTED = "rejected"
    # It raised on every rank.
    RAISED = "raised"
    # Its calls cannot be timed within collective_benchmark_timeout.
    OVER_BUDGET = "over budget"


class ScreenOutcome(NamedTuple):
    """A choice's status after its screen, and why it is dropped, as on every rank."""

    status: ChoiceStatus
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status is ChoiceStatus.OK


PASSED = ScreenOutcome(ChoiceStatus.OK)


@dataclasses.dataclass(frozen=True)
class ChoiceTiming:
    """A choice's result, identical on every rank of the group."""

    name: str
    # Per-call us (each rank's median) on the slowest/fastest rank; inf if dropped.
    max_us: float
    min_us: float
    calls_per_sample: int
    status: ChoiceStatus
    # Fewer than the budget once the choice was clearly slower.
    samples: int = 0
    # How far apart the ranks reached the rendezvous call (median, us).
    skew_us: float = 0.0
    # Quartiles on the slowest rank (MAX over ranks); the median where none are given.
    low_us: float = math.nan
    high_us: float = math.nan
    reason: str = ""
    # HostContention of the most contended rank; 0 for CUDA-graph replays.
    contention: float = 0.0

    def __post_init__(self) -> None:
        # A status given by its value ("ok") becomes the enum member.
        object.__setattr__(self, "status", ChoiceStatus(self.status))
        for name in ("low_us", "high_us"):
            if math.isnan(getattr(self, name)):
                object.__setattr__(self, name, self.max_us)


class Verdict(enum.IntEnum):
    """A screened call's outcome on one rank, as one all-reduce carries it."""

    OK = 0
    # The output differs from the reference's (the value: the largest error).
    WRONG_OUTPUT = 1
    # The output's shape or dtype differs, or it is no tensor.
    WRONG_KIND = 2
    # It wrote into an input the op does not declare it mutates (the value: which).
    WROTE_INPUT = 3
    # It raised on every rank (agreed in the Store).
    RAISED = 4


@dataclasses.dataclass
class _Batch:
    """How one choice is timed: ``calls`` calls per sample after ``lead_in`` untimed."""

    calls: int
    rendezvous: Callable[[], Any]
    timed: Callable[[], Any]
    graph: bool
    lead_in: int = 0
    # Sized from a first call that lasted a sample: checked on its first replay.
    from_long_first_call: bool = False


class CollectiveBenchmarker:
    """Times choices of one collective op on every rank of ``process_group``.

    Every rank must call :meth:`benchmark` (or :meth:`screen`) with the same
    candidates in the same order. ``device`` (the op's tensors') is made current.
    """

    def __init__(
        self,
        process_group: ProcessGroup,
        device: torch.device,
        settings: BenchmarkSettings,
        session: CollectiveSession,
        mode: TimingMode | None = None,
    ) -> None:
        self.process_group = process_group
        self.settings = settings
        self.session = session
        self.device = benchmark_device(device)
        self.mode = mode or settings.timing_mode(self.device)
        self._min_rounds = (
            _MIN_EAGER_GPU_ROUNDS
            if self.mode is TimingMode.EAGER and self.device.type == "cuda"
            else _MIN_ROUNDS
        )
        self._flag = torch.zeros(1, device=self._comm_device())
        # The group the benchmark's collectives run on (collective_timing_group).
        self._group = process_group
        # What went wrong in the group so far, for the message of a later failure.
        self._incidents: list[str] = []
        # Seconds the last benchmark spent in each of its steps.
        self.phases: dict[str, float] = {}

    # -- public -----------------------------------------------------------------

    def benchmark(
        self,
        candidates: Sequence[Candidate],
        inputs: ScreenInputs,
        reference: int = 0,
        keep: Sequence[int] = (),
        incumbent: int | None = None,
    ) -> list[ChoiceTiming]:
        """Screen, calibrate and time ``candidates``; identical result on every rank.

        Every candidate must reproduce the output of ``candidates[reference]`` (the op's
        own implementation) on ``inputs`` and leave them unchanged, or it is dropped.
        Candidates in ``keep`` are timed to the end; sampling stops once none is
        clearly faster than ``candidates[incumbent]``.
        """
        with self._running(f"benchmarking {', '.join(c.name for c in candidates)}"):
            marks = [time.perf_counter()]
            status, first_call_us = self._screen(candidates, inputs, reference)
            marks.append(time.perf_counter())
            batches = self._prepare_batches(candidates, status, first_call_us)
            marks.append(time.perf_counter())
            contention = [HostContention() for _ in candidates]
            samples, skews = self._sample(
                candidates, batches, set(keep), first_call_us, contention, incumbent
            )
            marks.append(time.perf_counter())
            timings = self._reduce(
                candidates,
                status,
                batches,
                samples,
                skews,
                [c.value for c in contention],
            )
            marks.append(time.perf_counter())
            self.phases = dict(
                zip(
                    ("screen", "batches", "rounds", "reduce"),
                    (b - a for a, b in zip(marks, marks[1:])),
                )
            )
            log.info(
                "timed %d choices (%s) in %.1f ms: screen (every choice's first call) "
                "%.1f, batches %.1f, %d rounds %.1f, reduce %.1f",
                len(candidates),
                self.mode.value,
                1e3 * (marks[-1] - marks[0]),
                *(1e3 * t for t in list(self.phases.values())[:2]),
                max(len(s) for s in samples),
                *(1e3 * t for t in list(self.phases.values())[2:]),
            )
            return timings

    def screen(
        self, candidates: Sequence[Candidate], inputs: ScreenInputs, reference: int = 0
    ) -> list[ScreenOutcome]:
        """Only the screen of :meth:`benchmark`: each candidate's outcome."""
        with self._running(f"screening {', '.join(c.name for c in candidates)}"):
            return self._screen(candidates, inputs, reference)[0]

    @contextlib.contextmanager
    def _running(self, doing: str) -> Any:
        """Device work: on the op's device, collectives on the timing group (bounded by
        the timeout), without heartbeats (every rank bounds its own); an error aborts
        the session and discards the timing group."""
        try:
            with self.session.working(doing, beat=False), self._on_device():
                self._group = self._agreed_timing_group(doing)
                yield
        except StoreLostError:
            discard(self.process_group, self.settings.timeout)
            raise  # nobody can be told
        except Exception as e:
            discard(self.process_group, self.settings.timeout)
            # Peers may be waiting on this rank in a collective or a vote.
            error = (
                e
                if isinstance(e, CollectiveAutotuneError)
                else CollectiveAutotuneError(
                    f"{doing}: a choice failed ({describe(e)})"
                    + "".join(f"; {incident}" for incident in self._incidents)
                )
            )
            self.session.abort(str(error))
            raise error from e

    def _agreed_timing_group(self, doing: str) -> ProcessGroup:
        """The timing group (collective_timing_group) of the generation every rank
        holds; else one all make anew, at a generation none of them made before. Votes
        in the Store bound the waits: a rank whose part of a group its peers failed to
        join (one-sided discards, a connection refused) never waits on it in a
        collective. One retry, then the group's error."""
        group, timeout = self.process_group, self.settings.timeout
        if not has_timing_group(group):
            return group
        said = [
            Generations(*r)
            for r in self.session.vote(
                f"{doing}/timing group",
                list(dataclasses.astuple(generations(group, timeout))),
            )
        ]
        held = said[0].held
        if held is not None and all(r.held == held for r in said):
            return timing_group(group, timeout, held)
        generation = max(r.newest for r in said)
        failures: list[str] = []
        for _ in range(_TIMING_GROUP_ATTEMPTS):
            generation += 1
            # Heard while connecting: a loaded host's connect outlasts the timeout's
            # silence, and gloo bounds it (its own timeout, per peer).
            connecting = self.session.working(f"{doing}: connecting its own group")
            try:
                with connecting:
                    made, why = timing_group(group, timeout, generation), ""
            except Exception as e:  # this rank holds none now: discarded before
                log.debug("making the timing group failed", exc_info=True)
                made, why = None, describe(e)[:300]
            reports = self.session.vote(f"{doing}/timing group {generation}", why)
            failures = [f"group rank {r}: {w}" for r, w in enumerate(reports) if w]
            if made is not None and not failures:
                return made
            discard(group, timeout)
            log.info(
                "%s: the benchmark's own group (generation %d) failed to connect: %s",
                doing,
                generation,
                "; ".join(failures),
            )
        raise CollectiveAutotuneError(
            f"{doing}: the benchmark's own group of the group's ranks could not be "
            f"made in {_TIMING_GROUP_ATTEMPTS} attempts: " + "; ".join(failures)
        )

    # -- the screen ---------------------------------------------------------------

    def _screen(
        self,
        candidates: Sequence[Candidate],
        inputs: ScreenInputs,
        reference_index: int,
    ) -> tuple[list[ScreenOutcome], list[float]]:
        """Each candidate's outcome and first-call time on its slowest rank (us).

        One all-reduce carries the verdicts; a choice that raised is voted on in the
        Store first, since the group's collectives may be unusable on that rank.
        """
        n, world = len(candidates), self.process_group.size()
        rank = self.process_group.rank()
        # This rank's row of the group's table: verdict, value, first call (us).
        mine = [[float(Verdict.OK), 0.0, math.inf] for _ in range(n)]
        raised: dict[int, str] = {}
        reference: torch.Tensor | None = None
        for i in [reference_index] + [j for j in range(n) if j != reference_index]:
            candidate = candidates[i]
            self._barrier(f"screening {candidate.name}")
            inputs.reset()
            try:
                out, mine[i][2] = self._time_once(
                    candidate.run, f"screening choice {candidate.name}"
                )
            except CollectiveAutotuneError:
                raise
            except Exception as e:  # the choice's own failure: the group decides
                log.debug(
                    "choice %s raised on this rank", candidate.name, exc_info=True
                )
                raised[i] = self._raised_everywhere(candidate.name, e)
                mine[i] = [float(Verdict.RAISED), 0.0, math.inf]
                continue
            if reference is None:
                reference = out
            mine[i][:2] = _verdict(out, reference, inputs.written())
        table = self._gather(mine, rank, world)
        rows = [table[i * world : (i + 1) * world] for i in range(n)]
        status = [_status(rows[i], raised.get(i, "")) for i in range(n)]
        first_call_us = [max(row[2] for row in rows[i]) for i in range(n)]
        for i, why in self._over_budget(first_call_us, reference_index).items():
            status[i] = ScreenOutcome(ChoiceStatus.OVER_BUDGET, why)
        return status, [t if s.ok else math.inf for t, s in zip(first_call_us, status)]

    def _raised_everywhere(self, name: str, error: Exception) -> str:
        """Vote that ``name`` raised here; why, once every rank says so. Ranks that did
        not raise time out in a collective and abort the group, ending this wait."""
        reason = describe(error)[:300]
        self._incidents.append(
            f"choice {name} raised on group rank {self.process_group.rank()} ({reason})"
        )
        reports = self.session.vote(f"screen/raised/{name}", reason)
        self._incidents[-1] = f"choice {name} raised: " + "; ".join(
            f"group rank {r}: {why}" for r, why in enumerate(reports)
        )
        return "raised on every rank: " + "; ".join(
            f"group rank {r}: {why}" for r, why in enumerate(reports)
        )

    def _gather(
        self, mine: list[list[float]], rank: int, world: int
    ) -> list[list[float]]:
        """Every rank's screen rows by one all-reduce: row ``i * world + r`` is group
        rank ``r``'s on candidate ``i``."""

        n = len(mine)
        table = torch.zeros(n, world, 3, dtype=torch.float64)
        table[:, rank] = torch.tensor(mine, dtype=torch.float64)
        flat = table.flatten().to(self._comm_device())
        self._all_reduce("sharing the screen's verdicts", flat)
        return flat.view(n * world, 3).tolist()

    def _over_budget(
        self, first_call_us: list[float], reference: int
    ) -> dict[int, str]:
        """The candidates whose fewest timing calls, at their first call's time, exceed
        ``collective_benchmark_timeout``, and why; the reference is kept (fallback)."""
        budget_us = self.settings.timeout * 1e6
        over = {}
        for i, t in enumerate(first_call_us):
            fewest = self._fewest_calls(t)
            if math.isfinite(t) and t * fewest > budget_us:
                over[i] = (
                    f"over budget: its first call took {t / 1e6:.3g} s on its slowest "
                    f"rank, and timing it takes at least {fewest} calls, over "
                    "collective_benchmark_timeout="
                    f"{self.settings.timeout:g} s"
                )
        if reference in over:
            over[reference] += (
                " (the op's own implementation: kept as the fallback, untimed)"
            )
        return over

    def _fewest_calls(self, per_call_us: float) -> int:
        """The fewest calls that time a choice: its sizing, then the first rounds."""
        if self.mode is TimingMode.GRAPH:
            calls = _graph_calls(self.settings.graph_sample_us, per_call_us)
            return calls + self._min_rounds * 2 * calls
        calls = _calls(self.settings.sample_us, per_call_us, 1)
        lead_in = self._lead_in(per_call_us)
        return 2 * self.settings.warmup + self._min_rounds * (1 + lead_in + calls)

    def _lead_in(self, per_call_us: float) -> int:
        """Untimed calls before each eager sample; none on the CPU (gloo blocks)."""
        return _lead_in_calls(per_call_us) if self.device.type == "cuda" else 0

    # -- calibrating and sampling -------------------------------------------------

    def _prepare_batches(
        self,
        candidates: Sequence[Candidate],
        status: list[ScreenOutcome],
        first_call_us: list[float],
    ) -> list[_Batch | None]:
        live = [i for i, s in enumerate(status) if s.ok]
        batches: list[_Batch | None] = [None] * len(candidates)
        if self.mode is TimingMode.GRAPH:
            # The screen's times are the slowest rank's: every rank captures alike.
            calls = [
                _graph_calls(self.settings.graph_sample_us, t) for t in first_call_us
            ]
            for i, graph in self._capture(candidates, live, calls).items():
                if graph is not None:
                    batches[i] = _Batch(
                        calls[i],
                        graph.replay,
                        graph.replay,
                        graph=True,
                        from_long_first_call=calls[i] < _MIN_GRAPH_CALLS,
                    )
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
            estimates[i] = self._time_eager(
                run, self.settings.warmup, "warming up", run
            )[0]
        # One all-reduce of the estimates, so that every rank issues as many calls.
        slowest = self._all_reduce_max(estimates)
        for i in eager:
            run = candidates[i].run
            batches[i] = _Batch(
                _calls(self.settings.sample_us, slowest[i], 1),
                run,
                run,
                graph=False,
                lead_in=self._lead_in(slowest[i]),
            )
        return batches

    def _sample(
        self,
        candidates: Sequence[Candidate],
        batches: list[_Batch | None],
        keep: set[int],
        first_call_us: list[float],
        contention: list[HostContention],
        incumbent: int | None = None,
    ) -> tuple[list[list[float]], list[list[float]]]:
        samples: list[list[float]] = [[] for _ in candidates]
        skews: list[list[float]] = [[] for _ in candidates]
        live = [i for i, b in enumerate(batches) if b is not None]
        rounds = self._rounds(batches, first_call_us)
        for round_index in range(rounds):
            if not live:
                break
            times, skew = self._round(batches, live, contention)
            for i in live:
                samples[i].append(times[i])
                skews[i].append(skew[i])
            if round_index == 0:
                for i in self._resize_short_calls(candidates, batches, live, times):
                    samples[i].clear()
                    skews[i].clear()
            if len(samples[live[0]]) >= self._min_rounds and len(live) > 1:
                live, settled = self._prune(candidates, samples, live, keep, incumbent)
                if settled:
                    break
        return samples, skews

    def _resize_short_calls(
        self,
        candidates: Sequence[Candidate],
        batches: list[_Batch | None],
        live: list[int],
        times: dict[int, float],
    ) -> list[int]:
        """Recapture the long-first-call batches whose first replay showed a shorter
        call; returns their indices (their first sample must be dropped)."""
        checked = [
            i
            for i in live
            if (b := batches[i]) is not None and b.graph and b.from_long_first_call
        ]
        if not checked:  # the same on every rank: the batches are sized alike
            return []
        sample_us = self.settings.graph_sample_us
        slowest = self._all_reduce_max(
            [times[i] if i in checked else 0.0 for i in range(len(candidates))]
        )
        calls = [_recaptured_calls(sample_us, t) for t in slowest]
        captured = {i: b.calls for i in checked if (b := batches[i]) is not None}
        short = [i for i in checked if calls[i] > captured[i]]
        if not short:
            return []
        log.debug(
            "capturing %s again: their first replays took %s us per call, shorter "
            "than a sample",
            [candidates[i].name for i in short],
            [round(slowest[i], 2) for i in short],
        )
        resized = []
        for i, graph in self._capture(candidates, short, calls).items():
            if graph is not None:  # else the two-call batch stays, on every rank
                batches[i] = _Batch(calls[i], graph.replay, graph.replay, graph=True)
                resized.append(i)
        return resized

    def _rounds(self, batches: list[_Batch | None], first_call_us: list[float]) -> int:
        """Rounds that fit every choice's calls in the timeout (at least the first
        rounds), at most ``rounds``; the same on every rank."""
        budget_us = self.settings.timeout * 1e6
        rounds = self.settings.rounds
        for batch, t in zip(batches, first_call_us):
            if batch is None or not math.isfinite(t) or t <= 0:
                continue
            per_round = t * (batch.calls + batch.lead_in) * 2
            rounds = min(rounds, max(self._min_rounds, int(budget_us // per_round)))
        return rounds

    def _prune(
        self,
        candidates: Sequence[Candidate],
        samples: list[list[float]],
        live: list[int],
        keep: set[int],
        incumbent: int | None,
    ) -> tuple[list[int], bool]:
        """Drop the clearly slower choices; whether sampling can stop. One MAX
        all-reduce; ``incumbent`` counts only where every rank names the same one."""
        n = len(candidates)
        stats = [
            _quartiles(samples[i]) if i in live else (math.inf,) * 3 for i in range(n)
        ]
        named = -1.0 if incumbent is None else float(incumbent)
        reduced = self._all_reduce_max([q for s in stats for q in s] + [named, -named])
        low, mid, high = (reduced[k : 3 * n : 3] for k in range(3))
        agreed = reduced[-2] == -reduced[-1] >= 0
        return prune(
            live,
            SlowestRankQuartiles(low, mid, high, len(samples[live[0]])),
            keep,
            self._min_rounds,
            candidates,
            int(reduced[-2]) if agreed else None,
        )

    def _reduce(
        self,
        candidates: Sequence[Candidate],
        status: list[ScreenOutcome],
        batches: list[_Batch | None],
        samples: list[list[float]],
        skews: list[list[float]],
        contention: list[float],
    ) -> list[ChoiceTiming]:
        quartiles = [_quartiles(s) for s in samples]
        medians = [q[1] for q in quartiles]
        skew = [statistics.median(s) if s else 0.0 for s in skews]
        n = len(candidates)
        # One MAX all-reduce: the slowest (t) and fastest (-t) rank, skew spread,
        # slowest-rank quartiles and the most contended host.
        reduced = self._all_reduce_max(
            medians
            + [-t for t in medians]
            + skew
            + [-s for s in skew]
            + [q[0] for q in quartiles]
            + [q[2] for q in quartiles]
            + contention
        )
        return [
            ChoiceTiming(
                name=c.name,
                max_us=reduced[i],
                min_us=-reduced[n + i] if math.isfinite(reduced[i]) else math.inf,
                calls_per_sample=batches[i].calls if batches[i] is not None else 0,
                status=status[i].status,
                reason=status[i].reason,
                samples=len(samples[i]),
                skew_us=reduced[2 * n + i] + reduced[3 * n + i],
                low_us=reduced[4 * n + i],
                high_us=reduced[5 * n + i],
                contention=reduced[6 * n + i],
            )
            for i, c in enumerate(candidates)
        ]

    # -- rounds -----------------------------------------------------------------

    def _round(
        self,
        batches: list[_Batch | None],
        live: list[int],
        contention: list[HostContention],
    ) -> tuple[dict[int, float], dict[int, float]]:
        """One sample of every live choice: per-call us and rendezvous spread. Host
        contention is per choice: a busy host slows only those that want a CPU."""
        graphs = {i: b for i in live if (b := batches[i]) is not None and b.graph}
        times, skews = self._graph_round(graphs)
        for i in live:
            if i not in graphs:
                b = batches[i]
                assert b is not None
                with contention[i]:
                    times[i], skews[i] = self._time_eager(
                        b.timed, b.calls, "timing", b.rendezvous, b.lead_in
                    )
        return times, skews

    def _graph_round(
        self, graphs: dict[int, _Batch]
    ) -> tuple[dict[int, float], dict[int, float]]:
        """Replay each batch once, back to back, behind a GPU sleep so that no host
        launch gap is timed; each timed replay follows an untimed rendezvous one."""
        if not graphs:
            return {}, {}
        events = {
            i: [torch.cuda.Event(enable_timing=True) for _ in range(3)] for i in graphs
        }
        torch.cuda._sleep(_sleep_cycles(_HOST_LEAD_US))
        for i, batch in graphs.items():
            before, start, end = events[i]
            before.record()
            batch.rendezvous()
            start.record()
            batch.timed()
            end.record()
        self._device_sync(
            "timing a round of CUDA-graph replays", events[next(reversed(events))][2]
        )
        return (
            {
                i: e[1].elapsed_time(e[2]) * 1e3 / graphs[i].calls
                for i, e in events.items()
            },
            {i: e[0].elapsed_time(e[1]) * 1e3 for i, e in events.items()},
        )

    def _time_once(self, fn: Callable[[], Any], doing: str) -> tuple[Any, float]:
        """One call's output (a copy: later calls may write the same buffer) and its
        time in microseconds: GPU time on GPUs, wall time on the CPU."""
        begin = time.perf_counter()
        if self.device.type == "cuda":
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            out = fn()
            end.record()
        else:
            out = fn()
        out = out.detach().clone() if isinstance(out, torch.Tensor) else out
        self._after_long_call(begin)
        if self.device.type == "cuda":
            self._device_sync(doing, end)
            return out, start.elapsed_time(end) * 1e3
        return out, (time.perf_counter() - begin) * 1e6

    def _time_eager(
        self,
        fn: Callable[[], Any],
        count: int,
        doing: str,
        rendezvous: Callable[[], Any],
        lead_in: int = 0,
    ) -> tuple[float, float]:
        """Microseconds per call of ``count`` calls after ``lead_in`` untimed ones, and
        how long ``rendezvous`` waited for the group (not run on the CPU, where gloo's
        barrier blocks the host and so aligns the ranks)."""
        self._barrier(doing)
        if self.device.type == "cuda":
            before, met, start, end = (
                torch.cuda.Event(enable_timing=True) for _ in range(4)
            )
            before.record()
            rendezvous()
            met.record()
            for _ in range(lead_in):
                fn()
            start.record()
            for _ in range(count):
                fn()
            end.record()
            self._device_sync(doing, end)
            return start.elapsed_time(end) * 1e3 / count, before.elapsed_time(met) * 1e3
        begin = time.perf_counter()
        for _ in range(count):
            fn()
        self._after_long_call(begin)
        return (time.perf_counter() - begin) * 1e6 / count, 0.0

    def _capture(
        self, candidates: Sequence[Candidate], indices: list[int], calls: list[int]
    ) -> dict[int, torch.cuda.CUDAGraph | None]:
        """A CUDA graph of ``calls[i]`` calls of each choice in ``indices``; None where
        some rank could not capture it."""
        captured: dict[int, torch.cuda.CUDAGraph] = {}
        failed = [0.0] * len(candidates)
        for i in indices:
            try:
                captured[i] = _capture_graph(candidates[i].run, calls[i])
            except Exception as e:  # capture records, it runs nothing
                log.warning(
                    "choice %s could not be captured in a CUDA graph on this rank "
                    "(%s: %s)",
                    candidates[i].name,
                    type(e).__name__,
                    e,
                )
                failed[i] = 1.0
        # Capturing issues no collective, so one flag all-reduce suffices.
        failed = self._all_reduce_max(failed)
        return {i: captured.get(i) if failed[i] == 0.0 else None for i in indices}

    # -- primitives -------------------------------------------------------------

    def _all_reduce(self, doing: str, tensor: torch.Tensor, op: Any = None) -> None:
        """One of the benchmark's own all-reduces (SUM unless ``op``), on the timing
        group and waited for within the timeout. Called on the group itself: torch's
        functions look a group up in c10d's world map, where a timing group is not. A
        failure leaves the group's collectives untrustworthy: CollectiveAutotuneError."""
        import torch.distributed as dist

        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM if op is None else op
        try:
            self._group.allreduce([tensor], options).wait()
        except Exception as e:
            raise CollectiveAutotuneError(
                f"{doing}: the group's collectives failed on this rank "
                f"({describe(e)})"
                + "".join(f"; {incident}" for incident in self._incidents)
            ) from e
        self._device_sync(doing)

    def _barrier(self, doing: str) -> None:
        """All ranks of the group have arrived and the device is idle."""
        self._all_reduce(doing, self._flag)

    def _after_long_call(self, began: float) -> None:
        """After a call longer than a look interval, stop if the group aborted."""
        if time.perf_counter() - began > look_interval(self.settings.timeout):
            self.session.check_abort()

    def _device_sync(self, doing: str, event: torch.cuda.Event | None = None) -> None:
        """Wait for the device, at most ``timeout``, and stop if some rank aborted."""
        if self.device.type != "cuda":
            return
        if event is None:
            event = torch.cuda.Event()
            event.record()
        deadline = Deadline(self.settings.timeout)
        look = look_interval(self.settings.timeout)
        next_look = time.monotonic() + look
        pause = 1e-5
        while not event.query():
            if deadline.expired():
                raise CollectiveAutotuneError(
                    f"{doing}: device work did not finish within "
                    f"{self.settings.timeout:g} s (collective_benchmark_timeout)"
                    + "".join(f"; {incident}" for incident in self._incidents)
                )
            if time.monotonic() >= next_look:
                self.session.check_abort()
                next_look = time.monotonic() + look
            time.sleep(pause)
            pause = min(2 * pause, _MAX_DEVICE_POLL_S)

    def _all_reduce_max(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        self._all_reduce("reducing timings", tensor, dist.ReduceOp.MAX)
        return tensor.tolist()

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()


class ScreenInputs:
    """A benchmark's input tensors: restored before each screened call, and checked
    after it for writes into those the op does not declare it mutates."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], mutable: Sequence[int] = ()
    ) -> None:
        self.tensors = list(tensors)
        self._pristine = [t.clone() for t in self.tensors]
        self._mutable = set(mutable)

    def reset(self) -> None:
        for t, p in zip(self.tensors, self._pristine):
            t.copy_(p)

    def written(self) -> int | None:
        """The first input the last call wrote against the op's declaration, or None."""
        return next(
            (
                i
                for i, (t, p) in enumerate(zip(self.tensors, self._pristine))
                if i not in self._mutable and not torch.equal(t, p)
            ),
            None,
        )


@dataclasses.dataclass(frozen=True)
class SlowestRankQuartiles:
    """Each choice's sample quartiles (us) on its slowest rank, by candidate index,
    after ``rounds`` rounds of sampling."""

    low: list[float]
    mid: list[float]
    high: list[float]
    rounds: int


def prune(
    live: list[int],
    quartiles: SlowestRankQuartiles,
    keep: set[int],
    min_rounds: int,
    candidates: Sequence[Candidate],
    incumbent: int | None = None,
) -> tuple[list[int], bool]:
    """The choices still worth sampling, from slowest-rank quartiles, and whether to
    stop: the leader is alone, the rest tie, or none beats ``incumbent`` clearly."""
    low, mid, high = quartiles.low, quartiles.mid, quartiles.high
    leader = min(live, key=lambda i: mid[i])
    dropped = [
        i
        for i in live
        if i != leader and i not in keep and clearly_slower(low[i], high[leader])
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
    tied = quartiles.rounds >= 2 * min_rounds and all(
        mid[i] <= mid[leader] * (1 + TIE_FRACTION) for i in rest
    )
    unbeaten = incumbent in live and not any(
        clearly_slower(low[incumbent], high[i]) for i in live if i != incumbent
    )
    return live, not rest or tied or unbeaten


def _run_delay_ns() -> int | None:
    """Nanoseconds this thread has waited for a CPU while runnable; None if unknown."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class HostContention:
    """Seconds per second the timing thread was runnable but waiting for a CPU within
    the blocks it is entered for (``value``; 0 where the kernel does not tell). Per wall
    second: a thread woken thousands of times a second waits a little on any host."""

    def __init__(self) -> None:
        self._delay_s = 0.0
        self._elapsed_s = 0.0
        self._start: tuple[int, float] | None = None

    @property
    def value(self) -> float:
        return self._delay_s / self._elapsed_s if self._elapsed_s > 0 else 0.0

    def __enter__(self) -> HostContention:
        delay = _run_delay_ns()
        self._start = None if delay is None else (delay, time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        delay = _run_delay_ns()
        if self._start is None or delay is None:
            return
        self._delay_s += max(0, delay - self._start[0]) / 1e9
        self._elapsed_s += time.perf_counter() - self._start[1]


def clearly_slower(low_us: float, leader_high_us: float) -> bool:
    """Whether lower quartile ``low_us`` exceeds ``leader_high_us`` by DROP_MARGIN."""
    return low_us > leader_high_us * (1 + DROP_MARGIN)


def benchmark_device(device: torch.device) -> torch.device:
    """The op's device with an explicit index: flags, events and graphs must live
    where the tensors do, which may not be the current device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _calls(sample_us: float, per_call_us: float, fewest: int) -> int:
    """Calls per sample: ``sample_us`` of them, at least ``fewest``."""
    if not (math.isfinite(per_call_us) and per_call_us > 0):
        return fewest
    return max(fewest, min(_MAX_CALLS_PER_SAMPLE, math.ceil(sample_us / per_call_us)))


def _graph_calls(sample_us: float, per_call_us: float) -> int:
    """Calls per captured batch from the slowest rank's first call: ``sample_us`` of
    them, at least _MIN_GRAPH_CALLS (_MIN_LONG_GRAPH_CALLS for a call that long)."""
    long = math.isfinite(per_call_us) and per_call_us >= sample_us
    return _calls(
        sample_us, per_call_us, _MIN_LONG_GRAPH_CALLS if long else _MIN_GRAPH_CALLS
    )


def _recaptured_calls(sample_us: float, replay_per_call_us: float) -> int:
    """Calls per recaptured batch, from its first replay's per-call time. Not
    ``sample_us / replay_per_call_us``: rivals are sized from their slower eager first
    calls, and more calls per batch would favour it."""
    if replay_per_call_us >= sample_us:
        return _MIN_LONG_GRAPH_CALLS
    return _MIN_GRAPH_CALLS


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (math.inf,) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _lead_in_calls(per_call_us: float) -> int:
    """Untimed calls, about ``_EAGER_LEAD_IN_US`` of them, before each eager sample."""
    if not math.isfinite(per_call_us) or per_call_us <= 0:
        return 0
    return min(_MAX_CALLS_PER_SAMPLE, int(_EAGER_LEAD_IN_US // per_call_us))


def _capture_graph(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


@functools.lru_cache(None)  # for the process: the hardware does not change
def _cycles_per_us(device_index: int) -> float:
    """The GPU clock (sleeps are given in cycles): the highest of a few readings, as an
    idle GPU boosts its clock only once busy."""
    rates = []
    for _ in range(3):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        rates.append(1_000_000 / (start.elapsed_time(end) * 1e3))
    return max(rates)


def _sleep_cycles(us: float) -> int:
    return int(us * _cycles_per_us(torch.cuda.current_device()))


def _verdict(
    out: Any, reference: torch.Tensor, written: int | None
) -> tuple[float, float]:
    """This rank's verdict on one screened call, and its value (see Verdict)."""
    if written is not None:
        return float(Verdict.WROTE_INPUT), float(written)
    if (
        not isinstance(out, torch.Tensor)
        or out.shape != reference.shape
        or out.dtype != reference.dtype
    ):
        return float(Verdict.WRONG_KIND), 0.0
    tol = _SCREEN_TOLERANCE.get(out.dtype, 0.0)
    scale = max(1.0, reference.abs().max().item()) if reference.numel() else 1.0
    if not torch.allclose(out, reference, rtol=tol, atol=tol * scale):
        return float(Verdict.WRONG_OUTPUT), (
            out.double() - reference.double()
        ).abs().max().item()
    return float(Verdict.OK), 0.0


def _describe(verdict: Verdict, value: float) -> str:
    """One rank's verdict in words; "" where it accepted the call."""
    if verdict == Verdict.WRONG_OUTPUT:
        return (
            f"rejected: output differs from the reference (max abs error {value:.3g})"
        )
    if verdict == Verdict.WRONG_KIND:
        return "rejected: output is no tensor of the reference's shape and dtype"
    if verdict == Verdict.WROTE_INPUT:
        return (
            f"rejected: writes into input {int(value)}, which the op does not declare "
            "it mutates"
        )
    return ""


def _status(rows: list[list[float]], raised: str) -> ScreenOutcome:
    """A candidate's outcome from every rank's row of the screen's table."""
    verdicts = [Verdict(int(row[0])) for row in rows]
    if all(v == Verdict.OK for v in verdicts):
        return PASSED
    if all(v == Verdict.RAISED for v in verdicts):
        return ScreenOutcome(ChoiceStatus.RAISED, raised)
    words = [_describe(v, row[1]) for v, row in zip(verdicts, rows)]
    return ScreenOutcome(ChoiceStatus.REJECTED, _rejection(words))


def _rejection(reports: list[str]) -> str:
    """Why the group drops a screened choice; ``reports[r]`` is "" where rank ``r``
    accepted it."""
    described = "; ".join(f"group rank {r}: {o}" for r, o in enumerate(reports) if o)
    accepted = [r for r, o in enumerate(reports) if not o]
    if not accepted:
        return f"rejected by every rank: {described}"
    return (
        f"rejected by group ranks {[r for r, o in enumerate(reports) if o]} "
        f"({described}), accepted by group ranks {accepted}: a result that differs "
        "between ranks suggests it reads data before a collective completed"
    )


def _model_runs_under_cuda_graphs() -> bool:
    from torch._inductor import config

    return bool(config.triton.cudagraphs)
