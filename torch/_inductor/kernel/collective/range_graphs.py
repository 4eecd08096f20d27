"""Range graphs: one compiled graph per size range, chosen by Dynamo's guard check.

Where a dynamic collective op's winner changes with size, a dispatch inside the graph
blocks fusion and costs host work per call. Instead the lowering guards on the range
holding the size being compiled and inlines that range's winner alone; a size outside
it fails the guard and recompiles, reusing the ladder's decisions. A guard may only
speed the choice up, never make it right: where guards go unchecked or recompiles are
not allowed, the graph dispatches by size instead.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch._inductor.kernel.collective.graph_state import graph_state

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GuardedRange:
    """The range of sizes (``low``, ``high``] of one symbol a graph is compiled for."""

    size: Any  # sympy expression
    low: float  # 0 below the first range
    high: float  # math.inf above the last
    # Whether this lowering added a guard for it; False where the shape environment or
    # the engine's compile range already holds every size in it.
    guarded: bool

    def __str__(self) -> str:
        high = "inf" if self.high == math.inf else str(int(self.high))
        return f"{self.size} in ({int(self.low)}, {high}]"


def range_of_this_graph(
    size: Any, tops: Sequence[float]
) -> tuple[GuardedRange | None, str]:
    """The range of ``size`` this graph is compiled for, given winners changing at
    ``tops``, and how it was found (known or guarded); or None and why not."""
    known = _known(size, tops)
    if known is not None:
        return known
    why_not = _why_not_guarded(size, tops)
    if why_not is not None:
        return None, why_not
    return _guard(size, tops), (
        "guarded: Dynamo checks the range before every call and compiles the graph "
        "again for a size outside it"
    )


def known_span(size: Any, tops: Sequence[float]) -> tuple[float, float, str]:
    """(low, high, why): the tightest bounds among 0, ``tops`` and inf with every size
    this graph runs at in (low, high], known from the shape environment or
    ``collective_autotune_compile_range``, without adding guards."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    engine = config.collective_autotune_compile_range
    first, last = engine if engine is not None else (None, None)
    low, high, why = 0.0, math.inf, set()
    for top in sorted(t for t in tops if t != math.inf):
        if last is not None and last <= top:
            high, why = min(high, top), why | {"engine"}
        elif sizevars.statically_known_leq(size, int(top)):
            high, why = min(high, top), why | {"shapes"}
        if first is not None and first > top:
            low, why = max(low, top), why | {"engine"}
        elif sizevars.statically_known_gt(size, int(top)):
            low, why = max(low, top), why | {"shapes"}
    said = []
    if "engine" in why:
        said.append(f"collective_autotune_compile_range is {list(engine)}")
    if "shapes" in why:
        said.append(
            "the shape environment bounds it (torch._check, its range, a guard)"
        )
    return low, high, "; ".join(said)


def _known(size: Any, tops: Sequence[float]) -> tuple[GuardedRange, str] | None:
    known = graph_state().known_ranges
    key = (str(size), tuple(sorted(tops)))
    if key not in known:
        low, high, why = known_span(size, tops)
        if len([t for t in tops if low < t <= high]) != 1:
            return None
        known[key] = (
            GuardedRange(size, low, high, guarded=False),
            f"its sizes lie in one range already: {why}",
        )
    return known[key]


def unchecked_guards() -> str | None:
    """Why this compile's shape guards will not be checked before each call with a
    recompile on failure (guard filters, aot/standalone compile, export); None if so."""
    from torch._dynamo import eval_frame
    from torch._guards import CompileContext

    context = torch._guards.TracingContext.try_get()
    if context is None:
        return "no Dynamo frame is compiled (compile_fx called directly, AOTInductor)"
    if torch.compiler.is_exporting():
        return "no Dynamo frame to compile again per range (export)"
    shape_guard = next(
        (
            g
            for g in context.guards_context.dynamo_guards
            if g.create_fn_name() == "SHAPE_ENV"
        ),
        None,
    )
    compile_context = CompileContext.try_get()
    hooks = compile_context.frame_hooks if compile_context is not None else None
    if shape_guard is None or hooks is None:
        return (
            "the graph is not compiled by a Dynamo frame's guarded compile "
            "(aot_compile, standalone_compile, a tracing context of its own): "
            "nothing would compile it again for a size outside the range"
        )
    if hooks.guard_filter_fn is not None and not _kept(
        hooks.guard_filter_fn, shape_guard
    ):
        name = getattr(hooks.guard_filter_fn, "__name__", repr(hooks.guard_filter_fn))
        return f"the frame's guard_filter_fn ({name}) drops its shape guards"
    if eval_frame._is_skip_guard_eval_unsafe_stance():
        return (
            "torch.compiler.set_stance(skip_guard_eval_unsafe=True) checks only the "
            "guards that tell compiled graphs apart"
        )
    if torch._dynamo.config.error_on_recompile:
        return (
            "torch._dynamo.config.error_on_recompile forbids the recompile of each "
            "range"
        )
    return None


def _kept(guard_filter_fn: Any, shape_guard: Any) -> bool:
    from torch._dynamo.guards import make_guard_filter_entry

    try:
        return bool(guard_filter_fn([make_guard_filter_entry(shape_guard, None)])[0])
    except Exception:
        log.debug("the guard filter cannot judge the SHAPE_ENV guard", exc_info=True)
        return False


def _why_not_guarded(size: Any, tops: Sequence[float]) -> str | None:
    from torch._inductor import config
    from torch._inductor.virtualized import V

    if not config.collective_autotune_range_graphs:
        return "collective_autotune_range_graphs is off"
    if getattr(V.graph, "is_backward", False):
        # Compiled after Dynamo installed the frame's guards.
        return (
            "a backward graph cannot add guards, and its forward's do not fix its range"
        )
    if getattr(V.graph, "aot_mode", False):
        return "no Dynamo frame to compile again per range (AOTInductor)"
    unchecked = unchecked_guards()
    if unchecked is not None:
        return unchecked
    cells = len(_partition(size) | set(tops))
    limit = torch._dynamo.config.recompile_limit
    if cells > limit // 2:
        return (
            f"its {cells} ranges would take more than half of Dynamo's recompile limit "
            f"({limit}, torch._dynamo.config.recompile_limit)"
        )
    return None


def _guard(size: Any, tops: Sequence[float]) -> GuardedRange:
    """Guard this graph on the cell of its partition (``tops`` merged in) that holds
    ``size``'s hint, by evaluating ``size <= top`` in order; returns the cell."""
    from torch._inductor.virtualized import V

    partition = _partition(size)
    partition.update(tops)
    low = 0.0
    cell = GuardedRange(size, low, math.inf, guarded=True)
    for top in sorted(partition):
        if top == math.inf or V.graph.sizevars.evaluate_expr(sympy.Le(size, int(top))):
            cell = GuardedRange(size, low, top, guarded=True)
            break
        low = top
    graph_state().guarded_ranges.append(cell)
    return cell


def guarded_range(graph: Any) -> str:
    """The size ranges ``graph`` (a GraphLowering) was guarded on, for its cache entry:
    such an entry is valid only where guards are checked. "" for none."""
    return "; ".join(sorted({str(cell) for cell in graph_state(graph).guarded_ranges}))


def _partition(size: Any) -> set[float]:
    return graph_state().partitions.setdefault(str(size), {math.inf})
