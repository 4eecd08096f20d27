"""Decision keys, and this process's records of collective autotuning decisions.

The records are cleared with Inductor's caches by ``fresh_cache``; :func:`format_record`
writes the table that ``TORCH_LOGS=collective_autotuning`` prints."""

from __future__ import annotations

import dataclasses
import enum
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any, TYPE_CHECKING, TypeVar

from torch._inductor.runtime.collective_benchmarking import ChoiceTiming, TimingMode
from torch._inductor.runtime.collective_confidence import Confidence
from torch._inductor.runtime.collective_decisions import digest

if TYPE_CHECKING:
    from torch._inductor.kernel.collective.choice_modules import Neighbours


class Action(str, enum.Enum):
    """What the group did about a key: time its choices now, or use one untimed."""

    BENCHMARK = "benchmark"
    USE = "use"


class Source(str, enum.Enum):
    """Where a decision comes from: timed now, this job attempt, every rank's disk, a
    cached graph, a dynamic op's neighbouring sizes, or agreed untimed (a fallback)."""

    BENCHMARK = "benchmark"
    JOB = "job"
    DISK = "disk"
    CACHE = "cache"
    LADDER = "ladder"
    AGREEMENT = "agreement"


@dataclasses.dataclass(frozen=True)
class KeyTiming:
    """How a key's choices are timed, as the key names it: the mode, the speedup a
    choice needs over the op's own, and the neighbours fused around the op."""

    mode: TimingMode
    min_speedup_threshold: float
    neighbours: Neighbours


def site_key(
    name: str,
    inputs: Sequence[Any],
    labels: Sequence[str],
    code: Mapping[str, str],
    timing: KeyTiming,
) -> str:
    """The digest naming a decision, alike on every rank: op, input layouts, choices,
    timing, threshold, fused neighbours, and each implementation's code identity."""
    return digest(
        name,
        [_node_meta(n) for n in inputs],
        list(labels),
        timing.mode.value,
        timing.min_speedup_threshold,
        str(timing.neighbours),
        sorted(code.items()),
    )


def _node_meta(node: Any) -> str:
    """Size, stride and dtype of an IR node or layout (not its device)."""
    if hasattr(node, "get_size"):
        return f"{node.get_size()}/{node.get_stride()}/{node.get_dtype()}"
    return f"{node.size}/{node.stride}/{node.dtype}"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What the group decided and measured for one size of a dynamic call site."""

    size: int
    winner: str
    # Slowest-rank median microseconds of each choice timed there, as the group keeps
    # them for the key; empty where it was decided untimed.
    timings_us: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # False for a decision taken without timing (a fallback): it proves nothing.
    measured: bool = True
    # The quartiles of each choice's samples (slowest rank), where known.
    low_us: Mapping[str, float] = dataclasses.field(default_factory=dict)
    high_us: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def us(self, choice: str) -> float:
        """``choice``'s time here, inf where it was not timed or failed."""
        t = self.timings_us.get(choice, math.inf)
        return t if math.isfinite(t) else math.inf

    def acceptable(self, choice: str, tolerance: float) -> bool:
        """Whether ``choice`` is within ``tolerance`` of the fastest here, or its
        samples overlap the fastest's (no timing here tells them apart)."""
        if not self.timings_us:
            return False
        best = min(sorted(self.timings_us), key=self.us)
        if not math.isfinite(self.us(best)) or not math.isfinite(self.us(choice)):
            return False
        low = self.low_us.get(choice, self.us(choice))
        return self.us(choice) <= self.us(best) * (1 + tolerance) or low <= (
            self.high_us.get(best, self.us(best))
        )

    def fastest(self) -> str:
        """The fastest choice here (of equals, the first by name), else the winner."""
        if not self.timings_us:
            return self.winner
        return min(sorted(self.timings_us), key=self.us)


