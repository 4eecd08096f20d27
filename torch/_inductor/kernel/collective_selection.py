"""One collective-tuned call site's decision, the group's and identical on every rank.

Before a site's choices are traced, :func:`settled_range` finds the ranges of a
dynamic op that an earlier site of the graph settled (nothing is traced for them), and
:func:`decided_before_tracing` reads whether the group decided the site's key already
(a read of the Store, no waiting), or whether a range of a dynamic op takes the winner
of its neighbouring sizes: then only the winner is traced. After, :func:`decide_site`
takes the group's decision for the key from the graph's session
(kernel/collective_graph.py): a decision made earlier in the job, one every rank stored
on disk (runtime/collective_decisions.py), or a benchmark of the choices in lockstep on
every rank of the group (kernel/collective_timing.py), and returns this rank's record
of it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence, TYPE_CHECKING

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._inductor.kernel import collective_dispatch, collective_graph
from torch._inductor.kernel.collective_choice_modules import Neighbours
from torch._inductor.kernel.collective_choices import DEFAULT, trace_failure
from torch._inductor.kernel.collective_detection import (
    GROUP_ARGUMENTS,
    names_a_collective,
    resolve_group,
)
from torch._inductor.kernel.collective_graph import GroupSession, SiteDecision, SiteReport
from torch._inductor.kernel.collective_records import CollectiveAutotuneRecord, site_key
from torch._inductor.kernel.collective_timing import (
    benchmark,
    BenchmarkInputs,
    build,
    pick,
    timed_with,
    timing_mode,
)
from torch._inductor.runtime.collective_benchmarking import (
    benchmark_device,
    BenchmarkSettings,
    ChoiceTiming,
)
from torch._inductor.runtime.collective_decisions import (
    DecisionStore,
    environment,
    StoredDecision,
)
from torch._inductor.runtime.collective_protocol import waited_seconds


if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torch._inductor.ir import ChoiceCaller


# -- before tracing -------------------------------------------------------------------


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


def forget_prepared(name: str) -> None:
    """Drop what an earlier compile prepared for op ``name``, before this one prepares it."""
    _prepared.pop(name, None)


@dataclasses.dataclass(frozen=True)
class TunedCall:
    """A collective op's call about to be tuned: its group, how its choices would be
    timed, its choices' labels (the op's own last), inputs and threshold."""

    group: ProcessGroup
    settings: BenchmarkSettings
    device: torch.device
    mode: str
    labels: tuple[str, ...]
    inputs: Sequence[Any]
    min_speedup_threshold: float

    def key(self, site: str, neighbours: Neighbours) -> str:
        """The decision's key at ``site`` (the op's name, or one of its ranges)."""
        return site_key(site, self.inputs, self.labels, self.mode, self.min_speedup_threshold, neighbours)


def tuned_call(
    labels: list[str],
    inputs: Sequence[Any],
    op: Any,
    non_tensor_args: Sequence[dict[str, Any]],
    min_speedup_threshold: float,
    benchmark_with_cudagraphs: bool,
) -> Optional[TunedCall]:
    """The call of ``op`` being lowered, for ops whose name or arguments say they
    communicate while collective tuning is on; None otherwise."""
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
    mode = timing_mode(settings, device, benchmark_with_cudagraphs)
    return TunedCall(group, settings, device, mode, (*labels, DEFAULT), inputs, min_speedup_threshold)


def settled_range(name: str, call: TunedCall, neighbours: Neighbours) -> Optional[CollectiveAutotuneRecord]:
    """The record of ladder range ``name`` where an earlier call site of the graph
    being lowered, fused with ``neighbours`` alike, settled its key; None otherwise.

    Then the range-based lowering needs only the winner's implementation, and no choice
    is traced: every layer of a model after the first would otherwise trace each of its
    ranges' winners again (eight ranges per site by default), for nothing. The session
    settled the key on every rank alike, and using it asks nothing of the group, exactly
    as :func:`decide_site` would.
    """
    session = collective_graph.joined_session(call.group)
    if session is None or not collective_dispatch.is_range(name):
        return None
    # The key as decided_before_tracing took it at the first site.
    key = call.key(name, neighbours)
    if key not in session.settled:
        return None
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    started = time.monotonic()
    counters["inductor"]["collective_autotune_sites"] += 1
    winner = collective_graph.settle_key(
        session, key, session.settled[key], name, environment(call.group, call.device)
    )
    return CollectiveAutotuneRecord(
        op=name,
        group_name=call.group.group_name,
        group_ranks=tuple(dist.get_process_group_ranks(call.group)),
        key=key,
        session=session.session.key,
        decision="use",
        source="job",
        reason=collective_graph.SETTLED_IN_GRAPH,
        timings=(),
        winner=winner,
        mode=call.mode,
        tuning_s=time.monotonic() - started,
    )


def decided_before_tracing(name: str, call: TunedCall, neighbours: Neighbours) -> Optional[str]:
    """The group's decision for the key of ``call`` at ``name`` if it is known already
    (a read of the Store, no waiting)."""

    def key_of(site: str) -> str:
        return call.key(site, neighbours)

    decisions = collective_graph.group_decisions(call.group, call.settings.timeout)
    key = key_of(name)

    def decided(site: str) -> Optional[str]:
        return decisions.get(key_of(site))

    # Every rank interpolates alike, whoever published first.
    between = collective_dispatch.interpolated(name, decided)
    if between is not None:
        _prepared[name] = _Prepared(key, call.labels, neighbours, "ladder", between[1])
        return decisions.publish(key, between[0])
    _prepared[name] = _Prepared(
        key, call.labels, neighbours, below=collective_dispatch.decided_below(name, decided)
    )
    return decisions.get(key)


# -- after tracing --------------------------------------------------------------------


@dataclasses.dataclass
class _Site:
    """A call site being decided on this rank, and what its decision takes."""

    name: str
    by_label: dict[str, ChoiceCaller]
    labels: tuple[str, ...]
    prepared: Optional[_Prepared]
    inputs: BenchmarkInputs
    group: ProcessGroup
    min_speedup_threshold: float
    settings: BenchmarkSettings
    device: torch.device
    mode: str
    neighbours: Neighbours
    key: str
    # Seconds spent compiling the choices.
    build_s: float = 0.0

    def report(self, session: GroupSession) -> SiteReport:
        """What this rank knows of the key before anything is built."""
        persisted = _persisted(self.key, self.group, self.device)
        return SiteReport(
            key=self.key,
            choices=self.labels,
            decided=session.decisions.get(self.key) or "",
            stored=persisted.digest() if persisted else "",
            stored_winner=persisted.winner if persisted else "",
            failed={
                **{label: "not traced on this rank" for label in self.labels if label not in self.by_label},
                **{label: trace_failure(c) for label, c in self.by_label.items() if trace_failure(c)},
            },
        )

    def build_choices(self) -> dict[str, str]:
        """Compile this rank's choices for the benchmark; why each one that did not
        build failed."""
        begin = time.monotonic()
        failures = {
            label: why for label, c in self.by_label.items()
            if not trace_failure(c) and (why := build(self.name, c, self.device, self.neighbours))
        }
        self.build_s = time.monotonic() - begin
        return failures


def _site(
    name: str,
    by_label: dict[str, ChoiceCaller],
    choices: list[ChoiceCaller],
    prepared: Optional[_Prepared],
    inputs: BenchmarkInputs,
    group: ProcessGroup,
    min_speedup_threshold: float,
    benchmark_with_cudagraphs: bool,
) -> _Site:
    """The call site of op ``name``: how its choices are timed and its key (the one
    prepare_choices took, where it took one)."""
    labels = prepared.labels if prepared else tuple(by_label)
    settings = BenchmarkSettings.from_config()
    device = benchmark_device(inputs.layout.device)
    mode = timing_mode(settings, device, benchmark_with_cudagraphs)
    neighbours = timed_with(prepared.neighbours if prepared else Neighbours(), choices)
    key = prepared.key if prepared else site_key(
        name, inputs.input_nodes, labels, mode, min_speedup_threshold, neighbours
    )
    return _Site(
        name, by_label, labels, prepared, inputs, group, min_speedup_threshold,
        settings, device, mode, neighbours, key,
    )


def decide_site(
    name: str,
    by_label: dict[str, ChoiceCaller],
    choices: list[ChoiceCaller],
    inputs: BenchmarkInputs,
    process_group: ProcessGroup,
    min_speedup_threshold: float,
    benchmark_with_cudagraphs: bool,
) -> CollectiveAutotuneRecord:
    """The group's decision for the call site of op ``name`` being lowered, whose
    ``choices`` are ``by_label``; raises CollectiveAutotuneError, on every rank of the
    group, when the group's collectives failed mid-benchmark and cannot be trusted."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch._inductor import config

    started, waited_before = time.monotonic(), waited_seconds()
    prepared = _prepared.pop(name, None)
    group_ranks = tuple(dist.get_process_group_ranks(process_group))
    if not config.collective_autotune:
        return CollectiveAutotuneRecord(
            name, process_group.group_name, group_ranks, "", "", "use", "agreement",
            "collective autotuning is off (TORCHINDUCTOR_COLLECTIVE_AUTOTUNE=0)", (), DEFAULT,
        )
    site = _site(
        name, by_label, choices, prepared, inputs, process_group, min_speedup_threshold,
        benchmark_with_cudagraphs,
    )
    session = collective_graph.session_for(process_group, site.settings.timeout)
    counters["inductor"]["collective_autotune_sites"] += 1
    decision, voting = collective_graph.agree_key(
        session, site.key, lambda: site.report(session), DEFAULT, site.build_choices,
        timing_allowed=not config.deterministic,
    )
    timings, winner, reason = _timed_winner(site, decision, voting)
    source, winner, reason = _settled(site, decision, voting, timings, winner, reason)
    waited_s = waited_seconds() - waited_before
    return CollectiveAutotuneRecord(
        op=name,
        group_name=process_group.group_name,
        group_ranks=group_ranks,
        key=site.key,
        session=voting.session.key,
        decision=decision.kind,
        source=source,
        reason=reason,
        timings=timings,
        winner=winner,
        mode=site.mode,
        timed_with=str(site.neighbours) if timings else "",
        waited_s=waited_s,
        build_s=site.build_s,
        tuning_s=time.monotonic() - started - site.build_s - waited_s,
    )


