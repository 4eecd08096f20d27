"""Collective custom-op autotuning inside Inductor: detection and choice selection.

``register_custom_op_autotuning`` tells :func:`note_registration` about each op;
``autotune_custom_op`` lets :func:`prepare_choices` ready its inputs and
implementations, then calls :func:`detect_collective` to learn whether the op's
choices communicate and over which process group; ``AlgorithmSelectorCache`` hands
such ops to :func:`select_collective_choice`. That takes the group's decision for the
call site's key from the graph's session (kernel/collective_graph.py): a decision made
earlier in the job, one every rank stored on disk (runtime/collective_decisions.py),
or a benchmark of the choices in lockstep on every rank of the group
(runtime/collective_benchmarking.py).

Collective sessions never read or write Inductor's local autotune cache: a hit on one
rank and a miss on another is exactly how ranks come to inline different
implementations. Their own decisions are kept per group in the Store and on disk, and
used only where every rank of the group holds the same.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, Callable, Optional, Sequence, TYPE_CHECKING

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._inductor.kernel import collective_dispatch, collective_graph
from torch._inductor.kernel.collective_choice_modules import (
    compiled_module,
    implementation_of,
    Neighbours,
    neighbours_of_site,
)
from torch._inductor.kernel.collective_graph import digest, GROUP_ARGUMENTS, op_name, SiteReport
from torch._inductor.runtime.collective_benchmarking import (
    benchmark_device,
    BenchmarkSettings,
    Candidate,
    ChoiceTiming,
    CollectiveBenchmarker,
    TIE_FRACTION,
    is_collective_op,
    uses_symmetric_memory,
)
from torch._inductor.runtime.collective_decisions import (
    DecisionStore,
    environment,
    StoredDecision,
)
from torch._inductor.runtime.collective_protocol import (
    CollectiveAutotuneError,
    CollectiveSession,
    waited_seconds,
)


if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torch._inductor.ir import ChoiceCaller


log = logging.getLogger(__name__)
table_log = torch._logging.getArtifactLogger(__name__, "collective_autotuning")

# The label of the op's own implementation among its choices.
DEFAULT = "default"


@dataclasses.dataclass(frozen=True)
class CollectiveAutotuneRecord:
    """What one rank decided for one collective-tuned call site.

    Identical across the group but for the fields that say how long this rank took.
    """

    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    # The decision's key (op, shapes, choices, timing mode) and the session it was
    # agreed in.
    key: str
    session: str
    # "benchmark" (timed now) or "use" (taken without timing), where the decision
    # came from ("benchmark", "job": decided earlier in this job, "disk": stored by
    # every rank, "cache": inlined in a cached graph every rank loaded, "ladder": the
    # winner of both neighbouring sizes of a dynamic op, "agreement": the group's
    # fallback or only choice), and why.
    decision: str
    source: str
    reason: str
    timings: tuple[ChoiceTiming, ...]
    # Choices are named by their implementation and parameters, e.g.
    # "chunked_all_reduce(chunks=4)"; the op's own implementation is "default".
    winner: str
    # How choices are (or would have been) timed: "graph" (CUDA graphs) or "eager",
    # and the pointwise neighbours each choice was timed with ("producer+consumer",
    # "none"; collective_choice_modules).
    mode: str = ""
    timed_with: str = ""
    # Seconds this rank waited for its peers (to arrive, to vote), spent compiling
    # choices, and spent otherwise on the decision (its own votes and the benchmark).
    waited_s: float = dataclasses.field(default=0.0, compare=False)
    build_s: float = dataclasses.field(default=0.0, compare=False)
    tuning_s: float = dataclasses.field(default=0.0, compare=False)


_records: list[CollectiveAutotuneRecord] = []
# Each collective op's OpOverload by its autotuning name, as detection found it.
_ops: dict[str, Any] = {}


def collective_autotune_records() -> list[CollectiveAutotuneRecord]:
    """The decisions this process made so far, oldest first."""
    return list(_records)


# -- registration and choices ---------------------------------------------------------


def note_registration(op: Any) -> None:
    """Called by register_custom_op_autotuning for every op it registers."""
    from torch._functorch import config as functorch_config

    collective = names_a_collective(op)
    collective_graph.note_registration(op, collective)
    if collective and functorch_config.bundled_autograd_cache:
        _warn_once(
            "torch._functorch.config.bundled_autograd_cache loads compiled graphs without "
            f"the FX-graph cache, so cached graphs that inline {op_name(op)} are not "
            "checked against the group's decisions; turn it off under torchrun"
        )


def names_a_collective(op: Any) -> bool:
    """Whether ``op``'s name, or a process-group argument, says it communicates."""
    schema = getattr(op, "_schema", None)
    return is_collective_op(op) or (
        schema is not None and any(a.name in GROUP_ARGUMENTS for a in schema.arguments)
    )


