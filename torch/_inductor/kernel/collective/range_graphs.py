"""Range graphs: one compiled graph per size range, chosen by Dynamo's guard check.

Where the winners of a collective op of dynamic size change along the dimension (the
ladder of collective/dispatch.py found several), a size dispatch inside the graph costs
at every call: ``torch.cond`` is a fusion barrier (each branch copies its operand, and
the producer's pointwise kernel no longer fuses into the collective's input) and,
without CUDA graphs, each layer's dispatch is host work. Instead the lowering *guards*
on the range that holds the size this graph is compiled at (``sizevars.evaluate_expr``
of ``size <= top`` for the range's neighbours: shape guards that Dynamo checks before
every call) and inlines that range's winner alone. A call at a size outside it fails
Dynamo's guard and compiles the graph again, for the range that holds the new size; that
compile reads the ladder's decisions (tuned once, by the group, at the first compile)
and benchmarks nothing. The ranges of every op of a graph on one symbol merge into one
partition: a compile guards the cell of the partition holding its size. Inductor sees
the narrowed range while it compiles (``statically_known_leq`` holds), and the FX-graph
cache keeps one entry per range, found by its guards.

Each range's compile is a Dynamo recompile of the frame, counted against
``torch._dynamo.config.recompile_limit``. The in-graph dispatch stays where a range
cannot be guarded, each logged with its reason (:func:`_why_not_guarded`): the knob
``collective_autotune_range_graphs`` off, no Dynamo frame to recompile (export,
AOTInductor), a user who forbids recompiles (``error_on_recompile``), or more ranges
than half the recompile limit. ``set_stance("fail_on_recompile")`` forbids every
compile, the first included: it is set after a warm-up that compiled every range
(``warm_up_sizes()``, collective/dispatch.py). A data-dependent (unbacked) size is not
tuned at all (collective/dispatch.py:data_dependent_size).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Sequence
from typing import Any

import sympy
import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GuardedRange:
    """The range of sizes (``low``, ``high``] of one symbol that a graph is compiled
    for."""

    size: Any  # the sympy expression of the dynamic size
    low: float  # exclusive; 0 below the first range
    high: float  # inclusive; math.inf above the last

    def __str__(self) -> str:
        high = "inf" if self.high == math.inf else str(int(self.high))
        return f"{self.size} in ({int(self.low)}, {high}]"


# The tops of the ranges guarded so far in each graph being lowered, by size expression:
# the partition that the graph's compiles of every range share.
_partitions: weakref.WeakKeyDictionary[Any, dict[str, set[float]]] = (
    weakref.WeakKeyDictionary()
)


def range_of_this_graph(
    size: Any, tops: Sequence[float]
) -> tuple[GuardedRange | None, str]:
    """The range of ``size`` this graph is compiled for, given an op that changes
    winner at ``tops`` (range tops in size order), and how it was found; or None and why
    the graph must dispatch by size inside.

    A range the graph already knows (the guards of an earlier site or of the forward
    graph, or the program's own bounds, hold ``size`` between two tops) costs nothing;
    else the graph is guarded on the cell of its partition that holds ``size``'s hint
    (:func:`_guard`), where it can be (:func:`_why_not_guarded`)."""
    known = _known(size, tops)
    if known is not None:
        return known, "its sizes lie in one range already"
    why_not = _why_not_guarded(size, tops)
    if why_not is not None:
        return None, why_not
    return _guard(size, tops), "guarded"


# The ranges each graph being lowered knows already, by size expression and tops: what
# the shape environment knows of a size only narrows while a graph is lowered, and every
# layer of a model asks of the same size and tops.
_known_ranges: weakref.WeakKeyDictionary[
    Any, dict[tuple[str, tuple[float, ...]], GuardedRange]
] = weakref.WeakKeyDictionary()


def _known(size: Any, tops: Sequence[float]) -> GuardedRange | None:
    from torch._inductor.virtualized import V

    known = _known_ranges.setdefault(V.graph, {})
    key = (str(size), tuple(sorted(tops)))
    if key not in known:
        found = _known_now(size, tops)
        if found is None:
            return None
        known[key] = found
    return known[key]


def _known_now(size: Any, tops: Sequence[float]) -> GuardedRange | None:
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    low = 0.0
    for top in sorted(tops):
        if top == math.inf or sizevars.statically_known_leq(size, int(top)):
            return GuardedRange(size, low, top) if _known_above(size, low) else None
        low = top
    return None


def _known_above(size: Any, low: float) -> bool:
    from torch._inductor.virtualized import V

    return low == 0 or V.graph.sizevars.statically_known_gt(size, int(low))


def _why_not_guarded(size: Any, tops: Sequence[float]) -> str | None:
    from torch._inductor import config
    from torch._inductor.virtualized import V

    # (A data-dependent size has no ladder: collective/dispatch.py:data_dependent_size.)
    if not config.collective_autotune_range_graphs:
        return "collective_autotune_range_graphs is off"
    if getattr(V.graph, "is_backward", False):
        # Compiled at the first backward call, after Dynamo installed the frame's
        # guards.
        return (
            "a backward graph cannot add guards, and its forward's do not fix its range"
        )
    if torch._guards.TracingContext.try_get() is None or getattr(
        V.graph, "aot_mode", False
    ):
        return "no Dynamo frame to compile again per range (AOTInductor)"
    if torch.compiler.is_exporting():
        return "no Dynamo frame to compile again per range (export)"
    if torch._dynamo.config.error_on_recompile:
        return (
            "torch._dynamo.config.error_on_recompile forbids the recompile of each "
            "range"
        )
    cells = len(_partition(size) | set(tops))
    limit = torch._dynamo.config.recompile_limit
    if cells > limit // 2:
        return (
            f"its {cells} ranges would take more than half of Dynamo's recompile limit "
            f"({limit}, torch._dynamo.config.recompile_limit)"
        )
    return None


def _guard(size: Any, tops: Sequence[float]) -> GuardedRange:
    """Guard this graph on the cell of the graph's partition (``tops`` merged into the
    ranges of its earlier sites) that holds ``size``'s hint, and return the cell.

    ``size <= top`` is evaluated for the partition's tops in order, through Inductor's
    size variables: each evaluation is a guard that Dynamo checks before every call
    (False: ``size > top``), and narrows the range Inductor knows for the rest of
    the compile."""
    from torch._inductor.virtualized import V

    partition = _partition(size)
    partition.update(tops)
    low = 0.0
    for top in sorted(partition):
        if top == math.inf or V.graph.sizevars.evaluate_expr(sympy.Le(size, int(top))):
            return GuardedRange(size, low, top)
        low = top
    return GuardedRange(size, low, math.inf)


def _partition(size: Any) -> set[float]:
    from torch._inductor.virtualized import V

    return _partitions.setdefault(V.graph, {}).setdefault(str(size), {math.inf})
