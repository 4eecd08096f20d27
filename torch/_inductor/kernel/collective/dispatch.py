"""Collective ops of dynamic size: the right implementation at every size, one compile.

The best all-reduce depends on the message size (one-shot for small messages,
two-shot in between, NCCL for the largest), and a serving model compiled once with a
dynamic token dimension sends all of them. When a collective op's first input has a
dynamic dimension and the user gave no split points, :func:`dynamic_ladder` gives
Inductor's range-based custom-op lowering a *ladder* of sizes along that dimension:
1, r, r^2, ... (``collective_autotune_dynamic_ratio``, default 4) up to the symbol's
upper bound, or ``collective_autotune_dynamic_max`` (default 16384) where the symbol
is unbounded. Each range (p_i-1, p_i] is decided at its top size, by the group, as a
key of its own (so it is reused in the job and kept on disk like any other); neighbour
ranges with one winner merge, and the generated code dispatches on the size at run
time (:func:`lower_size_dispatch`: host code in the wrapper, CUDA graphs kept).

Ranges are tuned coarse to fine: the largest and the smallest first, then the middle
of every gap. Every range is timed against every choice, and keeps the winner of its
nearest decided range unless another choice is clearly faster at its top size
(:func:`incumbent`): noise does not buy a dispatch. Where both neighbours chose the same
winner the range is screened: its sampling stops once no choice is clearly faster than
that winner, and a choice that wins only between them is still found. Each
implementation is compiled for the benchmark once, for any size
(:func:`benchmark_module`), and timed at every range's size.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._inductor.kernel.collective.choice_modules import (
    COMPILE,
    compiled_module,
    implementation_of,
    module_for_benchmark,
    Neighbours,
    Stage,
)
from torch._inductor.kernel.collective.choices import copied_graph, layout_of
from torch._inductor.kernel.collective.detection import names_a_collective, op_name
from torch._inductor.kernel.collective.range_graphs import (
    known_span,
    range_of_this_graph,
)
from torch._inductor.kernel.collective.records import (
    keep_size_path,
    SizePath,
    SizePathRecord,
)
from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings
from torch._inductor.runtime.collective_protocol import process_group_initialized
from torch._logging import trace_structured
from torch.distributed._store_session import describe

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Where one op call is tuned: sizes of one dimension of its first tensor input."""

    # The first tensor argument's name in the op's schema, and the dimension.
    tensor_name: str
    dim: int
    # Range tops in ascending order; the last range is unbounded.
    points: tuple[int, ...]
    upper_bound: int

    @property
    def ranges(self) -> list[tuple[int, float]]:
        """The ranges (start, end], in the order they are tuned: coarse to fine."""
        bounds = [
            (start, float(end))
            for start, end in zip(
                (1, *(p + 1 for p in self.points)), (*self.points, math.inf)
            )
        ]
        return [bounds[i] for i in _bisection_order(len(bounds))]


# The range names of each ladder in size order and the dimension they divide, by the
# range name of any of its points, per graph being lowered (they live as long as it).
_ladders: weakref.WeakKeyDictionary[Any, dict[str, tuple[list[str], int]]] = (
    weakref.WeakKeyDictionary()
)


# The ladder's upper bound of each dynamic size, per ShapeEnv (one per Dynamo frame
# compile).
_ladder_uppers: weakref.WeakKeyDictionary[Any, dict[str, int]] = (
    weakref.WeakKeyDictionary()
)


