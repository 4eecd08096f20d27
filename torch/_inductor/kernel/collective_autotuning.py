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
from torch._inductor.kernel.collective_choices import (
    choice_label,
    complete_default_choice,
    DEFAULT,
    guarded_implementation,
    label,
    needs_symmetric_memory,
    RangeWinner,
    schema_arguments,
    the_op_itself,
    trace_failure,
)
from torch._inductor.kernel.collective_detection import (
    collective_calls,
    covering_group,
    group_arguments,
    GROUP_ARGUMENTS,
    names_a_collective,
    op_name,
    resolve_group,
)
from torch._inductor.kernel.collective_graph import SiteReport
from torch._inductor.kernel.collective_records import (
    collective_autotune_records,
    CollectiveAutotuneRecord,
    format_record,
    keep_record,
    site_key,
)
from torch._inductor.runtime.collective_benchmarking import (
    benchmark_device,
    BenchmarkSettings,
    Candidate,
    ChoiceTiming,
    CollectiveBenchmarker,
    TIE_FRACTION,
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


# The hooks upstream's patched files call, and what users read of the decisions.
__all__ = [
    "CollectiveAutotuneRecord",
    "collective_autotune_records",
    "detect_collective",
    "format_record",
    "note_registration",
    "prepare_choices",
    "select_collective_choice",
]

log = logging.getLogger(__name__)
table_log = torch._logging.getArtifactLogger(__name__, "collective_autotuning")

# Each collective op's OpOverload by its autotuning name, as detection found it.
_ops: dict[str, Any] = {}


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
    schema = schema_arguments(op)
    labels = [label(d.__name__, kwargs, schema) for d, kwargs in zip(decompositions, non_tensor_args)]
    keep = list(range(len(decompositions)))
    winner = _decided_before_tracing(
        name, labels, inputs, op, non_tensor_args, min_speedup_threshold, benchmark_with_cudagraphs,
        neighbours,
    )
    traced = [guarded_implementation(d, op) for d in decompositions]
    if winner is not None:
        keep = [i for i, candidate in enumerate(labels) if i == 0 or candidate == winner]
        if labels[0] != winner:
            # Upstream gives the op's own implementation the first implementation's
            # arguments: keep those, traced cheaply as the op itself.
            traced[0] = the_op_itself(op, schema)

    def kept(items: Optional[Sequence[Any]]) -> Any:
        return None if items is None else [items[i] for i in keep]

    return kept(traced), kept(non_tensor_args), kept(config_patches_list)


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
        group = resolve_group(named[0], op) if named else dist.group.WORLD
    except (ValueError, TypeError):
        return None  # detection reports it with the full story
    settings = BenchmarkSettings.from_config()
    device = benchmark_device(inputs[0].get_device())
    mode = _timing_mode(settings, device, benchmark_with_cudagraphs)
    labels = (*labels, DEFAULT)

    def key_of(site: str) -> str:
        return site_key(site, inputs, labels, mode, min_speedup_threshold, neighbours)

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
    collective_choices.complete_default_choice); ``name`` is the op's autotuning name.
    An op tuned the regular way loses the choices whose implementation raised while
    traced.
    """
    import torch.distributed as dist

    groups: list[Any] = []
    # The op's name or arguments may tell what its choices' graphs do not (where only
    # the winner of a decided key was traced, say).
    collective = names_a_collective(op_overload)
    for choice in choices:
        gm = getattr(choice, "gm", None)
        if gm is None or trace_failure(choice):
            continue
        for node in collective_calls(gm):
            collective = True
            groups.extend(group_arguments(node, gm))
    if collective and not (dist.is_available() and dist.is_initialized()):
        _warn_once(
            f"{op_name(op_overload)} is a collective op but torch.distributed is not "
            "initialised: it is autotuned like any other op, on this rank alone"
        )
        collective = False
    if not collective:
        for choice in [c for c in choices if trace_failure(c)]:
            log.warning("choice %s is dropped: %s", choice_label(choice, op_overload), trace_failure(choice))
            choices.remove(choice)
        return False, None
    for kwargs in non_tensor_args:
        groups.extend(v for k, v in kwargs.items() if k in GROUP_ARGUMENTS)
    complete_default_choice(name, choices, op_overload, non_tensor_args)
    _ops[name] = op_overload
    group = covering_group([resolve_group(g, op_overload) for g in groups])
    if group.size() == 1:
        # Inductor's regular benchmarking would deadlock on gloo here (see
        # select_collective_choice); a session of one rank costs nothing.
        _warn_once(
            f"{op_name(op_overload)} runs on a process group of one rank: nothing to "
            "synchronise, it is timed without waiting for peers"
        )
    return True, group


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
    key = prepared.key if prepared else site_key(name, input_nodes, labels, mode, min_speedup_threshold, neighbours)
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
                **{label: trace_failure(c) for label, c in by_label.items() if trace_failure(c)},
            },
        )

    build_s = 0.0

    def build() -> dict[str, str]:
        nonlocal build_s
        begin = time.monotonic()
        failures = {
            label: why for label, c in by_label.items()
            if not trace_failure(c) and (why := _build(name, c, device, neighbours))
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


def _finish(record: CollectiveAutotuneRecord, by_label: dict[str, ChoiceCaller]) -> ChoiceCaller:
    """Log ``record``, keep it, and return the choice it names."""
    import torch.distributed as dist

    keep_record(record)
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
        return RangeWinner(choice, by_label[DEFAULT], _ops.get(record.op))  # type: ignore[return-value]
    return choice


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
    if any(needs_symmetric_memory(c) for c in choices):
        if not _move_to_symmetric_memory(inputs, process_group, session):
            candidates = [
                Candidate(cand.name, _unavailable("symmetric memory unavailable on this group"))
                if needs_symmetric_memory(c) else cand
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
    if needs_symmetric_memory(choice) and device.type != "cuda":
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
    return Neighbours() if any(needs_symmetric_memory(c) for c in choices) else neighbours


@functools.lru_cache(None)
def _warn_once(message: str) -> None:
    log.warning(message)
