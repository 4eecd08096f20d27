"""What a collective decision is for, and what one rank decided.

A decision is for a *key* (:func:`site_key`): the op, its inputs' sizes, strides and
dtypes, its choices and the code identity of each, how they are timed, the threshold
and what the call site fuses with, as a short digest that every rank computes alike.
Each decision this process makes or loads is kept as a :class:`CollectiveAutotuneRecord`
(:func:`collective_autotune_records`, cleared with Inductor's other caches by
``fresh_cache``); :func:`format_record` writes it as the table that
``TORCH_LOGS=collective_autotuning`` prints and that ``TORCH_TRACE`` keeps for tlparse.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping, Sequence
from typing import Any, TYPE_CHECKING, TypeVar

from torch._inductor.runtime.collective_benchmarking import ChoiceTiming, TimingMode
from torch._inductor.runtime.collective_confidence import Confidence
from torch._inductor.runtime.collective_decisions import digest

if TYPE_CHECKING:
    from torch._inductor.kernel.collective.choice_modules import Neighbours


class Action(str, enum.Enum):
    """What the group did about a key."""

    # Timed its choices now, on every rank.
    BENCHMARK = "benchmark"
    # Took a decision without timing.
    USE = "use"


class Source(str, enum.Enum):
    """Where a decision comes from."""

    # Timed now by the group.
    BENCHMARK = "benchmark"
    # Decided earlier in this job (attempt), by this group.
    JOB = "job"
    # Stored on disk by every rank, and screened again before it was used.
    DISK = "disk"
    # Inlined in a compiled graph that every rank loaded from its cache.
    CACHE = "cache"
    # The common winner of the neighbouring sizes of a dynamic op's range.
    LADDER = "ladder"
    # The group's fallback or its only choice, untimed.
    AGREEMENT = "agreement"


def site_key(
    name: str,
    inputs: Sequence[Any],
    labels: Sequence[str],
    mode: TimingMode,
    min_speedup_threshold: float,
    neighbours: Neighbours,
    code: Mapping[str, str],
) -> str:
    """What a decision is for: the op (by its autotuning name), its inputs' sizes,
    strides and dtypes, its choices, how they are timed, the threshold, what the site
    fuses with (the same op may win alone and lose between pointwise neighbours), and
    the code identity of every implementation (a changed implementation is a new
    key)."""
    return digest(
        name,
        [_node_meta(n) for n in inputs],
        list(labels),
        mode.value,
        min_speedup_threshold,
        str(neighbours),
        sorted(code.items()),
    )


def _node_meta(node: Any) -> str:
    """Size, stride and dtype of an IR node or layout (not its device)."""
    if hasattr(node, "get_size"):
        return f"{node.get_size()}/{node.get_stride()}/{node.get_dtype()}"
    return f"{node.size}/{node.stride}/{node.dtype}"


@dataclasses.dataclass(frozen=True)
class CollectiveAutotuneRecord:
    """What one rank decided for one collective-tuned call site.

    Identical across the group but for the fields that say how long this rank took.
    """

    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    # The decision's key and the session it was agreed in.
    key: str
    session: str
    decision: Action
    source: Source
    reason: str
    timings: tuple[ChoiceTiming, ...]
    # Choices are named by their implementation and parameters, e.g.
    # "chunked_all_reduce(chunks=4)"; the op's own implementation is "default".
    winner: str
    # How choices are (or would have been) timed, and the pointwise neighbours each
    # choice was timed with ("producer+consumer", "none"; collective/choice_modules.py).
    mode: TimingMode | None = None
    timed_with: str = ""
    # A decision taken without the group's agreement on merit (a rank was absent or
    # late), or timed without confidence (see ``confidence``): it holds for this job
    # attempt only, and a cached graph that inlines it is not loaded by another attempt.
    # A timed one is kept on disk as provisional, for the next job to time again.
    provisional: bool = False
    # How far the benchmark's readings can be trusted (runtime/collective_confidence):
    # a benchmarked decision that is not settled is provisional, kept on disk as such
    # and re-timed by the next job. None where nothing was timed.
    confidence: Confidence | None = None
    # Seconds this rank spent tracing the choices (upstream, before the decision),
    # waited for its peers (to arrive, to vote), spent compiling choices, and spent
    # otherwise on the decision (its own votes and the benchmark, whose steps are in
    # ``phases``: every choice's first call, sizing batches, rounds, the reduction);
    # and the Store requests it made for the decision.
    trace_s: float = dataclasses.field(default=0.0, compare=False)
    waited_s: float = dataclasses.field(default=0.0, compare=False)
    build_s: float = dataclasses.field(default=0.0, compare=False)
    tuning_s: float = dataclasses.field(default=0.0, compare=False)
    phases: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)
    store_requests: int = dataclasses.field(default=0, compare=False)


class SizePath(str, enum.Enum):
    """How a call site of a collective op of dynamic size runs each size's winner."""

    # Its sizes lie in one range already (the program's bounds, an engine's compile
    # range, the guards of an earlier site): that range's winner is inlined.
    KNOWN_RANGE = "known range"
    # The graph is guarded on the range holding the size it is compiled at and inlines
    # that range's winner; Dynamo compiles it again for a size outside.
    RANGE_GRAPH = "range graph"
    # The winners are dispatched by size inside the graph.
    SIZE_DISPATCH = "size dispatch"