def prepare_choices(
    name: str,
    decompositions: Sequence[Callable[..., Any]],
    non_tensor_args: Sequence[dict[str, Any]],
    inputs: Sequence[Any],
    op: Any,
    config_patches_list: Optional[Sequence[dict[str, Any]]] = None,
    min_speedup_threshold: float = 1.0,
    benchmark_with_cudagraphs: bool = False,
) -> tuple[list[Callable[..., Any]], list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """Ready an op's inputs and implementations before its choices are traced.

    Inputs are realized: an unrealized (pointwise) input has no strides for the
    layout inference of the choices. What the call site fuses with in the model is
    read first: the choices are timed with it. Each implementation is guarded: one that raises
    while traced (a capability check, say) is traced as the op itself instead and
    marked, so that the choice list stays the same on every rank and the group drops
    that choice everywhere, naming the rank and the reason, instead of this rank
    dying alone while its peers wait. Where the op's group decided the call site's
    key already, only the winner is traced (and the first implementation, whose
    arguments upstream gives the op's own implementation): a model's hundredth
    layer costs no more to compile than an untuned one.

    Returns the implementations, their arguments and their config patches to trace.
    """
    from torch._inductor.ir import TensorBox

    _prepared.pop(name, None)  # an earlier compile's, whatever this one finds
    neighbours = neighbours_of_site(inputs, collective_dispatch.is_range(name))
    for inp in inputs:
        if isinstance(inp, TensorBox):
            inp.realize()
    schema = _schema_arguments(op)
    labels = [_label(d.__name__, kwargs, schema) for d, kwargs in zip(decompositions, non_tensor_args)]
    keep = list(range(len(decompositions)))
    winner = _decided_before_tracing(
        name, labels, inputs, op, non_tensor_args, min_speedup_threshold, benchmark_with_cudagraphs,
        neighbours,
    )
    traced = [_guarded(d, op) for d in decompositions]
    if winner is not None:
        keep = [i for i, label in enumerate(labels) if i == 0 or label == winner]
        if labels[0] != winner:
            # Upstream gives the op's own implementation the first implementation's
            # arguments: keep those, traced cheaply as the op itself.
            traced[0] = _the_op_itself(op, schema)

    def kept(items: Optional[Sequence[Any]]) -> Any:
        return None if items is None else [items[i] for i in keep]

    return kept(traced), kept(non_tensor_args), kept(config_patches_list)


def _the_op_itself(op: Any, schema: set[str]) -> Callable[..., Any]:
    """A stand-in implementation: the op's own call (never chosen; its name is no
    implementation's)."""

    def the_op_itself(*args: Any, **kwargs: Any) -> Any:
        return op(*args, **{k: v for k, v in kwargs.items() if k in schema})

    return the_op_itself


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """An op about to be tuned, as prepare_choices saw it before it traced only the
    winner of a decided key: the key, every choice, what the site fuses with, and why
    a decision was taken before tracing ("" for a decision the group made)."""

    key: str
    labels: tuple[str, ...]
    neighbours: Neighbours
    source: str = ""
    reason: str = ""
    # A ladder range's: the winner of the range just below (once decided), and its top size.
    below: Optional[tuple[str, str]] = None


_prepared: dict[str, _Prepared] = {}


def _decided_before_tracing(
    name: str,
    labels: list[str],
    inputs: Sequence[Any],
    op: Any,
    non_tensor_args: Sequence[dict[str, Any]],
    min_speedup_threshold: float,
    benchmark_with_cudagraphs: bool,
    neighbours: Neighbours,
) -> Optional[str]:
    """The group's decision for this call site's key if it is known already (a read
    of the Store, no waiting), for ops whose name or arguments say they communicate."""
    import torch.distributed as dist
    from torch._inductor import config

    if not (
        names_a_collective(op)
        and config.collective_autotune
        and dist.is_available()
        and dist.is_initialized()
        and inputs
    ):
        return None
    named = [v for k, v in (non_tensor_args or [{}])[0].items() if k in GROUP_ARGUMENTS]
    try:
        group = _resolve_group(named[0], op) if named else dist.group.WORLD
    except (ValueError, TypeError):
        return None  # detection reports it with the full story
    settings = BenchmarkSettings.from_config()
    device = benchmark_device(inputs[0].get_device())
    mode = _timing_mode(settings, device, benchmark_with_cudagraphs)
    labels = (*labels, DEFAULT)

    def key_of(site: str) -> str:
        return _site_key(site, inputs, labels, mode, min_speedup_threshold, neighbours)

    decisions = collective_graph.group_decisions(group, settings.timeout)
    key = key_of(name)

    def decided(site: str) -> Optional[str]:
        return decisions.get(key_of(site))

    # Every rank interpolates alike, whoever published first.
    between = collective_dispatch.interpolated(name, decided)
    if between is not None:
        _prepared[name] = _Prepared(key, labels, neighbours, "ladder", between[1])
        return decisions.publish(key, between[0])
    _prepared[name] = _Prepared(
        key, labels, neighbours, below=collective_dispatch.decided_below(name, decided)
    )
    return decisions.get(key)


def _guarded(decomposition: Callable[..., Any], op: Any) -> Callable[..., Any]:
    from torch.fx.experimental import symbolic_shapes

    # Upstream skips implementations that add guards (torch 2.13 raises these while it
    # traces), on every rank alike: they pass through.
    guard_errors = tuple(
        e for e in (getattr(symbolic_shapes, "_ShapeEnvGuardError", None), AssertionError) if e
    )
    schema = _schema_arguments(op)

    @functools.wraps(decomposition)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return decomposition(*args, **kwargs)
        except guard_errors:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the group by the choice
            guarded.trace_failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"  # type: ignore[attr-defined]
            log.debug("implementation %s raised while traced", decomposition.__name__, exc_info=True)
            return op(*args, **{k: v for k, v in kwargs.items() if k in schema})

    guarded.trace_failure = ""  # type: ignore[attr-defined]
    return guarded


def choice_label(choice: ChoiceCaller, op: Any = None) -> str:
    """A choice's readable name: its implementation and the parameters its config set
    (``chunked_all_reduce(chunks=4)``), or "default" for the op's own implementation.
    The same on every rank, whatever Inductor numbered the choice."""
    decomposition = getattr(choice, "decomposition", None)
    if getattr(choice, "gm", None) is None or decomposition is None:
        return DEFAULT
    return _label(
        decomposition.__name__, getattr(choice, "decomposition_kwargs", {}), _schema_arguments(op)
    )


def _label(implementation: str, kwargs: dict[str, Any], schema: set[str]) -> str:
    params = {k: v for k, v in sorted(kwargs.items()) if k not in schema}
    if not params:
        return implementation
    return f"{implementation}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


def _schema_arguments(op: Any) -> set[str]:
    return {a.name for a in op._schema.arguments} if hasattr(op, "_schema") else set()


def _trace_failure(choice: ChoiceCaller) -> str:
    """Why ``choice`` cannot be used, as tracing shows alike on every rank, or ""."""
    return getattr(getattr(choice, "decomposition", None), "trace_failure", "") or (
        collective_graph.unwaited_collective(getattr(choice, "gm", None))
    )


# -- detection -------------------------------------------------------------------


def detect_collective(
    name: str,
    choices: list[ChoiceCaller],
    op_overload: Any,
    non_tensor_args: Sequence[dict[str, Any]],
) -> tuple[bool, Optional[ProcessGroup]]:
    """Whether the op's choices communicate, and over which process group.

    The group comes from the collectives' group argument, else from the op's own
    ``group`` / ``group_name`` / ``process_group`` argument, else WORLD; choices on
    several groups synchronise over the smallest known group containing them all.
    Returns ``(False, None)``, with one warning, where collective tuning cannot
    apply because torch.distributed is not initialised. For a collective op, also
    makes the op's own implementation a complete choice (see
    :func:`_complete_default_choice`); ``name`` is the op's autotuning name. An op
    tuned the regular way loses the choices whose implementation raised while traced.
    """
    groups: list[Any] = []
    # The op's name or arguments may tell what its choices' graphs do not (where only
    # the winner of a decided key was traced, say).
    collective = names_a_collective(op_overload)
    for choice in choices:
        gm = getattr(choice, "gm", None)
        if gm is None or _trace_failure(choice):
            continue
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(
                node.target, torch._ops.OpOverload
            ) and is_collective_op(node.target):
                collective = True
                groups.extend(_group_arguments(node.target, node.args, node.kwargs, gm))
    import torch.distributed as dist

    if collective and not (dist.is_available() and dist.is_initialized()):
        _warn_once(
            f"{op_name(op_overload)} is a collective op but torch.distributed is not "
            "initialised: it is autotuned like any other op, on this rank alone"
        )
        collective = False
    if not collective:
        for choice in [c for c in choices if _trace_failure(c)]:
            log.warning("choice %s is dropped: %s", choice_label(choice, op_overload), _trace_failure(choice))
            choices.remove(choice)
        return False, None
    for kwargs in non_tensor_args:
        groups.extend(v for k, v in kwargs.items() if k in GROUP_ARGUMENTS)
    _complete_default_choice(name, choices, op_overload, non_tensor_args)
    _ops[name] = op_overload
    group = _covering_group([_resolve_group(g, op_overload) for g in groups])
    if group.size() == 1:
        # Inductor's regular benchmarking would deadlock on gloo here (see
        # select_collective_choice); a session of one rank costs nothing.
        _warn_once(
            f"{op_name(op_overload)} runs on a process group of one rank: nothing to "
            "synchronise, it is timed without waiting for peers"
        )
    return True, group


# torch 2.11's op's-own-implementation choices made here, one per autotune name.
_default_choices: dict[str, Any] = {}


def _complete_default_choice(
    name: str, choices: list[ChoiceCaller], op: Any, non_tensor_args: Sequence[dict[str, Any]]
) -> None:
    """Make the op's own implementation a complete choice, present at every compile.

    It is what every rank falls back to when the group does not assemble, so ranks
    with different compile histories must list it alike. torch 2.13 always appends
    it, with the op's non-tensor arguments bound. torch 2.11 appends it only the
    first time the op is compiled in a process (its extern kernel's name is taken
    afterwards) and without those arguments, so it could not become the op's output
    node: here it gets them, and where it is missing it is appended as 2.13 does it,
    one extern choice per op with the arguments bound at each compile, under 2.11's
    name for it.
    """
    from torch._inductor.select_algorithm import ExternKernelCaller, ExternKernelChoice

    schema = getattr(op, "_schema", None)
    names = {a.name for a in schema.arguments} if schema is not None else set()
    kwargs = {k: v for k, v in (non_tensor_args or [{}])[0].items() if k in names}
    default = _default_choice(choices)
    if isinstance(default, ExternKernelCaller):
        if not default.kwargs:
            default.kwargs = kwargs
        return
    if not hasattr(op, "_op"):  # not an OpOverload: nothing to call
        return
    if name not in _default_choices:
        _default_choices[name] = ExternKernelChoice(
            op,
            name=f"{name}_collective_fallback",
            has_out_variant=False,
            op_overload=op,
            use_fallback_kernel=True,
        )
    template = choices[0]
    default = _default_choices[name].bind(template.input_nodes, template.layout, **kwargs)
    default.name = f"{name}_fallback_default"
    choices.append(default)


def _group_arguments(op: Any, args: Sequence[Any], kwargs: dict[str, Any], gm: Any) -> list[Any]:
    found = []
    for i, argument in enumerate(op._schema.arguments):
        if argument.name not in GROUP_ARGUMENTS:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.fx.Node) and value.op == "get_attr":
            value = getattr(gm, value.target)
        if value is not None:
            found.append(value)
    return found


