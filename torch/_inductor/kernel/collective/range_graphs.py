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
``torch._dynamo.config.recompile_limit``. A guard may only speed the choice of winner
up, never be what makes it right: where nothing would check the guard
(:func:`unchecked_guards`: a guard filter that drops shape guards, as serving engines
set, ``aot_compile``, ``standalone_compile``, export, AOTInductor,
``skip_guard_eval_unsafe``) or no recompile is allowed (``error_on_recompile``, more
ranges than half the recompile limit, the knob ``collective_autotune_range_graphs``
off), the graph dispatches by size inside instead, and says why. A graph whose sizes
are bounded within one range already (``torch._check``, an engine's compile range:
``collective_autotune_compile_range``) inlines that range's winner with no guard. A
cached range graph is loaded only where its guard is checked. ``set_stance(
"fail_on_recompile")`` is for after a warm-up that compiled every range
(``warm_up_sizes()``, collective/dispatch.py).
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

    A range the graph already knows (:func:`known_span`: the program's bounds, the
    guards of an earlier site or of the forward graph, an engine's compile range) costs
    nothing; else the graph is guarded on the cell of its partition that holds
    ``size``'s hint (:func:`_guard`), where Dynamo checks that guard before every call
    and compiles the graph again for a size outside it (:func:`_why_not_guarded`)."""
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
    """(low, high, why): the tightest ``low`` and ``high`` among 0, ``tops`` and inf
    such that every size this graph runs at lies in (low, high], and what bounds them:
    the shape environment (``torch._check``, the symbol's range, an earlier site's
    guard) or the engine's compile range (``collective_autotune_compile_range``,
    inclusive)."""
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


# The ranges each graph being lowered knows already, by size expression and tops: what
# the shape environment knows of a size only narrows while a graph is lowered, and every
# layer of a model asks of the same size and tops.
_known_ranges: weakref.WeakKeyDictionary[
    Any, dict[tuple[str, tuple[float, ...]], tuple[GuardedRange, str]]
] = weakref.WeakKeyDictionary()


def _known(size: Any, tops: Sequence[float]) -> tuple[GuardedRange, str] | None:
    from torch._inductor.virtualized import V

    known = _known_ranges.setdefault(V.graph, {})
    key = (str(size), tuple(sorted(tops)))
    if key not in known:
        low, high, why = known_span(size, tops)
        if len([t for t in tops if low < t <= high]) != 1:
            return None
        known[key] = (
            GuardedRange(size, low, high),
            f"its sizes lie in one range already: {why}",
        )
    return known[key]


def unchecked_guards() -> str | None:
    """Why no guard that this compile adds will pick the graph by its sizes at run
    time (checked before every call, a failed one compiling the frame again); None
    where Dynamo does.

    Serving engines compile so: vLLM passes ``guard_filter_fn=
    torch.compiler.skip_all_guards_unsafe`` and calls the model at every size, an
    ``aot_compile``-d function raises on a failed guard, a ``standalone_compile``-d
    artifact runs without Dynamo. A guard filter is asked about the frame's SHAPE_ENV
    guard, the one Dynamo builds every shape guard from; a filter that cannot judge
    that entry alone is taken to drop it."""
    from torch._dynamo import eval_frame
    from torch._dynamo.convert_frame import compiling_frame_hooks

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
    hooks = compiling_frame_hooks()
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
        # The SHAPE_ENV guard's entry has no name, so no value to read: no builder.
        return bool(guard_filter_fn([make_guard_filter_entry(shape_guard, None)])[0])
    except Exception:
        log.debug("the guard filter cannot judge the SHAPE_ENV guard", exc_info=True)
        return False


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
    cell = GuardedRange(size, low, math.inf)
    for top in sorted(partition):
        if top == math.inf or V.graph.sizevars.evaluate_expr(sympy.Le(size, int(top))):
            cell = GuardedRange(size, low, top)
            break
        low = top
    _guarded.setdefault(V.graph, []).append(cell)
    return cell


# The cells each graph being lowered was guarded on.
_guarded: weakref.WeakKeyDictionary[Any, list[GuardedRange]] = (
    weakref.WeakKeyDictionary()
)


def guarded_range(graph: Any) -> str:
    """The size ranges ``graph`` (a GraphLowering) was guarded on, as its cache entry
    records them ("" for none): such a graph is right only where its guards are
    checked (:func:`unchecked_guards`)."""
    return "; ".join(sorted({str(cell) for cell in _guarded.get(graph, [])}))


def _partition(size: Any) -> set[float]:
    from torch._inductor.virtualized import V

    return _partitions.setdefault(V.graph, {}).setdefault(str(size), {math.inf})