def dynamic_ladder(
    name: str, op: torch._ops.OpOverload, tensor_inputs: Sequence[Any]
) -> Ladder | None:
    """A ladder for this call of ``op`` if it is a collective op whose first input has
    a dynamic dimension; None where the op is tuned at one size."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    if not (
        config.collective_autotune
        and config.collective_autotune_dynamic
        and tensor_inputs
        and names_a_collective(op)
        and process_group_initialized()
    ):
        return None
    size = tensor_inputs[0].get_size()
    dim = next((i for i, s in enumerate(size) if _is_symbolic(s)), None)
    if dim is None or data_dependent_size(tensor_inputs) is not None:
        return None
    settings = BenchmarkSettings.from_config()
    # The bound as the frame's first site saw it: a range graph's guards (set by that
    # site's lowering) narrow the symbol's range for the later sites and for the
    # backward graph (which shares the forward's ShapeEnv), whose ladder must still be
    # the frame's, whichever range it is compiled for.
    uppers = _ladder_uppers.setdefault(V.graph.sizevars.shape_env, {})
    if str(size[dim]) not in uppers:
        bounds = V.graph.sizevars.shape_env.bound_sympy(size[dim])
        # Unbounded (torch's int_oo) unless the program bounded the dimension.
        uppers[str(size[dim])] = (
            int(bounds.upper)
            if isinstance(bounds.upper, sympy.Integer)
            else settings.dynamic_max
        )
    upper = uppers[str(size[dim])]
    points = _points(settings.dynamic_ratio, upper)
    tensor_arguments = [a.name for a in op._schema.arguments if _is_tensor(a)]
    ladder = Ladder(tensor_arguments[0], dim, points, upper)
    names = [range_name(name, start, end) for start, end in sorted(ladder.ranges)]
    ladders = _ladders.setdefault(V.graph, {})
    for n in names:
        ladders[n] = (names, dim)
    log.info(
        "%s has a dynamic size along dim %d of %s (up to %d): tuned at %s",
        name,
        dim,
        ladder.tensor_name,
        upper,
        [*points, upper],
    )
    return ladder


def data_dependent_size(tensor_inputs: Sequence[Any]) -> Any | None:
    """The first data-dependent (unbacked) size of the op's tensor inputs, or None.

    No choice can be traced for the benchmark at such a size (upstream's
    SubgraphChoiceCaller refuses one), no size to time it at is known when the graph is
    compiled, and no guard can choose a range graph by it."""
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


def untuned_at_data_dependent_size(
    op: torch._ops.OpOverload, tensor_inputs: Sequence[Any]
) -> bool:
    """Whether this call of ``op``, a collective op, is left untuned because one of its
    sizes is data-dependent (:func:`data_dependent_size`), warning once: its lowering
    calls the op's own implementation instead (which upstream's would fail the compile
    on), on every rank alike, as the size is the program's. So it is with collective
    autotuning off too: no choice, not even the op's own stand-in, can be traced there."""
    if not names_a_collective(op):
        return False
    size = data_dependent_size(tensor_inputs)
    if size is None:
        return False
    _warn_untuned(op_name(op), str(size))
    return True


@functools.lru_cache(None)  # once per op and size, as Python's own warnings are
def _warn_untuned(op: str, size: str) -> None:
    log.warning(
        "%s is not tuned where its size %s is data-dependent (unbacked): no choice can "
        "be traced or timed at such a size; the op's own implementation runs",
        op,
        size,
    )


def range_name(name: str, start: int, end: float) -> str:
    """Inductor's name for one range of a range-based custom op."""
    return f"{name}_range_{int(start)}_{int(end) if end != math.inf else 'inf'}"


_RANGE_NAME = re.compile(r"_range_\d+_(\d+|inf)$")


def is_range(name: str) -> bool:
    """Whether ``name`` is Inductor's name for one range of a range-based custom op
    (ours or one with user-given split points)."""
    return bool(_RANGE_NAME.search(name))


def ladder_of(name: str) -> tuple[list[str], int] | None:
    """The range names, in size order, of the ladder that range ``name`` belongs to in
    the graph being lowered, and the dimension of the op's first input they divide
    (None for a range of no ladder: the user's split points)."""
    from torch._inductor.virtualized import V

    return _ladders.get(V.graph, {}).get(name)


def range_bounds(range_name_: str) -> tuple[int, float]:
    """The first and last size of a range, by its name (:func:`range_name`)."""
    start, end = range_name_.rsplit("_", 2)[-2:]
    return int(start), math.inf if end == "inf" else float(end)


@dataclasses.dataclass(frozen=True)
class Incumbent:
    """The winner a ladder range keeps unless another choice is clearly faster at its
    top size (by the benchmark's own test for dropping a choice): one implementation
    along the ladder needs no size dispatch, and noise must not buy one."""

    winner: str
    # The top sizes of the decided ranges it won: the nearest below, else above (the
    # smallest range, timed after the largest), or both where both chose it.
    won_at: str
    # Both nearest decided neighbours chose it: the range is only screened, its
    # sampling stopping once no choice is clearly faster than the incumbent.
    between: bool


