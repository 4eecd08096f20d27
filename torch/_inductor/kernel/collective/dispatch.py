"""Collective ops of dynamic size: tuning a ladder of size ranges, dispatching by size.

The best collective implementation depends on the message size. :func:`dynamic_ladder`
splits a dynamic dimension into ranges with tops 1, r, r^2, ...; each range is a key of
its own, decided by the group at its top size, and keeps its nearest decided neighbour's
winner unless another is clearly faster (:func:`incumbent`). Adjacent ranges with one
winner merge; :func:`lower_size_dispatch` chooses among the rest by size.
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
    compiled_module,
    implementation_of,
    module_for_benchmark,
    Neighbours,
    Stage,
)
from torch._inductor.kernel.collective.choices import copied_graph, layout_of
from torch._inductor.kernel.collective.detection import (
    lowered_call_names_a_group,
    op_name,
)
from torch._inductor.kernel.collective.range_graphs import (
    known_span,
    range_of_this_graph,
)
from torch._inductor.kernel.collective.records import (
    keep_size_path,
    SizePath,
    SizePathRecord,
)
from torch._inductor.kernel.collective.waits import unwaited
from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings
from torch._inductor.runtime.collective_protocol import process_group_initialized
from torch._logging import trace_structured
from torch.distributed._store_session import describe

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Where one op call is tuned: sizes of one dimension of its first tensor input."""

    tensor_name: str  # the first tensor argument's name in the op's schema
    dim: int
    # Range tops, ascending; the last range is unbounded.
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


# Per graph: any range name -> (its ladder's range names in size order, dimension).
_ladders: weakref.WeakKeyDictionary[Any, dict[str, tuple[list[str], int]]] = (
    weakref.WeakKeyDictionary()
)


# Per ShapeEnv (one per frame compile): the ladder's upper bound of each dynamic size.
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
        and lowered_call_names_a_group(op)
        and process_group_initialized()
    ):
        return None
    size = tensor_inputs[0].get_size()
    dim = next((i for i, s in enumerate(size) if _is_symbolic(s)), None)
    if dim is None or data_dependent_size(tensor_inputs) is not None:
        return None
    settings = BenchmarkSettings.from_config()
    # The bound the frame's first site saw: later sites and the backward graph must
    # use the same ladder though range-graph guards have since narrowed the symbol.
    uppers = _ladder_uppers.setdefault(V.graph.sizevars.shape_env, {})
    if str(size[dim]) not in uppers:
        bounds = V.graph.sizevars.shape_env.bound_sympy(size[dim])
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


def untuned_at_data_dependent_size(
    op: torch._ops.OpOverload, tensor_inputs: Sequence[Any]
) -> bool:
    """Whether collective ``op`` is left untuned, warning once, as a size is
    data-dependent: its own implementation runs (upstream would fail the compile)."""
    if not lowered_call_names_a_group(op):
        return False
    size = data_dependent_size(tensor_inputs)
    if size is None:
        return False
    torch._logging.warning_once(
        log,
        "%s is not tuned where its size %s is data-dependent (unbacked): no choice can "
        "be traced or timed at such a size; the op's own implementation runs",
        op_name(op),
        str(size),
    )
    return True


def range_name(name: str, start: int, end: float) -> str:
    """Inductor's name for one range of a range-based custom op."""
    return f"{name}_range_{int(start)}_{int(end) if end != math.inf else 'inf'}"


_RANGE_NAME = re.compile(r"_range_\d+_(\d+|inf)$")


def is_range(name: str) -> bool:
    """Whether ``name`` is Inductor's name for one range of a range-based custom op
    (ours or one with user-given split points)."""
    return bool(_RANGE_NAME.search(name))


def ladder_of(name: str) -> tuple[list[str], int] | None:
    """(range names in size order, dimension) of the ladder holding range ``name`` in
    the graph being lowered; None for user-given split points."""
    from torch._inductor.virtualized import V

    return _ladders.get(V.graph, {}).get(name)


def range_bounds(range_name_: str) -> tuple[int, float]:
    """The first and last size of a range, by its name (:func:`range_name`)."""
    start, end = range_name_.rsplit("_", 2)[-2:]
    return int(start), math.inf if end == "inf" else float(end)


@dataclasses.dataclass(frozen=True)
class Incumbent:
    """The winner a ladder range keeps unless another choice is clearly faster at its
    top size, so that noise does not buy a size dispatch."""

    winner: str
    won_at: str  # top sizes of the decided ranges it won
    # Both nearest decided neighbours chose it: the range is only screened.
    between: bool


def incumbent(
    ladder: Sequence[str], name: str, decided: Callable[[str], str | None]
) -> Incumbent | None:
    """The winner of the nearest range of ``ladder`` below ``name``, else above, that
    ``decided`` (range name -> winner or None) gives; None where there is none."""
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
    """(range name, winner) of the nearest decided range below (step -1) or above
    (step 1) range ``name``; None where there is none."""
    i = list(ladder).index(name)
    side = reversed(ladder[:i]) if step < 0 else ladder[i + 1 :]
    return next(((n, w) for n in side if (w := decided(n)) is not None), None)


