"""Collective ops of dynamic size: lowering the ranges a ladder gave (ladder.py).

Where one choice runs every size, upstream inlines it. Otherwise
:func:`lower_size_dispatch` inlines the winner of the range a range graph is compiled
for (range_graphs.py), or the winners dispatched by size inside the graph. Each
probe's choices are compiled for the benchmark once for every size
(:func:`benchmark_module`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

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
from torch._inductor.kernel.collective.graph_state import graph_state
from torch._inductor.kernel.collective.ladder import data_dependent_size, described
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
from torch._logging import trace_structured
from torch._inductor.runtime.collective_protocol import describe

log = logging.getLogger(__name__)


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


def benchmark_module(
    choice: Any, neighbours: Neighbours, stage: Stage = Stage.COMPILE
) -> Any:
    """``choice`` (a range's SubgraphChoiceCaller) compiled with ``neighbours`` once per
    implementation and graph for every size, so ranges do not each recompile it."""
    from torch._dynamo.utils import counters

    implementation = implementation_of(choice)
    key = (
        unwaited(implementation),
        repr(sorted(choice.decomposition_kwargs.items())),
        str(neighbours),
        stage,
        *map(layout_of, choice.input_nodes),
    )
    modules = graph_state().benchmark_modules
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

    winners = tuple((top, g.impl_name) for top, g in branches)
    size = tensor_inputs[0].get_size()[dim]
    cell, how = range_of_this_graph(size, [top for top, _ in branches])
    if cell is not None:
        counters["inductor"]["collective_autotune_range_graph_sites"] += 1
        taken = next((top, g) for top, g in branches if cell.high <= top)
        dispatch = _traced_dispatch_of(op, [taken], dim, runtime_kwargs, tensor_inputs)
        path = SizePath.RANGE_GRAPH if cell.guarded else SizePath.KNOWN_RANGE
        record = SizePathRecord(op_name(op), name, path, how, str(cell), winners)
        log.info(
            "%s: %s for %s, inlining %s (winners by size: %s): %s",
            name,
            path.value,
            cell,
            taken[1].impl_name,
            described(winners),
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
        record = SizePathRecord(
            op_name(op), name, SizePath.SIZE_DISPATCH, how, "", winners
        )
        log.info(
            "%s dispatches by size inside the graph (%s): %s",
            name,
            described(tuple((top, g.impl_name) for top, g in reachable)),
            how,
        )
    keep_size_path(record)
    graph_state().size_paths[name] = record
    trace_structured(
        "artifact",
        metadata_fn=lambda: {
            "name": "collective_autotuning_size_path",
            "encoding": "json",
        },
        payload_fn=lambda: json.dumps(dataclasses.asdict(record), default=str),
    )
    return dispatch


def size_path_of(graph: Any, site: str) -> SizePathRecord | None:
    """How the call site autotuned as ``site`` ran its sizes in ``graph`` (a
    GraphLowering); None where it had no dynamic size."""
    return graph_state(graph).size_paths.get(site)


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
        # outlives this graph. Branches must return tuples. The tensors' size symbols
        # are operands too, so that each branch's code binds them from its inputs
        # (else only a size assert binds them: none under size_asserts=False).
        n = len(tensors)
        out = torch.ops.higher_order.cond(
            tensors[0].size(dim) <= top,
            lambda *args: _as_tuple(taken(*args[:n])),
            lambda *args: _as_tuple(rest(*args[:n])),
            (*tensors, *_size_symbols(tensors)),
        )
        return out[0] if len(out) == 1 else tuple(out)

    return choose


def _size_symbols(tensors: Sequence[Any]) -> list[torch.SymInt]:
    """Each distinct symbol among ``tensors``' sizes, as the SymInt that holds it."""
    found: dict[str, torch.SymInt] = {}
    for t in tensors:
        for size in t.size():
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                found.setdefault(str(size.node.expr), size)
    return list(found.values())


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


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
    traced = graph_state().traced_dispatches
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