def incumbent(
    ladder: Sequence[str], name: str, decided: Callable[[str], str | None]
) -> Incumbent | None:
    """The incumbent of range ``name`` of ``ladder`` (range names in size order):
    the winner of its nearest decided range below (a range's sizes lie below its top,
    toward it), else above; None where no range is decided. ``decided`` gives a range's
    decision by its name (None while undecided). Every range is timed: a choice that
    wins only between two sizes that agree is found there."""
    below, above = (
        _nearest_decided(ladder, name, decided, -1),
        _nearest_decided(ladder, name, decided, 1),
    )
    if below is not None and above is not None and below[1] == above[1]:
        return Incumbent(below[1], f"{_top(below[0])} and {_top(above[0])}", True)
    nearest = below or above
    return None if nearest is None else Incumbent(nearest[1], _top(nearest[0]), False)


def _nearest_decided(
    ladder: Sequence[str], name: str, decided: Callable[[str], str | None], step: int
) -> tuple[str, str] | None:
    """(range name, winner) of the nearest decided range of ``ladder`` below (step -1)
    or above (step 1) range ``name``; None where there is none."""
    i = list(ladder).index(name)
    side = reversed(ladder[:i]) if step < 0 else ladder[i + 1 :]
    return next(((n, w) for n in side if (w := decided(n)) is not None), None)


# Benchmark modules of the implementations of range-based ops, per graph being
# lowered: see benchmark_module. None where an implementation has no size-generic
# module.
_benchmark_modules: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = (
    weakref.WeakKeyDictionary()
)


def benchmark_module(
    choice: Any, neighbours: Neighbours, stage: Stage = COMPILE
) -> Any:
    """``choice``, an implementation of one range of a range-based op (a
    SubgraphChoiceCaller; the ladder's ranges or the user's split points), compiled for
    the benchmark with the call site's ``neighbours``: one module per implementation
    and graph, for any size of the dynamic dimension, called with each range's own
    sizes (``choice.sym_input_values``). Counted in
    ``counters["inductor"]["collective_autotune_range_builds"]``.

    Upstream traces the choices afresh at every range; compiling each of them again
    cost 0.25-0.4 s per range of four choices on GPUs (every kernel of a choice is
    compiled anew at each static size), most of the ladder's cost.
    """
    from torch._dynamo.utils import counters
    from torch._inductor.virtualized import V

    implementation = implementation_of(choice)
    key = (
        # The user's function: the wrapper that adds its waits is made anew at every
        # range.
        getattr(implementation, "waits_of", (implementation,))[0],
        repr(sorted(choice.decomposition_kwargs.items())),
        str(neighbours),
        stage,
        *map(layout_of, choice.input_nodes),
    )
    modules = _benchmark_modules.setdefault(V.graph, {})
    if key not in modules:
        counters["inductor"]["collective_autotune_range_builds"] += 1
        generic = _size_generic_module(choice, neighbours, stage)
        # A deferred load is kept as the load itself, done once for every range.
        modules[key] = (
            functools.cache(generic)
            if stage.defer_load and generic is not None
            else generic
        )
    if (
        modules[key] is None
    ):  # without a size-generic module: this range's own, at its size
        return module_for_benchmark(choice, neighbours, stage)
    return modules[key]


def _size_generic_module(choice: Any, neighbours: Neighbours, stage: Stage) -> Any:
    """``choice`` with ``neighbours`` traced once more on its inputs' symbolic sizes and
    compiled for any size; None where that trace would add guards on them (they would
    become the model's guards, and the module would be right only at some sizes) or
    fails.

    torch 2.11 traces a range's choices at the range's size, torch 2.13 on the symbolic
    sizes but afresh at every range: one trace more per implementation serves both.
    """

    try:
        return compiled_module(
            choice, neighbours.around(implementation_of(choice)), True, stage
        )
    except Exception as e:  # each range's own module is timed instead
        log.info(
            "%s is compiled for the benchmark at each range's size: no size-generic "
            "module (%s)",
            choice.decomposition.__name__,
            describe(e),
        )
        log.debug("no size-generic module of %s", choice.name, exc_info=True)
        return None