def _resolve_group(group: Any, op: Any) -> ProcessGroup:
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    if isinstance(group, str):
        try:
            return torch._C._distributed_c10d._resolve_process_group(group)
        except Exception as e:  # noqa: BLE001 - reworded below
            raise ValueError(
                f"{op_name(op)} names process group {group!r}, which this rank does "
                "not know; pass the group name of a group created with "
                "torch.distributed.new_group (ProcessGroup.group_name)"
            ) from e
    raise TypeError(
        f"{op_name(op)}: cannot tell a process group from {group!r} "
        f"({type(group).__name__}); expected a ProcessGroup or a group name"
    )


def _covering_group(groups: list[ProcessGroup]) -> ProcessGroup:
    import torch.distributed as dist

    world = dist.group.WORLD
    if not groups:
        return world
    unique = list({g.group_name: g for g in groups}.values())
    if len(unique) == 1:
        return unique[0]
    needed = set().union(*(dist.get_process_group_ranks(g) for g in unique))
    covering = min(
        (g for g in [*unique, world] if needed <= set(dist.get_process_group_ranks(g))),
        key=lambda g: g.size(),
    )
    log.info(
        "choices communicate over groups %s; synchronising autotuning over group %s "
        "(ranks %s), which contains them all",
        [g.group_name for g in unique],
        covering.group_name,
        dist.get_process_group_ranks(covering),
    )
    return covering