# Per graph: benchmark_module's modules (None: no size-generic module).
_benchmark_modules: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = (
    weakref.WeakKeyDictionary()
)


def benchmark_module(
    choice: Any, neighbours: Neighbours, stage: Stage = Stage.COMPILE
) -> Any:
    """``choice`` (a range's SubgraphChoiceCaller) compiled with ``neighbours`` once per
    implementation and graph for every size, so ranges do not each recompile it."""
    from torch._dynamo.utils import counters
    from torch._inductor.virtualized import V

    implementation = implementation_of(choice)
    key = (
        unwaited(implementation),
        repr(sorted(choice.decomposition_kwargs.items())),
        str(neighbours),
        stage,
        *map(layout_of, choice.input_nodes),
    )
    modules = _benchmark_modules.setdefault(V.graph, {})
    if key not in modules:
        counters["inductor"]["collective_autotune_range_builds"] += 1
        generic = _size_generic_module(choice, neighbours, stage)
        # A deferred load runs once for every range.
        modules[key] = (
            functools.cache(generic)
            if stage is Stage.START and generic is not None
            else generic
        )
    if modules[key] is None:
        return module_for_benchmark(choice, neighbours, stage)
    return modules[key]


def _size_generic_module(choice: Any, neighbours: Neighbours, stage: Stage) -> Any:
    """``choice`` with ``neighbours`` retraced on symbolic sizes and compiled for any
    size; None where the trace fails or would add guards on those sizes."""
    try:
        return compiled_module(
            choice, neighbours.around(implementation_of(choice)), True, stage
        )
    except Exception as e:  # fall back to a module per range
        log.info(
            "%s is compiled for the benchmark at each range's size: no size-generic "
            "module (%s)",
            choice.decomposition.__name__,
            describe(e),
        )
        log.debug("no size-generic module of %s", choice.name, exc_info=True)
        return None


def warm_up_sizes(upper: int | None = None) -> list[int]:
    """Sizes to call a compiled model at before serving so that every range graph is
    compiled: ``upper`` (default ``collective_autotune_dynamic_max``) and the ladder's
    tops below it, descending so each graph's kernels autotune at its largest size."""
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
    """The winner of a range-based collective op for this graph's size range, or its
    winners dispatched by size inside the graph; None for other ops or one winner.

    Unlike upstream: one ``size <= top`` test per branch (OR-ed predicates lift
    scalars Inductor cannot lower), branch subgraphs named per site (Inductor emits
    one function per subgraph name), and CUDA graphs kept (it reads sizes only)."""
    from torch._inductor.codegen.subgraph import inline_subgraph_to_ir_nodes

    if len(impl_groups) < 2 or not lowered_call_names_a_group(op):
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
    """The traced dispatch of :func:`lower_size_dispatch`, logged and recorded."""
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


# Per graph: how each call site, by op name, runs its sizes.
_size_paths: weakref.WeakKeyDictionary[Any, dict[str, SizePathRecord]] = (
    weakref.WeakKeyDictionary()
)


def size_path_of(graph: Any, range_op: str) -> SizePathRecord | None:
    """How the call site of range ``range_op`` ran its sizes in ``graph`` (a
    GraphLowering); None where it had no dynamic size."""
    return _size_paths.get(graph, {}).get(range_op.rsplit("_range_", 1)[0])


def _described(winners: Sequence[tuple[float, str]]) -> str:
    return ", ".join(
        f"{w} up to {int(t) if t != math.inf else 'any'}" for t, w in winners
    )


def _reachable(
    branches: list[tuple[float, Any]], low: float, high: float
) -> list[tuple[float, Any]]:
    """The branches whose sizes meet (low, high], the sizes the graph can run at."""
    bottoms = [0.0, *(top for top, _ in branches[:-1])]
    return [
        branch
        for bottom, branch in zip(bottoms, branches)
        if bottom < high and branch[0] > low
    ]


def _branches(impl_groups: Sequence[Any]) -> list[tuple[float, Any]]:
    """(top size, implementation) in size order, adjacent ranges of one implementation
    merged."""
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
        # The HOP, not torch.cond, which would nest a Dynamo compile whose cache
        # outlives this graph. Branches must return tuples.
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
    """The dispatch among ``branches``, traced once per graph and copied for every
    call site that dispatches alike on inputs of the same sizes (a model's layers)."""
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
    # Copied: each site renames its branches.
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
    """Rename ``dispatch``'s branch subgraphs after the call site of ``name``."""
    from torch._inductor.virtualized import V

    # The operation count makes the name unique per site.
    site = re.sub(r"\W", "_", f"{name}_{len(V.graph.operations)}")
    for node in dispatch.graph.find_nodes(op="get_attr"):
        branch = getattr(dispatch, node.target)
        delattr(dispatch, node.target)
        node.target = f"{site}_{node.target}"
        setattr(dispatch, node.target, branch)
    dispatch.recompile()
