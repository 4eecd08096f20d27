"""Collective custom-op autotuning inside Inductor: detection and choice selection.

``autotune_custom_op`` calls :func:`detect_collective` to learn whether an op's
choices communicate and over which process group; ``AlgorithmSelectorCache`` then
hands such ops to :func:`select_collective_choice`, which runs one session of the
cross-rank protocol (runtime/collective_protocol.py) and, when the group agreed to,
times the choices with the CollectiveBenchmarker (runtime/collective_benchmarking.py).

Collective sessions never read or write Inductor's local autotune cache: a hit on one
rank and a miss on another is exactly how ranks come to inline different
implementations, and a stale infinite timing would become a silent fallback in every
later run. Tuning again costs tens of milliseconds per op.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import re
import time
from typing import Any, Callable, Optional, Sequence, TYPE_CHECKING

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._inductor.runtime.collective_benchmarking import (
    BenchmarkSettings,
    Candidate,
    ChoiceTiming,
    CollectiveBenchmarker,
    is_collective_op,
    uses_symmetric_memory,
)
from torch._inductor.runtime.collective_protocol import (
    CollectiveAutotuneError,
    CollectiveSession,
    Decision,
    Join,
    session_number,
)


if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torch._inductor.ir import ChoiceCaller


log = logging.getLogger(__name__)
table_log = torch._logging.getArtifactLogger(__name__, "collective_autotuning")

# Argument names through which an op or a collective names its process group.
_GROUP_ARGUMENTS = ("group_name", "group", "process_group", "pg")


@dataclasses.dataclass(frozen=True)
class CollectiveAutotuneRecord:
    """What one rank decided for one collective op; identical across the group."""

    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    session: str
    # "benchmark" or "use" (see collective_protocol.Decision), and why.
    decision: str
    reason: str
    timings: tuple[ChoiceTiming, ...]
    winner: str
    # Seconds this rank waited for the group's decision, and spent from its arrival
    # to the end of the benchmark (both differ between ranks).
    waited_s: float = dataclasses.field(default=0.0, compare=False)
    tuning_s: float = dataclasses.field(default=0.0, compare=False)


_records: list[CollectiveAutotuneRecord] = []
# The number of this process's last session per (group, op and shapes).
_session_counts: collections.Counter[tuple[str, str]] = collections.Counter()


def collective_autotune_records() -> list[CollectiveAutotuneRecord]:
    """The decisions this process made so far, oldest first."""
    return list(_records)


# -- detection -------------------------------------------------------------------


def guard_graph_caches(op: Any) -> None:
    """Turn off the FX graph and AOTAutograd caches once a collective op is tuned.

    Those caches are looked up by each rank alone, before lowering: a rank with a
    warm cache would skip the autotuning session that its cold peers wait for, and
    run the implementation it cached while they fall back to the default one. No
    hook between the lookup and lowering can reconcile that, so a process that
    autotunes collective ops compiles its graphs afresh (on every rank alike), unless
    ``collective_benchmark_keep_graph_caches`` says all ranks' caches hold the same.
    Called when an op is registered for autotuning (recognised by its name or a
    process-group argument) and again when lowering finds collectives in its choices.
    """
    if _names_a_collective(op):
        _disable_graph_caches(op)


def _disable_graph_caches(op: Any) -> None:
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    if config.collective_benchmark_keep_graph_caches:
        return
    if config.fx_graph_cache or functorch_config.enable_autograd_cache:
        config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
        _warn_once(
            f"{_op_name(op)} is autotuned as a collective op: the FX graph and "
            "AOTAutograd caches are off in this process so that every rank takes part "
            "in its autotuning (set TORCHINDUCTOR_COLLECTIVE_BENCHMARK_KEEP_GRAPH_CACHES=1 "
            "only if every rank's caches hold the same entries)"
        )
        if config.fx_graph_cache:
            _warn_once(
                "TORCHINDUCTOR_FX_GRAPH_CACHE forces the FX graph cache on: a rank with a "
                f"warm cache can skip the autotuning of {_op_name(op)} that its peers wait for"
            )


def _names_a_collective(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    return is_collective_op(op) or (
        schema is not None and any(a.name in _GROUP_ARGUMENTS for a in schema.arguments)
    )


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
    :func:`_complete_default_choice`); ``name`` is the op's autotuning name.
    """
    groups: list[Any] = []
    collective = is_collective_op(op_overload)
    for choice in choices:
        gm = getattr(choice, "gm", None)
        if gm is None:
            continue
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(
                node.target, torch._ops.OpOverload
            ) and is_collective_op(node.target):
                collective = True
                groups.extend(_group_arguments(node.target, node.args, node.kwargs, gm))
    if not collective:
        return False, None
    # For later graphs at least, where the op's name and schema did not reveal it.
    _disable_graph_caches(op_overload)
    for kwargs in non_tensor_args:
        groups.extend(v for k, v in kwargs.items() if k in _GROUP_ARGUMENTS)

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _warn_once(
            f"{_op_name(op_overload)} is a collective op but torch.distributed is not "
            "initialised: it is autotuned like any other op, on this rank alone"
        )
        return False, None
    _complete_default_choice(name, choices, op_overload, non_tensor_args)
    group = _covering_group([_resolve_group(g, op_overload) for g in groups])
    if group.size() == 1:
        # Inductor's regular benchmarking would deadlock on gloo here (see
        # select_collective_choice); a session of one rank costs nothing.
        _warn_once(
            f"{_op_name(op_overload)} runs on a process group of one rank: nothing to "
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
        if argument.name not in _GROUP_ARGUMENTS:
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
                f"{_op_name(op)} names process group {group!r}, which this rank does "
                "not know; pass the group name of a group created with "
                "torch.distributed.new_group (ProcessGroup.group_name)"
            ) from e
    raise TypeError(
        f"{_op_name(op)}: cannot tell a process group from {group!r} "
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
) -> ChoiceCaller:
    """Pick the same choice on every rank of ``process_group``.

    ``selector`` is the AlgorithmSelectorCache, whose ``get_inputs`` makes the
    benchmark inputs. Raises CollectiveAutotuneError, on every rank of the group,
    when the group's collectives failed mid-benchmark and cannot be trusted.
    """
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch._inductor import config

    settings = BenchmarkSettings.from_config()
    group_name = process_group.group_name
    # No device index in the key: rank r's tensors live on cuda:r.
    op_key = _digest(name, [_node_meta(n) for n in input_nodes], _node_meta(layout))
    store = dist.distributed_c10d._get_default_store()
    number = session_number(store, group_name, op_key, _session_counts[group_name, op_key] + 1)
    _session_counts[group_name, op_key] = number
    session_key = f"{op_key}.{number}"
    by_name = {_stable_name(c): c for c in choices}
    names = tuple(by_name)
    default = _stable_name(_default_choice(choices))
    device = layout.device

    runnable = tuple(n for n, c in by_name.items() if _build(c, device))
    session = CollectiveSession(
        store,
        group_name,
        session_key,
        dist.get_rank(process_group),
        process_group.size(),
        settings.timeout,
    )
    counters["inductor"]["collective_autotune_sessions"] += 1
    arrived = time.monotonic()
    try:
        decision = session.agree(
            Join(session.rank, _digest(op_key, names), names, runnable),
            decide=functools.partial(
                _decide, default_name=default, timing_allowed=not config.deterministic
            ),
            fallback=lambda reason: Decision("use", (default,), reason),
        )
        waited_s = time.monotonic() - arrived
        if not decision.choices or decision.choices[0] not in by_name:
            raise CollectiveAutotuneError(
                f"{name}: the group decided on {decision.choices or 'no choice'} "
                f"({decision.reason}), which this rank does not have; its choices: {names}"
            )
        timings: tuple[ChoiceTiming, ...] = ()
        winner = by_name[decision.choices[0]]
        reason = decision.reason
        if decision.kind == "benchmark":
            picked = list(decision.choices)
            # Lowering runs with the Python dispatcher on; a gloo worker thread would
            # inherit it and wait for the GIL that this thread holds in wait_tensor
            # (Inductor's regular benchmarking deadlocks so on gloo collectives).
            with no_python_dispatcher():
                timings = tuple(
                    _benchmark(selector, by_name, picked, default, input_nodes, layout,
                               input_gen_fns, process_group, settings, session)
                )
            best, picked_because = _pick(picked, timings, default)
            winner = by_name[best]
            reason = f"{decision.reason}; {picked_because}"
    finally:
        try:
            session.close()
        except Exception:  # noqa: BLE001 - the store may be gone with a dead rank
            log.debug("could not close session %s", session_key, exc_info=True)
    tuning_s = time.monotonic() - arrived

    record = CollectiveAutotuneRecord(
        op=name,
        group_name=group_name,
        group_ranks=tuple(dist.get_process_group_ranks(process_group)),
        session=session_key,
        decision=decision.kind,
        reason=reason,
        timings=timings,
        winner=_stable_name(winner),
        waited_s=waited_s,
        tuning_s=tuning_s,
    )
    _records.append(record)
    log.info(
        "collective autotuning %s on group %s: %s (%s; waited %.2f s for the group)",
        name, group_name, record.winner, reason, waited_s,
    )
    if session.rank == 0:
        table_log.info("%s", format_record(record))
    return winner