# -- selection -------------------------------------------------------------------


def select_collective_choice(
    selector: Any,
    name: str,
    choices: list[ChoiceCaller],
    input_nodes: list[Any],
    layout: Any,
    input_gen_fns: Optional[dict[int, Callable[..., torch.Tensor]]],
    process_group: ProcessGroup,
    min_speedup_threshold: float = 1.0,
    benchmark_with_cudagraphs: bool = False,
) -> ChoiceCaller:
    """Pick the same choice on every rank of ``process_group``.

    ``selector`` is the AlgorithmSelectorCache, whose ``get_inputs`` makes the
    benchmark inputs. A choice other than the op's own implementation wins only if
    the op's own is at least ``min_speedup_threshold`` times slower on its slowest
    rank; ``benchmark_with_cudagraphs`` times the choices in CUDA graphs. Raises
    CollectiveAutotuneError, on every rank of the group, when the group's
    collectives failed mid-benchmark and cannot be trusted.
    """
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch._inductor import config

    started, waited_before = time.monotonic(), waited_seconds()
    op = _ops.get(name)
    by_label = {choice_label(c, op): c for c in choices}
    prepared = _prepared.pop(name, None)
    labels = prepared.labels if prepared else tuple(by_label)
    group_ranks = tuple(dist.get_process_group_ranks(process_group))
    if not config.collective_autotune:
        record = CollectiveAutotuneRecord(
            name, process_group.group_name, group_ranks, "", "", "use", "agreement",
            "collective autotuning is off (TORCHINDUCTOR_COLLECTIVE_AUTOTUNE=0)", (), DEFAULT,
        )
        return _finish(record, by_label)

    settings = BenchmarkSettings.from_config()
    device = benchmark_device(layout.device)
    mode = _timing_mode(settings, device, benchmark_with_cudagraphs)
    neighbours = _timed_with(prepared.neighbours if prepared else Neighbours(), choices)
    key = prepared.key if prepared else _site_key(name, input_nodes, labels, mode, min_speedup_threshold, neighbours)
    session = collective_graph.session_for(process_group, settings.timeout)
    counters["inductor"]["collective_autotune_sites"] += 1

    def report() -> SiteReport:
        persisted = _persisted(key, process_group, device)
        return SiteReport(
            key=key,
            choices=labels,
            decided=session.decisions.get(key) or "",
            stored=persisted.digest() if persisted else "",
            stored_winner=persisted.winner if persisted else "",
            failed={
                **{label: "not traced on this rank" for label in labels if label not in by_label},
                **{label: _trace_failure(c) for label, c in by_label.items() if _trace_failure(c)},
            },
        )

    build_s = 0.0

    def build() -> dict[str, str]:
        nonlocal build_s
        begin = time.monotonic()
        failures = {
            label: why for label, c in by_label.items()
            if not _trace_failure(c) and (why := _build(name, c, device, neighbours))
        }
        build_s = time.monotonic() - begin
        return failures

    decision, voting = collective_graph.agree_key(
        session, key, report, DEFAULT, build, timing_allowed=not config.deterministic
    )
    timings: tuple[ChoiceTiming, ...] = ()
    winner, reason = decision.choices[0], decision.reason
    if decision.kind == "benchmark":
        picked = list(decision.choices)
        # Lowering runs with the Python dispatcher on; a gloo worker thread would
        # inherit it and wait for the GIL that this thread holds in wait_tensor
        # (Inductor's regular benchmarking deadlocks so on gloo collectives).
        with no_python_dispatcher():
            timings = tuple(
                _benchmark(selector, by_label, picked, input_nodes, layout, input_gen_fns,
                           process_group, settings, mode, voting.session.scoped(key),
                           keep_default=min_speedup_threshold > 1.0, neighbours=neighbours)
            )
        winner, picked_because = _pick(
            picked, timings, min_speedup_threshold, prepared.below if prepared else None
        )
        reason = f"{reason}; {picked_because}"
    stored = collective_graph.settle_key(voting, key, winner, name, environment(process_group, device))
    source = decision.source
    if stored != winner:
        winner, reason = stored, f"the group decided {stored} first"
    elif prepared and prepared.source and source == "job":
        source, reason = prepared.source, prepared.reason
    elif decision.source == "benchmark" and _persistence_on():
        DecisionStore().save(
            StoredDecision(key, environment(process_group, device), winner,
                           {t.name: t.max_us for t in timings})
        )
    waited_s = waited_seconds() - waited_before
    record = CollectiveAutotuneRecord(
        op=name,
        group_name=process_group.group_name,
        group_ranks=group_ranks,
        key=key,
        session=voting.session.key,
        decision=decision.kind,
        source=source,
        reason=reason,
        timings=timings,
        winner=winner,
        mode=mode,
        timed_with=str(neighbours) if timings else "",
        waited_s=waited_s,
        build_s=build_s,
        tuning_s=time.monotonic() - started - build_s - waited_s,
    )
    return _finish(record, by_label)


