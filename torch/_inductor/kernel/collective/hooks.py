"""Collective custom-op autotuning inside Inductor: the hooks upstream calls.

``register_custom_op_autotuning`` reports ops to :func:`note_registration`;
``autotune_custom_op`` readies their choices with :func:`prepare_choices` and
:func:`detect_collective`; ``AlgorithmSelectorCache`` hands a collective op's choices to
:func:`select_collective_choice`, which takes the group's decision for the call site
from the graph's session. These decisions never touch Inductor's local autotune cache:
a hit on one rank and a miss on another would make ranks inline different choices.
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
    dynamo_callbacks,
    graph_sessions,
    recorded_artifacts,
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
    Implementations,
    own_output,
    own_waits,
    RangeWinner,
    register,
    trace_failure,
    traced_once,
)
from torch._inductor.kernel.collective.detection import (
    call_names_a_group,
    collective_calls,
    communicated_groups,
    may_communicate,
    named_groups,
    NamedGroup,
    op_name,
    outside,
    synchronised_group,
)
from torch._inductor.kernel.collective.dispatch import (
    lower_size_dispatch,
    untuned_at_data_dependent_size,
)
from torch._inductor.kernel.collective.ladder import (
    data_dependent_size,
    dynamic_ladder,
)
from torch._inductor.kernel.collective.ladder_lowering import (
    current_probe,
    Probing,
    tuned_ranges,
)
from torch._inductor.kernel.collective.graph_sessions import (
    inlined_decisions,
    loading_saved_artifact,
)
from torch._inductor.kernel.collective.records import (
    CollectiveAutotuneRecord,
    format_record,
    keep_record,
)
from torch._inductor.kernel.collective.timing import BenchmarkInputs, SiteTiming
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


# The names upstream's patched files import (patches/series); users and engines read
# kernel/collective/api.py.
__all__ = [
    "CollectiveAutotuneError",
    "InlinedDecision",
    "cached_entry_usable",
    "cached_graph_usable",
    "collective_output_node",
    "detect_collective",
    "dynamic_ladder",
    "forget_recorded",
    "group_takes_cached_entry",
    "group_takes_cached_graph",
    "inlined_decisions",
    "loading_saved_artifact",
    "lower_size_dispatch",
    "lowered_once",
    "note_registration",
    "prepare_choices",
    "select_collective_choice",
    "to_inline",
    "traced_once",
    "tuned_ranges",
]

log = logging.getLogger(__name__)
table_log = torch._logging.getArtifactLogger(__name__, "collective_autotuning")


def note_registration(op: torch._ops.OpOverload, configs: Sequence[Any] = ()) -> None:
    """Called by register_custom_op_autotuning for each op, with its CustomOpConfigs.
    Only what the schema tells is known here; each call's arguments decide."""
    communicates = may_communicate(op)
    register(op, configs, communicates)
    if not communicates:
        return
    dynamo_callbacks.install(compiling=False)