def _decide(joins: list[Join], default_name: str, timing_allowed: bool) -> Decision:
    """The session's decision from every rank's join (runs on one rank)."""
    first = joins[0]
    differing = [j.rank for j in joins if j.fingerprint != first.fingerprint]
    if differing:
        common = [n for n in first.choices if all(n in j.choices for j in joins)]
        fallback = default_name if default_name in common else (common or [None])[0]
        return Decision(
            "use",
            (fallback,) if fallback else (),
            f"group ranks {differing} tune a different op, shape or choice list than "
            f"group rank {first.rank}; all use {fallback}",
        )
    runnable = [n for n in first.choices if all(n in j.runnable for j in joins)]
    dropped = [n for n in first.choices if n not in runnable]
    note = f"; not buildable on every rank: {dropped}" if dropped else ""
    if not runnable:
        return Decision("use", (default_name,), f"no choice builds on every rank{note}")
    if len(runnable) == 1:
        return Decision("use", tuple(runnable), f"the only choice built on every rank{note}")
    if not timing_allowed:
        chosen = default_name if default_name in runnable else runnable[0]
        return Decision("use", (chosen,), f"config.deterministic: untimed{note}")
    return Decision("benchmark", tuple(runnable), f"benchmarked on every rank{note}")


def _pick(
    names: list[str], timings: Sequence[ChoiceTiming], default: str
) -> tuple[str, str]:
    # The vector is identical on every rank; min() keeps the first of equal times.
    best = min(range(len(names)), key=lambda i: timings[i].max_us)
    if math.isfinite(timings[best].max_us):
        return names[best], "fastest on its slowest rank"
    return default, "every choice failed on some rank; using the default implementation"