def warm_up_sizes(upper: int | None = None) -> list[int]:
    """A size in every range that the ladder of a dynamic collective op can have, from
    the top down: ``upper`` (default ``collective_autotune_dynamic_max``; pass the
    model's own bound where it set one) and the ladder's tops below it, …, r², r, 1.

    A serving engine calls its compiled model once at each, after the first compile,
    so that every range's graph (collective/range_graphs.py) is compiled before it
    serves: every merged range holds one of these sizes. Calls at sizes of one range
    after the first compile nothing. From the top down, each range's graph is compiled
    at its largest size: Inductor autotunes a graph's kernels at their first launch,
    for that launch's sizes, and a range's largest steps cost the most (a range graph
    of 1-64 tokens read +3.1% at 64 tokens compiled at 1 token, +0.7% compiled at 64,
    against the model with the same kernel written in, on 2 H200s)."""
    settings = BenchmarkSettings.from_config()
    top = settings.dynamic_max if upper is None else upper
    return [top, *reversed(_points(settings.dynamic_ratio, top))]


def _points(ratio: int, upper: int) -> tuple[int, ...]:
    points = []
    p = 1
    while p < upper:
        points.append(p)
        p *= ratio
    return tuple(points)


def _bisection_order(n: int) -> list[int]:
    """n-1, 0, then the middle of every gap, level by level. The largest sizes first:
    their timings are the least noisy (whole passes over the data, not launches), so
    the smallest range's near-tie goes to their winner."""
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


def _top(range_name_: str) -> str:
    return range_name_.rsplit("_", 1)[-1]


def _is_symbolic(size: Any) -> bool:
    return bool(getattr(size, "free_symbols", None))


def _is_tensor(argument: Any) -> bool:
    return isinstance(argument.type, torch.TensorType)


def lower_size_dispatch(
    op: torch._ops.OpOverload,
    name: str,
    impl_groups: Sequence[Any],
    dim: int,
    runtime_kwargs: dict[str, Any],
    tensor_inputs: Sequence[Any],
) -> Any:
    """The winner of a range-based collective op for the size range this graph is
    compiled for, or its winners dispatched by size inside the graph; None for any
    other op, or where one implementation won every range.

    ``impl_groups`` are upstream's RangeImplGroups: an implementation (``impl_func``,
    ``impl_kwargs``) and the ranges it won. Where the graph can be compiled per range
    (collective/range_graphs.py: Dynamo's guards choose the graph) the site inlines its
    range's winner alone, with no dispatch. Elsewhere the dispatch differs from
    upstream's in three things, each of which broke a serving model with several layers:

    * One comparison per branch, ``size <= top``, along the ranges in size order
      (a range merged with a non-adjacent one of the same winner is a branch of its
      own). Upstream ORs the ranges of a winner together; traced inside an outer
      branch, those compound predicates lift scalar tensors into the branch, which
      Inductor's lowering of ``_local_scalar_dense`` cannot take.
    * The branches' subgraphs are named by the call site. Upstream's are
      ``true_graph_0`` / ``false_graph_0`` at every call site, and Inductor writes
      one function per subgraph name: a second site whose branch takes other
      operands called the first site's function (``too many values to unpack``).
    * CUDA graphs stay on. Inductor turns them off for the whole graph at a
      ``torch.cond`` over device tensors, and keeps the cond out of CUDA-graph
      partitions, because a predicate read from device data can change between
      replays. This predicate reads sizes only: CUDA-graph trees record one graph per
      distinct size, in which the branch taken is fixed (the overlay's edits of the
      cond lowering and of ``Scheduler.should_partition`` say so upstream).
    """
    from torch._inductor.codegen.subgraph import inline_subgraph_to_ir_nodes

    if len(impl_groups) < 2 or not names_a_collective(op):
        return None
    dispatch = _dispatch_of_this_graph(
        op, name, _branches(impl_groups), dim, runtime_kwargs, tensor_inputs
    )
    return inline_subgraph_to_ir_nodes(
        dispatch, list(tensor_inputs), f"{name}_dispatch"
    )


