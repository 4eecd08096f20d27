"""Collective ops of dynamic size: a ladder of sizes, refined where winners change.

The best collective implementation depends on the message size. A call site whose first
tensor input has a dynamic dimension is tuned at a *ladder* of sizes along it (1, r,
r^2, ... and the dimension's bound): each size is a *probe*, a key of its own that the
group decides by timing the choices at that size. Sizes between two probes run what
the probe above them runs; where two neighbouring probes run different choices, the
walk times sizes between them until no size in between loses more than
:data:`TOLERANCE` to the better of the two (:func:`next_size`).

Which choice each range runs follows from the group's measurements alone
(:func:`assign`: a range keeps the choice below it while that choice stays within the
tolerance of the best), so every rank, every later call site and every later graph
derives the same ranges from the same decisions. :func:`lower_ladder` then inlines the
one winner, the winner of the range a range graph is compiled for, or a dispatch by
size (dispatch.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._inductor.kernel.collective.detection import (
    lowered_call_names_a_group,
    op_name,
)
from torch._inductor.kernel.collective.graph_state import frame_state
from torch._inductor.kernel.collective.records import Measurement, winner_change_points
from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings
from torch._inductor.runtime.collective_protocol import process_group_initialized

log = logging.getLogger(__name__)

# How much slower than the best choice a size may run: a range keeps the choice below
# it within this, and the walk refines between two probes until no size loses more.
TOLERANCE = 0.02
# Most probes timed between two neighbouring ladder sizes; a crossover the costs' lines
# do not predict (a step) is bisected, and this bounds the compile time it may take.
MOST_PROBES_BETWEEN = 8


@dataclasses.dataclass(frozen=True)
class Incumbent:
    """The winner a probe keeps unless another choice is clearly faster at its size, so
    that noise does not buy a size dispatch."""

    winner: str
    won_at: str  # the sizes of the probes it won
    # Both nearest decided neighbours chose it: the probe is only screened.
    between: bool


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Where one call site is tuned: sizes of dimension ``dim`` of its tensor input
    ``tensor_name``; ``sizes`` ascending, the last one standing for every size above
    the one before it."""

    op: torch._ops.OpOverload
    name: str  # the op's autotuning name
    tensor_name: str
    dim: int
    sizes: tuple[int, ...]
    # False where the user gave the split points: its ranges are kept as given.
    refine: bool = True


@dataclasses.dataclass(frozen=True)
class Probe:
    """One size of a ladder that the group decides: every choice at a ladder size, the
    two neighbours' choices at a size between them. ``start``: the first size of the
    range it decides as it is timed (for upstream's name of the range)."""

    start: int
    size: int
    choices: tuple[str, ...] | None = None  # None: every choice
    incumbent: Incumbent | None = None


# -- where a call site is tuned --------------------------------------------------------


def dynamic_ladder(
    name: str, op: torch._ops.OpOverload, tensor_inputs: Sequence[Any]
) -> Ladder | None:
    """A ladder for this call of ``op`` if it is a collective op whose first input has
    a dynamic dimension; None where the op is tuned at one size."""
    from torch._inductor import config

    if not (
        config.collective_autotune
        and config.collective_autotune_dynamic
        and tensor_inputs
        and lowered_call_names_a_group(op)
        and process_group_initialized()
    ):
        return None
    size = tensor_inputs[0].get_size()
    dim = next((i for i, s in enumerate(size) if _is_symbolic(s)), None)
    if dim is None or data_dependent_size(tensor_inputs) is not None:
        return None
    settings = BenchmarkSettings.from_config()
    upper = _upper_bound(size[dim], settings.dynamic_max)
    ladder = Ladder(
        op,
        name,
        _first_tensor_argument(op),
        dim,
        (*_points(settings.dynamic_ratio, upper), upper),
    )
    log.info(
        "%s has a dynamic size along dim %d of %s (up to %d): tuned at %s, and between "
        "them where winners change",
        name,
        dim,
        ladder.tensor_name,
        upper,
        list(ladder.sizes),
    )
    return ladder