def note_cached_sites(sites: list[tuple[str, str, str, str, str]]) -> None:
    """Record the decisions inlined in a graph loaded from the cache: (group, plan,
    key, winner, op) of each of its collective-tuned keys."""
    import torch.distributed as dist

    for group_name, plan, key, winner, op in sites:
        group = torch._C._distributed_c10d._resolve_process_group(group_name)
        _records.append(
            CollectiveAutotuneRecord(
                op, group_name, tuple(dist.get_process_group_ranks(group)), key, plan, "use",
                "cache", "inlined in a compiled graph loaded from the cache; the group agrees", (),
                winner,
            )
        )


def _finish(record: CollectiveAutotuneRecord, by_label: dict[str, ChoiceCaller]) -> ChoiceCaller:
    """Log ``record``, keep it, and return the choice it names."""
    import torch.distributed as dist

    _records.append(record)
    log.info(
        "collective autotuning %s on group %s: %s (%s; %s; compiling the choices %.2f s, "
        "timing %.2f s, waiting for the group %.2f s)",
        record.op, record.group_name, record.winner, record.source, record.reason,
        record.build_s, record.tuning_s, record.waited_s,
    )
    if dist.get_rank() == record.group_ranks[0]:
        table_log.info("%s", format_record(record))
    choice = by_label.get(record.winner)
    if choice is None:
        raise CollectiveAutotuneError(
            f"{record.op}: the group decided on {record.winner} ({record.reason}), "
            f"which this rank does not have; its choices: {list(by_label)}"
        )
    log.debug("%s: %s is Inductor's choice %s", record.op, record.winner, choice.name)
    if collective_dispatch.is_range(record.op):
        return _RangeWinner(choice, by_label[DEFAULT], _ops.get(record.op))  # type: ignore[return-value]
    return choice