def _dispatch_of_this_graph(
    op: torch._ops.OpOverload,
    name: str,
    branches: list[tuple[float, Any]],
    dim: int,
    runtime_kwargs: dict[str, Any],
    tensor_inputs: Sequence[Any],
) -> torch.fx.GraphModule:
    """The traced dispatch of :func:`lower_size_dispatch`: the winner of the range this
    graph is compiled for alone, or the winners of the ranges its sizes can lie in
    dispatched by size; logged and recorded (``collective_autotune_size_paths()``)."""
    from torch._dynamo.utils import counters
    from torch._inductor.virtualized import V

    winners = tuple((top, g.impl_name) for top, g in branches)
    size = tensor_inputs[0].get_size()[dim]
    cell, how = range_of_this_graph(size, [top for top, _ in branches])
    if cell is not None:
        counters["inductor"]["collective_autotune_range_graph_sites"] += 1
        taken = next((top, g) for top, g in branches if cell.high <= top)
        dispatch = _traced_dispatch_of(op, [taken], dim, runtime_kwargs, tensor_inputs)
        path = (
            SizePath.KNOWN_RANGE
            if how.startswith("its sizes")
            else SizePath.RANGE_GRAPH
        )
        record = SizePathRecord(name, path, how, str(cell), winners)
        log.info(
            "%s: %s for %s, inlining %s (winners by size: %s): %s",
            name,
            path.value,
            cell,
            taken[1].impl_name,
            _described(winners),
            how,
        )
    else:
        counters["inductor"]["collective_autotune_size_dispatches"] += 1
        low, high, _ = known_span(size, [top for top, _ in branches])
        reachable = _reachable(branches, low, high)
        dispatch = _traced_dispatch_of(
            op, reachable, dim, runtime_kwargs, tensor_inputs
        )
        _name_branches_by_site(dispatch, name)
        record = SizePathRecord(name, SizePath.SIZE_DISPATCH, how, "", winners)
        log.info(
            "%s dispatches by size inside the graph (%s): %s",
            name,
            _described(tuple((top, g.impl_name) for top, g in reachable)),
            how,
        )
    keep_size_path(record)
    _size_paths.setdefault(V.graph, {})[name] = record
    trace_structured(
        "artifact",
        metadata_fn=lambda: {
            "name": "collective_autotuning_size_path",
            "encoding": "json",
        },
        payload_fn=lambda: json.dumps(dataclasses.asdict(record), default=str),
    )
    return dispatch


# How each call site of the graph being lowered runs its sizes, by the op's name.
_size_paths: weakref.WeakKeyDictionary[Any, dict[str, SizePathRecord]] = (
    weakref.WeakKeyDictionary()
)


def size_path_of(graph: Any, range_op: str) -> SizePathRecord | None:
    """How the call site that range ``range_op`` belongs to ran its sizes in ``graph``
    (a GraphLowering); None where none of its sites was of dynamic size."""
    return _size_paths.get(graph, {}).get(range_op.rsplit("_range_", 1)[0])


def _described(winners: Sequence[tuple[float, str]]) -> str:
    return ", ".join(
        f"{w} up to {int(t) if t != math.inf else 'any'}" for t, w in winners
    )


def _reachable(
    branches: list[tuple[float, Any]], low: float, high: float
) -> list[tuple[float, Any]]:
    """The branches whose sizes meet (low, high], the sizes a graph can run at: an
    engine's compile range or the program's bounds leave the others unreachable."""
    bottoms = [0.0, *(top for top, _ in branches[:-1])]
    return [
        branch
        for bottom, branch in zip(bottoms, branches)
        if bottom < high and branch[0] > low
    ]


def _branches(impl_groups: Sequence[Any]) -> list[tuple[float, Any]]:
    """(top of the branch's sizes, implementation), in size order: neighbouring
    ranges of one implementation merged."""
    branches: list[tuple[float, Any]] = []
    for bounds, group in sorted(
        ((r, g) for g in impl_groups for r in g.ranges), key=lambda rg: rg[0].start
    ):
        if branches and branches[-1][1] is group:
            branches[-1] = (bounds.end, group)
        else:
            branches.append((bounds.end, group))
    return branches