def _timed_winner(
    site: _Site, decision: SiteDecision, voting: GroupSession
) -> tuple[tuple[ChoiceTiming, ...], str, str]:
    """The group's timings of the key's choices (none where it decided without
    timing them), the winner and why."""
    if decision.kind != "benchmark":
        return (), decision.choices[0], decision.reason
    picked = list(decision.choices)
    # Lowering runs with the Python dispatcher on; a gloo worker thread would
    # inherit it and wait for the GIL that this thread holds in wait_tensor
    # (Inductor's regular benchmarking deadlocks so on gloo collectives).
    with no_python_dispatcher():
        timings = tuple(
            benchmark(site.inputs, site.by_label, picked, site.group, site.settings, site.mode,
                      voting.session.scoped(site.key),
                      keep_default=site.min_speedup_threshold > 1.0, neighbours=site.neighbours)
        )
    winner, picked_because = pick(
        picked, timings, site.min_speedup_threshold, site.prepared.below if site.prepared else None
    )
    return timings, winner, f"{decision.reason}; {picked_because}"


def _settled(
    site: _Site,
    decision: SiteDecision,
    voting: GroupSession,
    timings: tuple[ChoiceTiming, ...],
    winner: str,
    reason: str,
) -> tuple[str, str, str]:
    """Where the decision the group keeps for the key comes from, its winner and why;
    a benchmarked one is stored on disk too."""
    stored = collective_graph.settle_key(
        voting, site.key, winner, site.name, environment(site.group, site.device)
    )
    source = decision.source
    if stored != winner:
        winner, reason = stored, f"the group decided {stored} first"
    elif site.prepared and site.prepared.source and source == "job":
        source, reason = site.prepared.source, site.prepared.reason
    elif decision.source == "benchmark" and _persistence_on():
        DecisionStore().save(
            StoredDecision(site.key, environment(site.group, site.device), winner,
                           {t.name: t.max_us for t in timings})
        )
    return source, winner, reason


def _persistence_on() -> bool:
    from torch._inductor import config

    return bool(config.collective_autotune_persist)


def _persisted(key: str, group: ProcessGroup, device: torch.device) -> Optional[StoredDecision]:
    """This rank's stored decision for ``key``, unless persistence is off or re-tuning."""
    from torch._inductor import config

    if not _persistence_on() or config.collective_autotune_retune:
        return None
    return DecisionStore().load(key, environment(group, device))