def given_ladder(
    name: str,
    op: torch._ops.OpOverload,
    dispatch_on: tuple[str, int],
    ranges: Sequence[tuple[int, float]],
    upper_bound: int,
) -> Ladder | None:
    """The user's ``ranges`` of a collective op (from its split points) as a ladder,
    tuned at each range's last size (``upper_bound`` for the unbounded one) and kept as
    given; None for other ops."""
    from torch._inductor import config

    if not (
        config.collective_autotune
        and lowered_call_names_a_group(op)
        and process_group_initialized()
    ):
        return None
    tensor_name, dim = dispatch_on
    tops = [int(end) for _, end in ranges if end != math.inf]
    sizes = (*tops, max(upper_bound, tops[-1] + 1) if tops else upper_bound)
    return Ladder(op, name, tensor_name, dim, sizes, refine=False)


def data_dependent_size(tensor_inputs: Sequence[Any]) -> Any | None:
    """The first data-dependent (unbacked) size of the op's tensor inputs, or None.
    Such a size can be neither traced, timed nor guarded on."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return next(
        (
            size
            for node in tensor_inputs
            for size in node.get_size()
            if free_unbacked_symbols(size)
        ),
        None,
    )


def _upper_bound(size: Any, dynamic_max: int) -> int:
    """The ladder's top for ``size``: its bound, else ``dynamic_max``; the bound the
    frame's first site saw, as later sites and the backward graph must use the same
    ladder though range-graph guards have since narrowed the symbol."""
    from torch._inductor.virtualized import V

    shape_env = V.graph.sizevars.shape_env
    uppers = frame_state(shape_env).ladder_uppers
    if str(size) not in uppers:
        bounds = shape_env.bound_sympy(size)
        uppers[str(size)] = (
            int(bounds.upper)
            if isinstance(bounds.upper, sympy.Integer)
            else dynamic_max
        )
    return uppers[str(size)]


def warm_up_sizes(upper: int | None = None) -> list[int]:
    """Sizes to call a compiled model at, after its first compile and before serving,
    so that every range graph is compiled: ``upper`` (default
    ``collective_autotune_dynamic_max``), the ladder's sizes below it and the sizes
    where this process's tuned ops change winner (the top of every range, found
    between the ladder's sizes too), descending so each graph's kernels autotune at its
    largest size."""
    settings = BenchmarkSettings.from_config()
    top = settings.dynamic_max if upper is None else upper
    sizes = {*_points(settings.dynamic_ratio, top), *winner_change_points(), top}
    return sorted((s for s in sizes if s <= top), reverse=True)


def _points(ratio: int, upper: int) -> tuple[int, ...]:
    points = []
    p = 1
    while p < upper:
        points.append(p)
        p *= ratio
    return tuple(points)


def _is_symbolic(size: Any) -> bool:
    return bool(getattr(size, "free_symbols", None))


def _first_tensor_argument(op: torch._ops.OpOverload) -> str:
    return next(
        a.name for a in op._schema.arguments if isinstance(a.type, torch.TensorType)
    )


# -- which choice each range runs -----------------------------------------------------


def assign(measurements: Sequence[Measurement], tolerance: float) -> list[str]:
    """The choice the range of each of ``measurements`` (ascending) runs: the choice
    of the range below while it is within ``tolerance`` of the best there, else the
    probe's winner (untimed decisions run their winner). Preferring the neighbour's
    choice keeps a near tie from moving a split."""
    running: list[str] = []
    current: str | None = None
    for m in measurements:
        if current is None or not m.timings_us or not m.acceptable(current, tolerance):
            current = m.winner
        running.append(current)
    return running


def unsettled(
    measurements: Sequence[Measurement], running: Sequence[str], tolerance: float
) -> list[int]:
    """Indices i of the neighbouring probes i and i+1 whose ranges run different
    choices where some size between them may lose more than ``tolerance``: the upper
    choice is not within it at the lower probe, and sizes lie between them."""
    return [
        i
        for i, (lo, hi) in enumerate(zip(measurements, measurements[1:]))
        if running[i] != running[i + 1]
        and hi.size - lo.size > 1
        and lo.timings_us
        and hi.timings_us
        and lo.measured
        and hi.measured
        and not lo.acceptable(running[i + 1], tolerance)
    ]


def next_size(
    lo: Measurement, hi: Measurement, choices: tuple[str, str], by_model: bool
) -> int:
    """The size strictly between ``lo`` and ``hi`` to time ``choices`` (the lower and
    upper range's) at next. ``by_model``: the roundest size where the straight lines
    through their timings at ``lo`` and ``hi`` lie within :data:`TOLERANCE` of each
    other (a probe there settles the bracket, and a round size is one that noise in
    the timings rarely moves), else where the lines cross; otherwise, or where the
    lines cannot tell, the geometric middle."""
    low, high = lo.size + 1, hi.size - 1
    middle = min(max(round(math.sqrt(lo.size * hi.size)), low), high)
    window = _tie_window(lo, hi, choices) if by_model else None
    if window is None:
        return middle
    first, last = window
    start, end = max(low, math.ceil(first)), min(high, math.floor(last))
    if start <= end:
        return roundest(start, end)
    return min(max(round((first + last) / 2), low), high)


def _tie_window(
    lo: Measurement, hi: Measurement, choices: tuple[str, str]
) -> tuple[float, float] | None:
    """Where, on the lines through ``choices``' timings at ``lo`` and ``hi``, the upper
    choice comes within the tolerance of the lower one, and where the lower one falls
    behind the upper one by more; None where the timings do not show a crossing."""
    below, above = choices
    a_lo, a_hi, b_lo, b_hi = (m.us(c) for c in (below, above) for m in (lo, hi))
    if not all(math.isfinite(t) and t > 0 for t in (a_lo, a_hi, b_lo, b_hi)):
        return None

    def crossing(ratio: float) -> float | None:
        # Where above's line reaches ``ratio`` times below's.
        f_lo, f_hi = b_lo - ratio * a_lo, b_hi - ratio * a_hi
        if f_lo == f_hi or (f_lo > 0) == (f_hi > 0):
            return None
        return lo.size + (hi.size - lo.size) * f_lo / (f_lo - f_hi)

    first = crossing(1 + TOLERANCE)
    last = crossing(1 / (1 + TOLERANCE))
    if first is None and last is None:
        return None
    return (
        lo.size if first is None else first,
        hi.size if last is None else last,
    )


def roundest(start: int, end: int) -> int:
    """The integer in [start, end] divisible by the highest power of two."""
    power = 1 << max(end.bit_length(), 1)
    while power > 1:
        candidate = -(-start // power) * power
        if candidate <= end:
            return candidate
        power >>= 1
    return start


def branches(
    measurements: Sequence[Measurement], running: Sequence[str]
) -> list[tuple[float, str]]:
    """(top size, choice) per range where the choice changes, ascending; the last top
    is inf."""
    tops: list[tuple[float, str]] = []
    for m, choice in zip(measurements, running):
        if tops and tops[-1][1] == choice:
            tops[-1] = (m.size, choice)
        else:
            tops.append((m.size, choice))
    return [*tops[:-1], (math.inf, tops[-1][1])]


# -- the walk --------------------------------------------------------------------------


# Times (or looks up) one probe: what the group decided there, or None.
Measure = Callable[[Probe], Measurement | None]


def walk(ladder: Ladder, measure: Measure) -> list[Measurement] | None:
    """Every probe of ``ladder``, ascending: its sizes coarse to fine (each keeping its
    nearest decided neighbour's winner unless another choice is clearly faster), then
    sizes between neighbours that run different choices until every bracket settles.
    The same decisions give the same probes on every rank. None where ``measure``
    returns None (a decision it cannot tell)."""
    by_size: dict[int, Measurement] = {}
    starts = (1, *(s + 1 for s in ladder.sizes[:-1]))
    for i in _bisection_order(len(ladder.sizes)):
        size = ladder.sizes[i]
        incumbent = _incumbent(ladder, by_size, size) if ladder.refine else None
        m = measure(Probe(starts[i], size, incumbent=incumbent))
        if m is None:
            return None
        by_size[size] = m
    if ladder.refine:
        return _refined(ladder, by_size, measure)
    return [by_size[s] for s in sorted(by_size)]


def _refined(
    ladder: Ladder, by_size: dict[int, Measurement], measure: Measure
) -> list[Measurement] | None:
    """``by_size`` with probes between neighbours that run different choices, until
    every such bracket is settled or has had :data:`MOST_PROBES_BETWEEN`."""
    spent: dict[int, int] = {}  # probes so far between each ladder size and the next
    while True:
        measurements = [by_size[s] for s in sorted(by_size)]
        running = assign(measurements, TOLERANCE)
        brackets = [
            i
            for i in unsettled(measurements, running, TOLERANCE)
            if spent.get(_ladder_step(ladder, measurements[i].size), 0)
            < MOST_PROBES_BETWEEN
        ]
        if not brackets:
            _log_unsettled(ladder, measurements, running)
            return measurements
        i = brackets[0]
        lo, hi = measurements[i], measurements[i + 1]
        step = _ladder_step(ladder, lo.size)
        spent[step] = spent.get(step, 0) + 1
        choices = (running[i], running[i + 1])
        # Lines through the ends first, then halving, in turn: a crossover the lines do
        # not predict (a step in the costs) still shrinks by half every other probe.
        size = next_size(lo, hi, choices, by_model=spent[step] % 2 == 1)
        incumbent = Incumbent(choices[0], str(lo.size), between=False)
        m = measure(Probe(lo.size + 1, size, choices, incumbent))
        if m is None:
            return None
        by_size[size] = m


def _ladder_step(ladder: Ladder, size: int) -> int:
    """The ladder size at or below ``size``: which gap of the ladder a probe fills."""
    return max((s for s in ladder.sizes if s <= size), default=ladder.sizes[0])


def _log_unsettled(
    ladder: Ladder, measurements: list[Measurement], running: list[str]
) -> None:
    left = unsettled(measurements, running, TOLERANCE)
    if left:
        log.warning(
            "%s: after %d probes the crossover between %s is still not known to within "
            "%g%%; sizes there may run up to their gap slower than the best choice",
            ladder.name,
            MOST_PROBES_BETWEEN,
            ", ".join(
                f"{measurements[i].size} and {measurements[i + 1].size}" for i in left
            ),
            100 * TOLERANCE,
        )


def _incumbent(
    ladder: Ladder, by_size: dict[int, Measurement], size: int
) -> Incumbent | None:
    """The winner of the nearest decided ladder size below ``size``, else above; None
    where there is none. Untimed decisions (a fallback) do not count."""
    decided = [s for s in ladder.sizes if s in by_size and by_size[s].measured]
    below = next((s for s in reversed(decided) if s < size), None)
    above = next((s for s in decided if s > size), None)
    if (
        below is not None
        and above is not None
        and by_size[below].winner == by_size[above].winner
    ):
        return Incumbent(by_size[below].winner, f"{below} and {above}", True)
    nearest = below if below is not None else above
    if nearest is None:
        return None
    return Incumbent(by_size[nearest].winner, str(nearest), False)


def _bisection_order(n: int) -> list[int]:
    """n-1, 0, then the middle of every gap, level by level: the largest sizes, whose
    timings are least noisy, decide first."""
    if n <= 2:
        return list(reversed(range(n)))
    order, gaps = [n - 1, 0], [(0, n - 1)]
    while gaps:
        following = []
        for lo, hi in gaps:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                following += [(lo, mid), (mid, hi)]
        gaps = following
    return order


def described(winners: Sequence[tuple[float, str]]) -> str:
    return ", ".join(
        f"{w} up to {int(t) if t != math.inf else 'any'}" for t, w in winners
    )


def log_walk(ladder: Ladder, measurements: Sequence[Measurement]) -> None:
    running = assign(measurements, TOLERANCE)
    log.info(
        "%s (%s): %s; timed at %s",
        ladder.name,
        op_name(ladder.op),
        described(branches(measurements, running)),
        [m.size for m in measurements],
    )