class _RangeWinner:
    """The winner of one range of a range-based op, as the range-based lowering reads
    it: the implementation to dispatch to, but no graph. torch 2.13 inlines a winning
    graph into the model at every range and keeps only the dispatch; an inlined
    collective stays in the graph (it has side effects) and would run on every call."""

    gm = None

    def __init__(self, winner: ChoiceCaller, default: ChoiceCaller, op: Any) -> None:
        self.name = winner.name
        self.decomposition = getattr(winner, "decomposition", None)
        self.decomposition_kwargs = getattr(winner, "decomposition_kwargs", {})
        self.config_patches = getattr(winner, "config_patches", {})
        if self.decomposition is None:
            # The op's own implementation: dispatched to as a call of the op. torch 2.11
            # would trace the op's Python body instead, which a collective's c10d
            # calls do not survive.
            self.decomposition = _the_op_itself(op, _schema_arguments(op))
            self.decomposition_kwargs = {}
        self._default = default

    def output_node(self) -> Any:
        # Unused by the range-based lowering, so removed with the graph's dead code.
        return self._default.output_node()


def _timing_mode(settings: BenchmarkSettings, device: torch.device, cudagraphs: bool) -> str:
    """How to time: as the model runs, or in CUDA graphs where the op was registered
    with ``benchmark_with_cudagraphs``."""
    if cudagraphs and settings.mode == "auto":
        if device.type == "cuda":
            return "graph"
        _warn_once("benchmark_with_cudagraphs has no effect on CPU: CUDA graphs need CUDA")
    return settings.timing_mode(device)


def _persistence_on() -> bool:
    from torch._inductor import config

    return bool(config.collective_autotune_persist)


def _persisted(key: str, group: ProcessGroup, device: torch.device) -> Optional[StoredDecision]:
    """This rank's stored decision for ``key``, unless persistence is off or re-tuning."""
    from torch._inductor import config

    if not _persistence_on() or config.collective_autotune_retune:
        return None
    return DecisionStore().load(key, environment(group, device))