@dataclasses.dataclass(frozen=True)
class SizePathRecord:
    """How one call site of a collective op of dynamic size runs each size's winner,
    and why: what the log line says, for tools and tests."""

    op: str
    path: SizePath
    reason: str
    # The sizes this graph is compiled for ("s0 in (64, inf]"), or "" for every size.
    compiled_for: str
    # (top size, winner) per range of the graph's winners, in size order; the last
    # range's top is inf. A range graph or a known range lists the ladder's winners,
    # of which it inlines one.
    winners: tuple[tuple[float, str], ...]


_State = TypeVar("_State", list[Any], dict[Any, Any])


def cleared_with_inductor_caches(state: _State) -> _State:
    """``state`` (a list or dict this package keeps between compiles), emptied by
    Inductor's ``fresh_cache`` with Inductor's own caches."""
    from torch._inductor.utils import clear_on_fresh_cache

    clear_on_fresh_cache(types.SimpleNamespace(cache_clear=state.clear))
    return state


# This process's decision records.
_records: list[CollectiveAutotuneRecord] = cleared_with_inductor_caches([])


# How this process's sites of collective ops of dynamic size run each size's winner.
_size_paths: list[SizePathRecord] = cleared_with_inductor_caches([])


def collective_autotune_size_paths() -> list[SizePathRecord]:
    """How each call site of a collective op of dynamic size that this process lowered
    runs each size's winner, oldest first."""
    return list(_size_paths)


def keep_size_path(record: SizePathRecord) -> None:
    _size_paths.append(record)


def winner_change_points(op: str | None = None) -> list[int]:
    """The sizes after which a tuned collective op of dynamic size changes winner, in
    the graphs this process compiled (those of ops whose autotuning name starts with
    ``op``, where given), ascending: sizes up to a point and sizes above it run
    different winners. An engine that compiles per size range (vLLM's
    ``compile_ranges_split_points``) puts them among its split points, and each of its
    range graphs inlines one winner per op with no dispatch and no guard
    (``collective_autotune_compile_range``)."""
    return sorted(
        {
            int(top)
            for record in _size_paths
            if op is None or record.op.startswith(op)
            for top, _ in record.winners[:-1]
        }
    )


def collective_autotune_records() -> list[CollectiveAutotuneRecord]:
    """The decisions this process made so far, oldest first."""
    return list(_records)


def keep_record(record: CollectiveAutotuneRecord) -> None:
    """Add ``record`` to this process's decisions."""
    _records.append(record)


def format_record(record: CollectiveAutotuneRecord) -> str:
    """A table of one decision: choice, slowest- and fastest-rank time, winner."""
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
        # The quartiles are what "clearly faster" compares (collective/timing.py:pick).
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