def _implementation(group: Any, runtime_kwargs: dict[str, Any]) -> Callable[..., Any]:
    """A call of ``group``'s implementation, as a branch of the dispatch."""
    from torch._inductor.kernel.custom_op import _merge_config_and_runtime_kwargs

    kwargs = _merge_config_and_runtime_kwargs(group.impl_kwargs, runtime_kwargs)
    return lambda *tensors: group.impl_func(*tensors, **kwargs)


def _dispatch_from(
    branches: list[tuple[float, Any]], i: int, dim: int, runtime_kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """The dispatch among ``branches[i:]``: a cond on the size per branch."""
    taken = _implementation(branches[i][1], runtime_kwargs)
    if i == len(branches) - 1:
        return taken
    top = int(branches[i][0])
    rest = _dispatch_from(branches, i + 1, dim, runtime_kwargs)

    def choose(*tensors: Any) -> Any:
        # The higher-order op itself, traced by make_fx with its branches: torch.cond
        # would compile a wrapper of it with Dynamo, a nested compile whose cache
        # outlives this graph (a later graph's guard check against it evaluated guards
        # on this graph's frozen shape environment) and which, on torch 2.11, cleared
        # the outer compile's event log under aot_compile. Its branches return tuples.
        out = torch.ops.higher_order.cond(
            tensors[0].size(dim) <= top,
            lambda *t: _as_tuple(taken(*t)),
            lambda *t: _as_tuple(rest(*t)),
            tuple(tensors),
        )
        return out[0] if len(out) == 1 else tuple(out)

    return choose


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# The traced dispatches of each graph being lowered, by what they were traced from.
_traced_dispatches: weakref.WeakKeyDictionary[
    Any, dict[tuple[Any, ...], torch.fx.GraphModule]
] = weakref.WeakKeyDictionary()


def _traced_dispatch_of(
    op: torch._ops.OpOverload,
    branches: list[tuple[float, Any]],
    dim: int,
    runtime_kwargs: dict[str, Any],
    tensor_inputs: Sequence[Any],
) -> torch.fx.GraphModule:
    """The dispatch among ``branches``, traced once per graph for every call site of
    ``op`` that dispatches alike on inputs of the same sizes (a model's layers): a
    copy of the first site's trace, whose branches it shares. Tracing the nested
    torch.cond costs 0.1 s per site on GPUs (0.3 s on CPUs), inlining it a tenth.
    Counted in ``counters["inductor"]["collective_autotune_dispatch_traces"]``."""
    from torch._dynamo.utils import counters
    from torch._inductor.virtualized import V

    key = (
        str(op),
        dim,
        repr(sorted(runtime_kwargs.items())),
        tuple(
            (top, group.impl_name, repr(sorted(group.impl_kwargs.items())))
            for top, group in branches
        ),
        tuple(map(layout_of, tensor_inputs)),
    )
    traced = _traced_dispatches.setdefault(V.graph, {})
    if key not in traced:
        counters["inductor"]["collective_autotune_dispatch_traces"] += 1
        traced[key] = _traced_dispatch(
            _dispatch_from(branches, 0, dim, runtime_kwargs), tensor_inputs
        )
    # The graph copied: each site renames its branches.
    return copied_graph(traced[key])


def _traced_dispatch(
    dispatch: Callable[..., Any], tensor_inputs: Sequence[Any]
) -> torch.fx.GraphModule:
    """``dispatch`` traced on the op's inputs, adding no guard to their sizes."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.ir import ir_node_to_tensor
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    with V.fake_mode, V.graph.sizevars.shape_env.error_on_new_guards():
        return make_fx(
            dispatch, decomposition_table=select_decomp_table(), tracing_mode="symbolic"
        )(*(ir_node_to_tensor(t) for t in tensor_inputs))


def _name_branches_by_site(dispatch: torch.fx.GraphModule, name: str) -> None:
    """Rename the branches' subgraphs of ``dispatch`` after the call site of
    ``name``."""
    from torch._inductor.virtualized import V

    # Unique in the graph being lowered: the operations so far differ at every site.
    site = re.sub(r"\W", "_", f"{name}_{len(V.graph.operations)}")
    for node in dispatch.graph.find_nodes(op="get_attr"):
        branch = getattr(dispatch, node.target)
        delattr(dispatch, node.target)
        node.target = f"{site}_{node.target}"
        setattr(dispatch, node.target, branch)
    dispatch.recompile()