def _pick(
    names: list[str],
    timings: Sequence[ChoiceTiming],
    min_speedup_threshold: float,
    below: Optional[tuple[str, str]] = None,
) -> tuple[str, str]:
    """The winner and why. ``below``: for a ladder range, the winner of the range just
    below and its top size, which a tie at this range's top goes to."""
    # The vector is identical on every rank; min() keeps the first of equal times.
    best = min(range(len(names)), key=lambda i: timings[i].max_us)
    if not math.isfinite(timings[best].max_us):
        return DEFAULT, "every choice failed on some rank; using the op's own implementation"
    because = "fastest on its slowest rank"
    if below is not None and below[0] != names[best] and below[0] in names:
        tied = names.index(below[0])
        if timings[tied].max_us <= timings[best].max_us * (1 + TIE_FRACTION):
            because = (
                f"within {TIE_FRACTION:.0%} of {names[best]} at this range's top size on their "
                f"slowest ranks, and the winner at {below[1]} below"
            )
            best = tied
    own = next((t for t in timings if t.name == DEFAULT), None)
    # A threshold of 1 asks for the fastest, a tie above included.
    if (
        min_speedup_threshold > 1.0
        and names[best] != DEFAULT
        and own is not None
        and math.isfinite(own.max_us)
        and timings[best].max_us * min_speedup_threshold > own.max_us
    ):
        return DEFAULT, (
            f"{names[best]} is only {own.max_us / timings[best].max_us:.2f}x faster than "
            f"the op's own implementation on its slowest rank, below "
            f"min_speedup_threshold={min_speedup_threshold:g}"
        )
    return names[best], because


def _benchmark(
    selector: Any,
    by_label: dict[str, ChoiceCaller],
    names: list[str],
    input_nodes: list[Any],
    layout: Any,
    input_gen_fns: Optional[dict[int, Callable[..., torch.Tensor]]],
    process_group: ProcessGroup,
    settings: BenchmarkSettings,
    mode: str,
    session: CollectiveSession,
    keep_default: bool,
    neighbours: Neighbours,
) -> list[ChoiceTiming]:
    choices = [by_label[n] for n in names]
    args = selector.get_inputs(choices, input_nodes, layout, input_gen_fns)
    inputs, _ = args.get_benchmark_tensors(False).unpack()
    inputs = list(inputs)
    # Vote topics carry these names, so they must be the same on every rank.
    candidates = [Candidate(n, _runner(c, inputs, neighbours)) for n, c in zip(names, choices)]
    if any(_uses_symmetric_memory(c) for c in choices):
        if not _move_to_symmetric_memory(inputs, process_group, session):
            candidates = [
                Candidate(cand.name, _unavailable("symmetric memory unavailable on this group"))
                if _uses_symmetric_memory(c) else cand
                for c, cand in zip(choices, candidates)
            ]
    pristine = [t.clone() for t in inputs]

    def reset_inputs() -> None:
        for t, p in zip(inputs, pristine):
            t.copy_(p)

    reference = names.index(DEFAULT) if DEFAULT in names else 0
    benchmarker = CollectiveBenchmarker(process_group, layout.device, settings, session, mode)
    return benchmarker.benchmark(
        candidates, reset_inputs, reference, keep=(reference,) if keep_default else ()
    )


def _runner(
    choice: ChoiceCaller, inputs: list[torch.Tensor], neighbours: Neighbours
) -> Callable[[], torch.Tensor]:
    """One call of ``choice`` on ``inputs`` with ``neighbours`` around it, returning
    its output."""
    module = getattr(choice, "_compiled_module", None)
    if module is not None:  # a subgraph choice, compiled by _build with its neighbours
        sym_inputs = list(choice.sym_input_values)  # type: ignore[attr-defined]
        return lambda: module.call([*sym_inputs, *inputs])[0]
    kernel = choice.to_callable()
    if getattr(choice, "has_out_variant", False):
        out = torch.empty_strided(
            [int(s) for s in choice.layout.size],
            [int(s) for s in choice.layout.stride],
            dtype=choice.layout.dtype,
            device=choice.layout.device,
        )

        def call(*args: torch.Tensor) -> torch.Tensor:
            kernel(*args, out=out)
            return out

    else:
        call = kernel
    # The op's own implementation runs as an opaque call in the model, its
    # neighbours as kernels of their own: so here.
    with_neighbours = neighbours.around(call)
    return lambda: with_neighbours(*inputs)


def _build(name: str, choice: ChoiceCaller, device: torch.device, neighbours: Neighbours) -> str:
    """Compile ``choice`` of op ``name`` for benchmarking, with ``neighbours`` fused
    in; why it cannot run here, or "" if it can."""
    if _uses_symmetric_memory(choice) and device.type != "cuda":
        return "uses symmetric memory, which needs CUDA"
    try:
        if getattr(choice, "gm", None) is not None and hasattr(choice, "_compile_for_benchmarking"):
            if choice._compiled_module is None:  # type: ignore[attr-defined]
                if collective_dispatch.is_range(name):
                    module = collective_dispatch.benchmark_module(choice)
                elif neighbours != Neighbours():
                    module = compiled_module(
                        choice, neighbours.around(implementation_of(choice)), symbolic=False
                    )
                else:
                    module = choice._compile_for_benchmarking()  # type: ignore[attr-defined]
                choice._compiled_module = module  # type: ignore[attr-defined]
        else:
            choice.to_callable()
    except Exception as e:  # noqa: BLE001 - the group drops it; the reason is logged there
        log.debug("build failure of %s", choice.name, exc_info=True)
        return f"does not build ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return ""