@dataclasses.dataclass(frozen=True)
class CollectiveAutotuneRecord:
    """What one rank decided for one call site; alike on all ranks but the timings."""

    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    key: str
    session: str
    decision: Action
    source: Source
    reason: str
    timings: tuple[ChoiceTiming, ...]
    # e.g. "chunked_all_reduce(chunks=4)"; the op's own implementation is "default".
    winner: str
    mode: TimingMode | None = None
    timed_with: str = ""
    # A fallback, or timed without settled confidence: holds for this attempt only.
    provisional: bool = False
    confidence: Confidence | None = None
    trace_s: float = dataclasses.field(default=0.0, compare=False)
    waited_s: float = dataclasses.field(default=0.0, compare=False)
    build_s: float = dataclasses.field(default=0.0, compare=False)
    tuning_s: float = dataclasses.field(default=0.0, compare=False)
    phases: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)
    store_requests: int = dataclasses.field(default=0, compare=False)
    # A dynamic call site's probe: the size decided and what was measured there.
    measurement: Measurement | None = None

    @property
    def size(self) -> int | None:
        """The size a dynamic call site's probe decided; None for a static site."""
        return self.measurement.size if self.measurement is not None else None


class SizePath(str, enum.Enum):
    """How a dynamic-size call site runs each size's winner: inline the winner of the
    one range its sizes lie in, or of the range the graph is guarded on; or dispatch."""

    KNOWN_RANGE = "known range"
    RANGE_GRAPH = "range graph"
    SIZE_DISPATCH = "size dispatch"


@dataclasses.dataclass(frozen=True)
class SizePathRecord:
    """How one dynamic-size call site runs each size's winner, and why."""

    # The op's qualified name ("ns::name") and its autotuning name.
    op: str
    name: str
    path: SizePath
    reason: str
    # e.g. "s0 in (64, inf]"; "" for every size.
    compiled_for: str
    # (top size, winner) per range, ascending; the last top is inf.
    winners: tuple[tuple[float, str], ...]


_State = TypeVar("_State", list[Any], dict[Any, Any])


def cleared_with_inductor_caches(state: _State) -> _State:
    """``state``, registered to be emptied by Inductor's ``fresh_cache``."""
    from torch._inductor.utils import clear_on_fresh_cache

    clear_on_fresh_cache(types.SimpleNamespace(cache_clear=state.clear))
    return state


# For the process until fresh_cache, on purpose: every graph's decisions, for users and
# tests to read after compiling.
_records: list[CollectiveAutotuneRecord] = cleared_with_inductor_caches([])
# As long: how every dynamic call site ran its sizes, for warm_up_sizes across graphs.
_size_paths: list[SizePathRecord] = cleared_with_inductor_caches([])


def collective_autotune_size_paths() -> list[SizePathRecord]:
    """How each dynamic-size call site this process lowered runs, oldest first."""
    return list(_size_paths)


def keep_size_path(record: SizePathRecord) -> None:
    _size_paths.append(record)


def winner_change_points(op: str | None = None) -> list[int]:
    """Ascending sizes after which the dynamic-size call sites this process lowered
    (of op ``op``, a qualified name "ns::name", or of every op) change winner."""
    return sorted(
        {
            int(top)
            for record in _size_paths
            if op is None or record.op == op
            for top, _ in record.winners[:-1]
        }
    )


def collective_autotune_records() -> list[CollectiveAutotuneRecord]:
    """The decisions this process made so far, oldest first."""
    return list(_records)


def keep_record(record: CollectiveAutotuneRecord) -> None:
    _records.append(record)


def format_record(record: CollectiveAutotuneRecord) -> str:
    lines = [
        f"collective autotuning: {record.op} on group {record.group_name} "
        f"(ranks {list(record.group_ranks)}), key {record.key}",
        f"  decision: {record.decision.value} ({record.source.value}); "
        f"winner: {record.winner} ({record.reason})",
    ]
    if record.timed_with:
        lines.append(f"  timed with its pointwise neighbours: {record.timed_with}")
    if record.confidence is not None:
        lines.append(f"  confidence: {record.confidence.describe()}")
    if record.timings:
        width = max(len(t.name) for t in record.timings)
        lines.append(
            f"  {'choice':<{width}}  {'slowest rank us':>15}  "
            f"{'its quartiles us':>17}  {'fastest rank us':>15}  "
            f"{'calls/sample':>12}  {'samples':>7}  {'skew us':>7}  status"
        )
        for t in record.timings:
            mark = "  <- winner" if t.name == record.winner else ""
            quartiles = f"{t.low_us:.1f}-{t.high_us:.1f}"
            lines.append(
                f"  {t.name:<{width}}  {t.max_us:>15.1f}  {quartiles:>17}  "
                f"{t.min_us:>15.1f}  {t.calls_per_sample:>12}  {t.samples:>7}  "
                f"{t.skew_us:>7.1f}  "
                f"{t.reason or t.status.value}{mark}"
            )
    return "\n".join(lines)