def _benchmark(
    selector: Any,
    by_name: dict[str, ChoiceCaller],
    names: list[str],
    default: str,
    input_nodes: list[Any],
    layout: Any,
    input_gen_fns: Optional[dict[int, Callable[..., torch.Tensor]]],
    process_group: ProcessGroup,
    settings: BenchmarkSettings,
    session: CollectiveSession,
) -> list[ChoiceTiming]:
    choices = [by_name[n] for n in names]
    args = selector.get_inputs(choices, input_nodes, layout, input_gen_fns)
    inputs, _ = args.get_benchmark_tensors(False).unpack()
    inputs = list(inputs)
    # Vote topics carry these names, so they must be the same on every rank.
    candidates = [Candidate(n, _runner(c, inputs)) for n, c in zip(names, choices)]
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

    reference = names.index(default) if default in names else 0
    return CollectiveBenchmarker(process_group, layout.device, settings, session).benchmark(
        candidates, reset_inputs, reference
    )


def _runner(choice: ChoiceCaller, inputs: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """One call of ``choice`` on ``inputs``, returning its output."""
    module = getattr(choice, "_compiled_module", None)
    if module is not None:  # a subgraph choice, compiled by _build
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

        def run_out() -> torch.Tensor:
            kernel(*inputs, out=out)
            return out

        return run_out
    return lambda: kernel(*inputs)


def _build(choice: ChoiceCaller, device: torch.device) -> bool:
    """Compile ``choice`` for benchmarking; False (with a warning) if it cannot run here."""
    if _uses_symmetric_memory(choice) and device.type != "cuda":
        log.warning(
            "choice %s uses symmetric memory, which needs CUDA; dropped on every rank",
            choice.name,
        )
        return False
    try:
        if getattr(choice, "gm", None) is not None and hasattr(choice, "_compile_for_benchmarking"):
            if choice._compiled_module is None:  # type: ignore[attr-defined]
                choice._compiled_module = choice._compile_for_benchmarking()  # type: ignore[attr-defined]
        else:
            choice.to_callable()
    except Exception as e:  # noqa: BLE001 - the group drops it; the reason is logged here
        log.warning(
            "choice %s does not build on this rank (%s: %s); the group drops it",
            choice.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
        )
        log.debug("build failure of %s", choice.name, exc_info=True)
        return False
    return True


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


def _uses_symmetric_memory(choice: ChoiceCaller) -> bool:
    gm = getattr(choice, "gm", None)
    return gm is not None and any(
        node.op == "call_function" and uses_symmetric_memory(node.target)
        for node in gm.graph.nodes
        if isinstance(node.target, torch._ops.OpOverload)
    )


def _stable_name(choice: ChoiceCaller) -> str:
    """The choice's name without the process-wide counter Inductor appends to
    subgraph choices ("..._group_name_0_12"): ranks with different compile histories
    number the same choice differently."""
    if getattr(choice, "gm", None) is None:
        return choice.name
    return re.sub(r"_\d+$", "", choice.name)


def _default_choice(choices: Sequence[ChoiceCaller]) -> ChoiceCaller:
    """The op's own implementation (the extern fallback choice), else the first."""
    from torch._inductor.select_algorithm import ExternKernelCaller

    return next((c for c in choices if isinstance(c, ExternKernelCaller)), choices[0])


# -- reporting -------------------------------------------------------------------


def format_record(record: CollectiveAutotuneRecord) -> str:
    """A table of one decision: choice, slowest- and fastest-rank time, winner."""
    lines = [
        f"collective autotuning: {record.op} on group {record.group_name} "
        f"(ranks {list(record.group_ranks)}), session {record.session}",
        f"  decision: {record.decision}; winner: {record.winner} ({record.reason})",
    ]
    if record.timings:
        width = max(len(t.name) for t in record.timings)
        lines.append(
            f"  {'choice':<{width}}  {'slowest rank us':>15}  {'fastest rank us':>15}  "
            f"{'calls/sample':>12}  status"
        )
        for t in record.timings:
            mark = "  <- winner" if t.name == record.winner else ""
            lines.append(
                f"  {t.name:<{width}}  {t.max_us:>15.1f}  {t.min_us:>15.1f}  "
                f"{t.calls_per_sample:>12}  {t.status}{mark}"
            )
    return "\n".join(lines)


# -- helpers ---------------------------------------------------------------------


def _node_meta(node: Any) -> str:
    """Size, stride and dtype of an IR node or layout (not its device)."""
    if hasattr(node, "get_size"):
        return f"{node.get_size()}/{node.get_stride()}/{node.get_dtype()}"
    return f"{node.size}/{node.stride}/{node.dtype}"


def _digest(*parts: Any) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def _op_name(op: Any) -> str:
    return op.name() if hasattr(op, "name") and callable(op.name) else str(op)


@functools.lru_cache(None)
def _warn_once(message: str) -> None:
    log.warning(message)