def _move_to_symmetric_memory(
    inputs: list[torch.Tensor], group: ProcessGroup, session: CollectiveSession
) -> bool:
    """Replace ``inputs`` by copies in symmetric memory of ``group`` (all ranks at once)."""
    from torch.distributed import _symmetric_memory as symm_mem

    outcome = "ok"
    moved = list(inputs)
    try:
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        for i, t in enumerate(inputs):
            if t.is_contiguous():
                buf = symm_mem.empty(t.shape, dtype=t.dtype, device=t.device)
                symm_mem.rendezvous(buf, group.group_name)
                moved[i] = buf.copy_(t)
    except Exception as e:  # noqa: BLE001
        outcome = f"failed: {type(e).__name__}: {e}"[:500]
    if all(r == "ok" for r in session.vote("symmetric_memory", outcome)):
        inputs[:] = moved
        return True
    log.warning(
        "symmetric memory is not available on group %s (%s); its choices are dropped "
        "on every rank",
        group.group_name,
        outcome,
    )
    return False


def _unavailable(why: str) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        raise RuntimeError(why)

    return run


def _timed_with(neighbours: Neighbours, choices: Sequence[ChoiceCaller]) -> Neighbours:
    """The neighbours to time a site's choices with: none where a choice calls
    symmetric-memory ops in its graph, whose inputs the benchmark places in symmetric
    memory itself (a stand-in producer's output would not be). The same on every
    rank: it reads the traced graphs."""
    return Neighbours() if any(_uses_symmetric_memory(c) for c in choices) else neighbours


def _uses_symmetric_memory(choice: ChoiceCaller) -> bool:
    gm = getattr(choice, "gm", None)
    return gm is not None and any(
        node.op == "call_function" and uses_symmetric_memory(node.target)
        for node in gm.graph.nodes
        if isinstance(node.target, torch._ops.OpOverload)
    )


def _default_choice(choices: Sequence[ChoiceCaller]) -> ChoiceCaller:
    """The op's own implementation (the extern fallback choice), else the first."""
    from torch._inductor.select_algorithm import ExternKernelCaller

    return next((c for c in choices if isinstance(c, ExternKernelCaller)), choices[0])


# -- reporting -------------------------------------------------------------------


def format_record(record: CollectiveAutotuneRecord) -> str:
    """A table of one decision: choice, slowest- and fastest-rank time, winner."""
    lines = [
        f"collective autotuning: {record.op} on group {record.group_name} "
        f"(ranks {list(record.group_ranks)}), key {record.key}",
        f"  decision: {record.decision} ({record.source}); winner: {record.winner} "
        f"({record.reason})",
    ]
    if record.timed_with:
        lines.append(f"  timed with its pointwise neighbours: {record.timed_with}")
    if record.timings:
        width = max(len(t.name) for t in record.timings)
        lines.append(
            f"  {'choice':<{width}}  {'slowest rank us':>15}  {'fastest rank us':>15}  "
            f"{'calls/sample':>12}  {'samples':>7}  {'skew us':>7}  status"
        )
        for t in record.timings:
            mark = "  <- winner" if t.name == record.winner else ""
            lines.append(
                f"  {t.name:<{width}}  {t.max_us:>15.1f}  {t.min_us:>15.1f}  "
                f"{t.calls_per_sample:>12}  {t.samples:>7}  {t.skew_us:>7.1f}  {t.status}{mark}"
            )
    return "\n".join(lines)


# -- helpers ---------------------------------------------------------------------


def _site_key(
    name: str,
    inputs: Sequence[Any],
    labels: Sequence[str],
    mode: str,
    min_speedup_threshold: float,
    neighbours: Neighbours,
) -> str:
    """What a decision is for: the op (by its autotuning name), its inputs' sizes,
    strides and dtypes, its choices, how they are timed, the threshold, and what the
    site fuses with (the same op may win alone and lose between pointwise neighbours)."""
    return digest(
        name, [_node_meta(n) for n in inputs], tuple(labels), mode, min_speedup_threshold, str(neighbours)
    )


def _node_meta(node: Any) -> str:
    """Size, stride and dtype of an IR node or layout (not its device)."""
    if hasattr(node, "get_size"):
        return f"{node.get_size()}/{node.get_stride()}/{node.get_dtype()}"
    return f"{node.size}/{node.stride}/{node.dtype}"


@functools.lru_cache(None)
def _warn_once(message: str) -> None:
    log.warning(message)
