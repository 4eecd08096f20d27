"""Collective custom-op autotuning inside Inductor: the hooks upstream calls.

``register_custom_op_autotuning`` tells :func:`note_registration` about each op;
``autotune_custom_op`` lets :func:`prepare_choices` ready its inputs and
implementations, then calls :func:`detect_collective` to learn whether the op's choices
communicate and over which process group; ``AlgorithmSelectorCache`` hands such ops to
:func:`select_collective_choice`. That takes the group's decision for the call site's
key from the graph's session (kernel/collective/graph_sessions.py): a decision made
earlier in the job, one every rank stored on disk (runtime/collective_decisions.py), or
a benchmark of the choices in lockstep on every rank of the group
(runtime/collective_benchmarking.py).

This module only wires those hooks to the modules that do the work, below it: detection
of collectives and their groups (collective/detection.py), the choices' names and code
(collective/choices.py), one site's decision (collective/selection.py, timed by
collective/timing.py), the graph's sessions (collective/graph_sessions.py), dynamic
sizes (collective/dispatch.py), the records and their table (collective/records.py), and
what is installed into upstream at run time (collective/dynamo_callbacks.py). Each
decision is timed in Inductor's compile metrics (``dynamo_timed``, in
``compile_time_autotune_time_us``) and kept as a ``collective_autotuning`` artifact for
tlparse (``TORCH_TRACE``).

Collective sessions never read or write Inductor's local autotune cache: a hit on one
rank and a miss on another is exactly how ranks come to inline different
implementations. Their own decisions are kept per group in the Store and on disk, and
used only where every rank of the group holds the same.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, TYPE_CHECKING

import torch
from torch._inductor.kernel.collective import (
    dispatch,
    dynamo_callbacks,
    graph_sessions,
    selection,
)
from torch._inductor.kernel.collective.choice_modules import (
    neighbours_of_site,
    to_inline,
)
from torch._inductor.kernel.collective.choices import (
    call_arguments,
    check_own_implementation,
    choice_label,
    complete_default_choice,
    DEFAULT,
    guarded_implementation,
    label,
    own_output,
    own_waits,
    RangeWinner,
    register,
    schema_arguments,
    the_op_itself,
    trace_failure,
    traced_once,
)
from torch._inductor.kernel.collective.detection import (
    collective_calls,
    covering_group,
    group_arguments,
    GROUP_ARGUMENTS,
    names_a_collective,
    op_name,
    resolve_group,
)
from torch._inductor.kernel.collective.dispatch import (
    data_dependent_size,
    dynamic_ladder,
    lower_size_dispatch,
    untuned_at_data_dependent_size,
)
from torch._inductor.kernel.collective.graph_sessions import inlined_decisions
from torch._inductor.kernel.collective.records import (
    collective_autotune_records,
    collective_autotune_size_paths,
    CollectiveAutotuneRecord,
    format_record,
    keep_record,
    SizePathRecord,
    winner_change_points,
)
from torch._inductor.kernel.collective.timing import BenchmarkInputs
from torch._inductor.kernel.collective.waits import Waits, wait_for_output
from torch._inductor.runtime.collective_decisions import InlinedDecision
from torch._inductor.runtime.collective_protocol import (
    CollectiveAutotuneError,
    process_group_initialized,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torch._inductor.ir import ChoiceCaller
    from torch._inductor.output_code import CompiledFxGraph


# The hooks upstream's patched files call (the only names they import from collective
# autotuning), and what users read of the decisions.
__all__ = [
    "CollectiveAutotuneError",
    "CollectiveAutotuneRecord",
    "InlinedDecision",
    "SizePathRecord",
    "cached_entry_usable",
    "cached_graph_usable",
    "collective_autotune_records",
    "collective_autotune_size_paths",
    "collective_output_node",
    "detect_collective",
    "dynamic_ladder",
    "format_record",
    "group_takes_cached_entry",
    "group_takes_cached_graph",
    "inlined_decisions",
    "lower_size_dispatch",
    "lowered_once",
    "note_registration",
    "prepare_choices",
    "select_collective_choice",
    "to_inline",
    "traced_once",
    "winner_change_points",
]

log = logging.getLogger(__name__)
table_log = torch._logging.getArtifactLogger(__name__, "collective_autotuning")


def note_registration(op: torch._ops.OpOverload, configs: Sequence[Any] = ()) -> None:
    """Called by register_custom_op_autotuning for every op it registers, with its
    CustomOpConfigs (none for a config generator's)."""
    collective = names_a_collective(op)
    register(op, configs, collective)
    if not collective:
        return
    dynamo_callbacks.install(compiling=False)


def prepare_choices(
    name: str,
    decompositions: Sequence[Callable[..., Any]],
    non_tensor_args: Sequence[dict[str, Any]],
    inputs: Sequence[Any],
    op: torch._ops.OpOverload,
    config_patches_list: Sequence[dict[str, Any]] | None = None,
    min_speedup_threshold: float = 1.0,
    benchmark_with_cudagraphs: bool = False,
) -> tuple[
    list[Callable[..., Any]],
    list[dict[str, Any]],
    list[dict[str, Any]] | None,
    RangeWinner | None,
]:
    """Ready an op's inputs and implementations before its choices are traced.

    Returns the implementations to trace (each guarded: one that raises while traced
    is traced as the op itself and dropped by the whole group), their arguments and
    config patches, and the winner of a range already settled (None otherwise), to
    return untraced. Where the group decided the key already, or collective autotuning
    is off, only the winner (or the op's own stand-in) is traced; at a data-dependent
    size nothing is (upstream lowers the op's own implementation).
    """
    if untuned_at_data_dependent_size(op, inputs):
        _realize(inputs)
        return [], list(non_tensor_args[:1]), None, None
    if _switched_off(op):
        _realize(inputs)
        traced, args, patches = _to_trace(
            DEFAULT,
            _labels(decompositions, non_tensor_args, op),
            decompositions,
            non_tensor_args,
            config_patches_list,
            op,
        )
        return traced, args, patches, None
    labels, site = _prepare_site(
        name,
        decompositions,
        non_tensor_args,
        inputs,
        op,
        min_speedup_threshold,
        benchmark_with_cudagraphs,
    )
    known = _known_range_winner(site)
    if known is not None:
        winner = _range_winner(
            known, labels, decompositions, non_tensor_args, config_patches_list, op
        )
        return list(decompositions), list(non_tensor_args), config_patches_list, winner
    decided = selection.decided_before_tracing(site) if site is not None else None
    traced, args, patches = _to_trace(
        decided, labels, decompositions, non_tensor_args, config_patches_list, op
    )
    return traced, args, patches, None


def _prepare_site(
    name: str,
    decompositions: Sequence[Callable[..., Any]],
    non_tensor_args: Sequence[dict[str, Any]],
    inputs: Sequence[Any],
    op: torch._ops.OpOverload,
    min_speedup_threshold: float,
    benchmark_with_cudagraphs: bool,
) -> tuple[list[str], selection.CallSite | None]:
    """The labels of the op's implementations, and its call site where it is tuned
    collectively (None otherwise): the neighbours it fuses with are read, then its
    inputs realized."""
    neighbours = neighbours_of_site(inputs)
    _realize(inputs)
    labels = _labels(decompositions, non_tensor_args, op)
    site = selection.prepare_site(
        name,
        labels,
        decompositions,
        inputs,
        op,
        non_tensor_args,
        min_speedup_threshold,
        benchmark_with_cudagraphs,
        neighbours,
    )
    if site is not None:
        dynamo_callbacks.install(compiling=True)
    return labels, site


def _known_range_winner(site: selection.CallSite | None) -> str | None:
    """The winner of the site's range where the range lies outside the sizes this graph
    is compiled for, or an earlier call site of the graph settled it; else None."""
    if site is None:
        return None
    outside = selection.range_outside_this_graph(site)
    if outside is not None:
        return outside
    settled = selection.settled_range(site)
    if settled is None:
        return None
    _keep(settled)
    return settled.winner


def _switched_off(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` is a collective op while collective autotuning is off: every rank
    runs its own implementation (selection's untuned record)."""
    from torch._inductor import config

    return not config.collective_autotune and names_a_collective(op)


def _labels(
    decompositions: Sequence[Callable[..., Any]],
    non_tensor_args: Sequence[dict[str, Any]],
    op: torch._ops.OpOverload,
) -> list[str]:
    """The labels of the op's implementations, as records and logs name them."""
    schema = schema_arguments(op)
    return [
        label(d.__name__, kwargs, schema)
        for d, kwargs in zip(decompositions, non_tensor_args)
    ]


def _realize(inputs: Sequence[Any]) -> None:
    """Realize the op's unrealized (pointwise) inputs, which have no strides yet."""
    from torch._inductor.ir import TensorBox

    for inp in inputs:
        if isinstance(inp, TensorBox):
            inp.realize()


def _range_winner(
    winner: str,
    labels: Sequence[str],
    decompositions: Sequence[Callable[..., Any]],
    non_tensor_args: Sequence[dict[str, Any]],
    config_patches_list: Sequence[dict[str, Any]] | None,
    op: torch._ops.OpOverload,
) -> RangeWinner:
    """The ``winner`` of a range that an earlier site of the graph settled, returned
    untraced: the implementation labelled so, or the op's own where none is."""
    i = labels.index(winner) if winner in labels else None  # None: the op's own
    return RangeWinner.create(
        winner,
        None if i is None else guarded_implementation(decompositions[i], op),
        {} if i is None else non_tensor_args[i],
        None if i is None or config_patches_list is None else config_patches_list[i],
        op,
    )


def _to_trace(
    winner: str | None,
    labels: Sequence[str],
    decompositions: Sequence[Callable[..., Any]],
    non_tensor_args: Sequence[dict[str, Any]],
    config_patches_list: Sequence[dict[str, Any]] | None,
    op: torch._ops.OpOverload,
) -> tuple[list[Callable[..., Any]], list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The implementations to trace (guarded), their arguments and config patches:
    all of them, or only the ``winner`` the group decided already and the first."""
    keep = list(range(len(decompositions)))
    traced = [guarded_implementation(d, op) for d in decompositions]
    if winner is not None:
        keep = [
            i for i, candidate in enumerate(labels) if i == 0 or candidate == winner
        ]
        if labels[0] != winner:
            # Upstream gives the op's own implementation the first implementation's
            # arguments: keep those, traced cheaply as the op itself.
            traced[0] = the_op_itself(op, schema_arguments(op))

    def kept(items: Sequence[Any] | None) -> Any:
        return None if items is None else [items[i] for i in keep]

    return kept(traced), kept(non_tensor_args), kept(config_patches_list)


def detect_collective(
    name: str,
    choices: Sequence[ChoiceCaller],
    op_overload: torch._ops.OpOverload,
    non_tensor_args: Sequence[dict[str, Any]],
) -> tuple[list[ChoiceCaller], bool, ProcessGroup | None]:
    """The op's choices to autotune, whether they communicate, and over which process
    group.

    The group comes from the collectives' group argument, else from the op's own
    ``group`` / ``group_name`` / ``process_group`` argument, else WORLD; choices on
    several groups synchronise over the smallest known group containing them all.
    Returns ``(False, None)``, with one warning, where collective tuning cannot
    apply because torch.distributed is not initialised. For a collective op, the op's
    own implementation is made a complete choice (choices.complete_default_choice;
    ``name`` is the op's autotuning name). An op tuned the regular way loses the
    choices whose implementation raised while traced.
    """
    choices = list(choices)

    # Untuned at a data-dependent size (prepare_choices): the op's own, its one choice,
    # taken without a session (select_collective_choice); a collective all the same, so
    # that a wait follows it where its body leaves its output unwaited.
    inputs = getattr(choices[0], "input_nodes", ()) if choices else ()
    if untuned_at_data_dependent_size(op_overload, inputs):
        check_own_implementation(op_overload, inputs, non_tensor_args)
        return choices, True, None
    initialised = process_group_initialized()
    collective, groups = _communication(
        choices, op_overload, non_tensor_args, initialised
    )
    if collective and not initialised:
        torch._logging.warning_once(
            log,
            "%s is a collective op but torch.distributed is not initialised: it is "
            "autotuned like any other op, on this rank alone",
            op_name(op_overload),
        )
        collective = False
    if not collective:
        for choice in [c for c in choices if trace_failure(c)]:
            log.warning(
                "choice %s is dropped: %s",
                choice_label(choice, op_overload),
                trace_failure(choice),
            )
        return [c for c in choices if not trace_failure(c)], False, None
    complete_default_choice(name, choices, op_overload, non_tensor_args)
    group = _synchronised_group(op_overload, groups, non_tensor_args)
    if group.size() == 1:
        # Inductor's regular benchmarking would deadlock on gloo here (see
        # select_collective_choice); a session of one rank costs nothing.
        torch._logging.warning_once(
            log,
            "%s runs on a process group of one rank: nothing to synchronise, it is "
            "timed without waiting for peers",
            op_name(op_overload),
        )
    return choices, True, group


def _synchronised_group(
    op: torch._ops.OpOverload,
    groups: Sequence[Any],
    non_tensor_args: Sequence[dict[str, Any]],
) -> ProcessGroup:
    """The group a collective op's call site synchronises over: the smallest known one
    that contains ``groups`` (those its collectives pass) and the groups its arguments
    name; WORLD where there are none."""
    named = [
        value
        for kwargs in non_tensor_args
        for key, value in kwargs.items()
        if key in GROUP_ARGUMENTS
    ]
    return covering_group([resolve_group(g, op) for g in [*groups, *named]])


def _communication(
    choices: list[ChoiceCaller],
    op: torch._ops.OpOverload,
    non_tensor_args: Sequence[dict[str, Any]],
    initialised: bool,
) -> tuple[bool, list[Any]]:
    """Whether ``op`` or its choices communicate, and the groups (or their names) that
    their collectives pass; where torch.distributed is ``initialised``, what the op's
    own implementation does tells too."""
    groups: list[Any] = []
    # The op's name or arguments may tell what its choices' graphs do not (where only
    # the winner of a decided key was traced, say).
    collective = names_a_collective(op)
    for choice in choices:
        gm = getattr(choice, "gm", None)
        if gm is None or trace_failure(choice):
            continue
        for node in collective_calls(gm):
            collective = True
            groups.extend(group_arguments(node, gm))
    if initialised and (collective or any(trace_failure(c) for c in choices)):
        # The op's own implementation: what every rank falls back to, so it must be
        # right too; where no choice could be traced, it tells whether the op
        # communicates.
        own = check_own_implementation(op, choices[0].input_nodes, non_tensor_args)
        collective = collective or bool(own.groups)
        groups.extend(own.groups)
    return collective, groups


def cached_graph_usable(graph: CompiledFxGraph) -> bool:
    """Asked by the FX-graph cache's lookup of every candidate entry of a key: False
    passes over a graph whose collective decisions this rank cannot take (provisional,
    made in another environment or for changed code, behind a range guard nothing
    checks here), to the key's next entry. Reads nothing over the network."""
    return graph_sessions.cached_graph_usable(graph.collective_decisions)


def group_takes_cached_graph(graph: CompiledFxGraph) -> bool:
    """Asked by ``FxGraphCache.load_with_key`` of a hit, before it counts and uses it:
    whether the process group of each collective decision the graph inlines takes it
    (every rank loaded the same graph, or the group decided so already). False: a
    miss, and the group compiles the graph together."""
    return graph_sessions.group_takes_cached_graph(graph.collective_decisions)


def cached_entry_usable(entry: Any) -> bool:
    """:func:`cached_graph_usable` for an AOTAutograd cache entry: of the graphs it
    bundles (an entry that refers to FX-graph cache entries is checked as those are
    looked up)."""
    return all(cached_graph_usable(graph) for graph in _bundled_graphs(entry))


def group_takes_cached_entry(entry: Any) -> bool:
    """:func:`group_takes_cached_graph` for a hit of the AOTAutograd cache, before it is
    used: of the graphs it bundles, together."""
    return graph_sessions.group_takes_cached_graph(
        [d for graph in _bundled_graphs(entry) for d in graph.collective_decisions]
    )


def _bundled_graphs(entry: Any) -> list[CompiledFxGraph]:
    """The compiled graphs an AOTAutograd cache entry holds itself."""
    parts = (getattr(entry, "compiled_fw", None), getattr(entry, "compiled_bw", None))
    results = [getattr(part, "result", None) for part in parts]
    return [r for r in results if hasattr(r, "collective_decisions")]


def lowered_once(
    op: torch._ops.OpOverload, lowering: Callable[..., Any], name: str
) -> Callable[..., Any]:
    """torch 2.11's lowering of ``op``, autotuned as ``name`` (patch 0005):
    ``lowering``, except where the op is lowered inside its own lowering, at a
    data-dependent size (:func:`untuned_at_data_dependent_size`) or, for a collective
    op, while collective autotuning is off. There the op lowers as itself (a call of
    its eager kernel), followed by a wait where its body leaves a collective's output
    unwaited.

    A range's dispatch, or a range-based op whose every range chose the op's own
    implementation, traces that implementation, the op itself, into the graph; lowering
    it with ``lowering`` again would tune it again, without end. torch 2.13 guards every
    user lowering so; torch 2.11 registers autotuned ops as plain lowerings.

    With collective autotuning off every rank runs the op's own implementation. 2.11's
    own choice of it, a traced subgraph, guards its inputs' sizes
    (codegen/subgraph.py), so that a model of dynamic size compiled at each size it met;
    the op's own call keeps them symbolic, as torch 2.13 on does. Each call site keeps
    the untuned record that :func:`select_collective_choice` keeps there on 2.13 on.
    """
    from torch._inductor.lowering import fallback_handler

    active = False

    @functools.wraps(lowering)
    def lower(*args: Any, **kwargs: Any) -> Any:
        nonlocal active

        def as_itself() -> Any:
            return fallback_handler(op, add_to_fallback_set=False)(*args, **kwargs)

        if active:  # the op itself, traced with its waits (choices.the_op_itself)
            return as_itself()
        tensors = [a for a in args if hasattr(a, "get_size")]
        untuned = untuned_at_data_dependent_size(op, tensors)
        # Where torch.distributed is not initialised, the op is no collective to
        # detect_collective either: upstream lowers it.
        switched_off = _switched_off(op) and process_group_initialized()
        if untuned or switched_off:
            out = as_itself()
            arguments = call_arguments(op, args, kwargs)
            own = check_own_implementation(op, tensors, [arguments])
            if not untuned:
                group = _synchronised_group(op, own.groups, [arguments])
                _keep(selection.untuned_record(name, group))
            return own_output(own, out)
        active = True
        try:
            return lowering(*args, **kwargs)
        finally:
            active = False

    return lower


def select_collective_choice(
    selector: Any,
    name: str,
    choices: list[ChoiceCaller],
    input_nodes: list[Any],
    layout: Any,
    input_gen_fns: dict[int, Callable[..., torch.Tensor]] | None,
    process_group: ProcessGroup,
    min_speedup_threshold: float = 1.0,
    benchmark_with_cudagraphs: bool = False,
) -> ChoiceCaller | RangeWinner:
    """Pick the same choice on every rank of ``process_group``.

    ``selector`` is the AlgorithmSelectorCache, whose ``get_inputs`` makes the
    benchmark inputs. A choice other than the op's own implementation wins only if
    the op's own is at least ``min_speedup_threshold`` times slower on its slowest
    rank; ``benchmark_with_cudagraphs`` times the choices in CUDA graphs. Raises
    CollectiveAutotuneError, on every rank of the group, when the group's
    collectives failed mid-benchmark and cannot be trusted.
    """
    from torch._dynamo.utils import dynamo_timed

    if data_dependent_size(input_nodes) is not None:
        # Untuned (detect_collective): no decision to agree on, the size is the
        # program's.
        return next(c for c in choices if choice_label(c) == DEFAULT)
    with dynamo_timed(
        f"{name}_collective_autotuning",
        log_pt2_compile_event=True,
        dynamo_compile_column_us="compile_time_autotune_time_us",
    ):
        record, by_label = selection.decide_site(
            name,
            choices,
            BenchmarkInputs(selector, input_nodes, layout, input_gen_fns),
            process_group,
            min_speedup_threshold,
            benchmark_with_cudagraphs,
        )
    return _finish(record, by_label)


def collective_output_node(choice: ChoiceCaller) -> Any:
    """The lowered call of ``choice``, the group's pick that is not inlined: the op's
    own implementation is followed by a wait where its body returns a collective's
    output unwaited (choices.check_own_implementation)."""
    node = choice.output_node()
    op = getattr(getattr(choice, "choice", None), "op_overload", None)
    if op is not None and own_waits(op) is Waits.OUTPUT:
        return wait_for_output(node)
    return node


def _finish(
    record: CollectiveAutotuneRecord, by_label: dict[str, ChoiceCaller]
) -> ChoiceCaller | RangeWinner:
    """Log ``record``, keep it, and return the choice it names."""
    _keep(record)
    choice = by_label.get(record.winner)
    if choice is None:
        raise CollectiveAutotuneError(
            f"{record.op}: the group decided on {record.winner} ({record.reason}), "
            f"which this rank does not have; its choices: {list(by_label)}"
        )
    log.debug("%s: %s is Inductor's choice %s", record.op, record.winner, choice.name)
    if dispatch.is_range(record.op):
        return RangeWinner.of(choice, by_label[DEFAULT])
    return choice


def _keep(record: CollectiveAutotuneRecord) -> None:
    """Log ``record``, keep it, and leave it for tlparse."""
    import torch.distributed as dist
    from torch._logging import trace_structured

    keep_record(record)
    log.info(
        "collective autotuning %s on group %s: %s (%s; %s%s; tracing the choices "
        "%.2f s, compiling them %.2f s, timing %.2f s, waiting for the group %.2f s, "
        "%d Store requests)",
        record.op,
        record.group_name,
        record.winner,
        record.source.value,
        record.reason,
        f"; {record.confidence.describe()}" if record.confidence else "",
        record.trace_s,
        record.build_s,
        record.tuning_s,
        record.waited_s,
        record.store_requests,
    )
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "collective_autotuning", "encoding": "json"},
        payload_fn=lambda: json.dumps(dataclasses.asdict(record), sort_keys=True),
    )
    if dist.get_rank() == record.group_ranks[0]:
        table_log.info("%s", format_record(record))