# Upstream's custom_op passes each of upstream's arguments (patches/series/0001-*).
def prepare_choices(  # noqa: PLR0913
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
    """Ready an op's inputs and (guarded) implementations before its choices are traced.

    Returns those to trace, their arguments and config patches, and a dynamic site's
    probe that the group decided already, to return untraced (else None). A key the
    group decided already traces only its winner; a data-dependent size traces none
    (upstream lowers the op's own).
    """
    implementations = Implementations(
        op, decompositions, non_tensor_args, config_patches_list
    )
    if untuned_at_data_dependent_size(op, inputs):
        _realize(inputs)
        return [], list(non_tensor_args[:1]), None, None
    if _switched_off(op, (non_tensor_args or [{}])[0]):
        _realize(inputs)
        return (*implementations.to_trace(DEFAULT), None)
    timing = SiteTiming(min_speedup_threshold, benchmark_with_cudagraphs)
    probing = current_probe()
    if probing is not None:
        return _prepare_probe(probing, name, implementations, inputs, timing)
    site = _prepare_site(name, implementations, inputs, timing)
    decided = selection.decided_before_tracing(site) if site is not None else None
    return (*implementations.to_trace(decided), None)


def _prepare_site(
    name: str,
    implementations: Implementations,
    inputs: Sequence[Any],
    timing: SiteTiming,
) -> selection.CallSite | None:
    """The call site of op ``name`` where tuned collectively (else None), its inputs
    realized."""
    neighbours = neighbours_of_site(inputs)
    _realize(inputs)
    site = selection.prepare_site(name, implementations, inputs, timing, neighbours)
    if site is not None:
        dynamo_callbacks.install(compiling=True)
    return site


def _prepare_probe(
    probing: Probing,
    name: str,
    implementations: Implementations,
    inputs: Sequence[Any],
    timing: SiteTiming,
) -> tuple[
    list[Callable[..., Any]],
    list[dict[str, Any]],
    list[dict[str, Any]] | None,
    RangeWinner | None,
]:
    """:func:`prepare_choices` for a dynamic site's probe (upstream's range ``name``):
    a decision the group holds already is returned untraced (recorded unless its range
    lies outside this graph's), else the probe's choices are traced."""
    ladder = probing.tuning.ladder
    site = probing.tuning.probe_site(
        probing.probe,
        name,
        lambda: _prepare_site(ladder.name, implementations, inputs, timing),
    )
    if site is None:
        return (*implementations.to_trace(None), None)
    outside = probing.tuning.known_outside(probing.probe)
    if outside is not None:
        from torch._dynamo.utils import counters

        counters["inductor"]["collective_autotune_ranges_outside"] += 1
        probing.measurement = outside
        return (*implementations.as_given(), implementations.winner(outside.winner))
    settled = selection.settled_range(site)
    if settled is not None:
        _keep(settled)
        probing.measurement = settled.measurement
        return (*implementations.as_given(), implementations.winner(settled.winner))
    selection.prepare_probe(site)
    decided = selection.decided_before_tracing(site)
    return (*implementations.to_trace(decided, site.labels), None)


def _switched_off(op: torch._ops.OpOverload, arguments: dict[str, Any]) -> bool:
    """Whether a call of ``op`` with ``arguments`` names a process group while
    collective autotuning is off."""
    from torch._inductor import config

    return not config.collective_autotune and call_names_a_group(op, arguments)


def _realize(inputs: Sequence[Any]) -> None:
    """Realize the op's unrealized (pointwise) inputs, which have no strides yet."""
    from torch._inductor.ir import TensorBox

    for inp in inputs:
        if isinstance(inp, TensorBox):
            inp.realize()


def detect_collective(
    name: str,
    choices: Sequence[ChoiceCaller],
    op_overload: torch._ops.OpOverload,
    non_tensor_args: Sequence[dict[str, Any]],
) -> tuple[list[ChoiceCaller], bool, ProcessGroup | None]:
    """The op's choices to autotune, whether they communicate, and over which group:
    the site's as prepared before tracing where the call names one, else as
    :func:`synchronised_group` finds it from the collectives. Not collective (warned
    once) without torch.distributed. ``name`` is the op's autotuning name.
    """
    choices = list(choices)
    arguments = (non_tensor_args or [{}])[0]

    # Untuned at a data-dependent size, but still a collective: a wait may follow it.
    inputs = getattr(choices[0], "input_nodes", ()) if choices else ()
    if untuned_at_data_dependent_size(op_overload, inputs):
        check_own_implementation(op_overload, inputs, non_tensor_args)
        return choices, True, None
    initialised = process_group_initialized()
    collective, traced, own = _communication(
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
    group = selection.prepared_group(name) or synchronised_group(
        op_overload, arguments, [*traced, *own]
    )
    beyond = outside(group, own)
    if beyond:
        raise CollectiveAutotuneError(
            f"{op_name(op_overload)}: its own implementation {beyond}, which "
            f"{', '.join(n.describe() for n in named_groups(op_overload, arguments))} "
            "names: every rank of a collective op's group must run its fallback"
        )
    if group.size() == 1:
        # Inductor's benchmarking would deadlock on gloo; one rank's session is free.
        torch._logging.warning_once(
            log,
            "%s runs on a process group of one rank: nothing to synchronise, it is "
            "timed without waiting for peers",
            op_name(op_overload),
        )
    return choices, True, group


def _communication(
    choices: list[ChoiceCaller],
    op: torch._ops.OpOverload,
    non_tensor_args: Sequence[dict[str, Any]],
    initialised: bool,
) -> tuple[bool, list[NamedGroup], tuple[NamedGroup, ...]]:
    """Whether the call or its choices communicate, the groups the choices'
    collectives pass, and (once torch.distributed is ``initialised``) those of the
    op's own implementation, which tells too."""
    traced: list[NamedGroup] = []
    # The call tells where the traced graphs cannot (only a decided winner traced).
    collective = call_names_a_group(op, (non_tensor_args or [{}])[0])
    for choice in choices:
        gm = getattr(choice, "gm", None)
        if gm is None or trace_failure(choice):
            continue
        if collective_calls(gm):
            collective = True
            traced.extend(communicated_groups(gm))
    own: tuple[NamedGroup, ...] = ()
    if initialised and (collective or any(trace_failure(c) for c in choices)):
        # Every rank's fallback must be right too, and tells where no choice traced.
        own = check_own_implementation(
            op, choices[0].input_nodes, non_tensor_args
        ).groups
        collective = collective or bool(own)
    return collective, traced, own


def cached_graph_usable(graph: CompiledFxGraph) -> bool:
    """For the FX-graph cache's lookup: False skips a graph whose collective decisions
    this rank cannot take (provisional, stale code or environment). Reads no network."""
    return graph_sessions.cached_graph_usable(graph.collective_decisions)


def group_takes_cached_graph(graph: CompiledFxGraph, key: str) -> bool:
    """For ``FxGraphCache.load_with_key``'s hit of ``key``: whether each decision's group
    takes it (every rank loaded the same graph). False: a miss, which the group
    compiles, and the hit is no artifact of this compile (recorded_artifacts)."""
    if graph_sessions.group_takes_cached_graph(graph.collective_decisions):
        return True
    recorded_artifacts.forget("inductor", key)
    return False


def cached_entry_usable(entry: Any) -> bool:
    """:func:`cached_graph_usable` for the graphs an AOTAutograd cache entry bundles."""
    return all(cached_graph_usable(graph) for graph in _bundled_graphs(entry))


def group_takes_cached_entry(entry: Any, key: str) -> bool:
    """:func:`group_takes_cached_graph` for an AOTAutograd cache hit's graphs."""
    if graph_sessions.group_takes_cached_graph(
        [d for graph in _bundled_graphs(entry) for d in graph.collective_decisions]
    ):
        return True
    recorded_artifacts.forget("aot_autograd", key)
    return False


def forget_recorded(artifact_type: str, key: str) -> None:
    """For AOTAutogradCache.try_load's hit whose compiled graphs were not found (an FX
    graph whose decisions this rank cannot take): the entry is no artifact of this
    compile (recorded_artifacts)."""
    recorded_artifacts.forget(artifact_type, key)


def _bundled_graphs(entry: Any) -> list[CompiledFxGraph]:
    """The compiled graphs an AOTAutograd cache entry holds itself."""
    parts = (getattr(entry, "compiled_fw", None), getattr(entry, "compiled_bw", None))
    results = [getattr(part, "result", None) for part in parts]
    return [r for r in results if hasattr(r, "collective_decisions")]


def lowered_once(
    op: torch._ops.OpOverload, lowering: Callable[..., Any], name: str
) -> Callable[..., Any]:
    """torch 2.11's lowering of ``op``, autotuned as ``name`` (patches/series/0007-*).

    ``lowering``, except inside its own lowering (a range's dispatch traces the op
    itself), at a data-dependent size, or for a collective op with collective autotuning
    off (2.11's traced choice would guard its sizes). There the op lowers as a call of
    its eager kernel, followed by a wait where its body leaves an output unwaited.
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
        # Without torch.distributed, detect_collective tunes it as any other op.
        arguments = call_arguments(op, args, kwargs)
        switched_off = _switched_off(op, arguments) and process_group_initialized()
        if untuned or switched_off:
            out = as_itself()
            own = check_own_implementation(op, tensors, [arguments])
            if not untuned:
                group = synchronised_group(op, arguments, own.groups)
                _keep(selection.untuned_record(name, group))
            return own_output(own, out)
        active = True
        try:
            return lowering(*args, **kwargs)
        finally:
            active = False

    return lower


# Upstream's AlgorithmSelectorCache passes each of its arguments
# (patches/series/0001-*).
def select_collective_choice(  # noqa: PLR0913
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

    A choice beats the op's own only if that is ``min_speedup_threshold`` times slower
    on its slowest rank. Raises CollectiveAutotuneError, on every rank of the group,
    where the group's collectives failed mid-benchmark.
    """
    from torch._dynamo.utils import dynamo_timed

    if data_dependent_size(input_nodes) is not None:
        # Untuned (detect_collective): the size is the program's, nothing to agree on.
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
            SiteTiming(min_speedup_threshold, benchmark_with_cudagraphs),
        )
    return _finish(record, by_label)


def collective_output_node(choice: ChoiceCaller) -> Any:
    """The lowered call of ``choice``, the group's pick when not inlined; the op's own
    is followed by a wait where its body returns a collective's output unwaited."""
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
    probing = current_probe()
    if probing is not None:
        probing.measurement = record.measurement
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
