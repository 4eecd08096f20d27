"""One collective-tuned call site's decision: the group's, identical on every rank.

Before tracing, :func:`prepare_site` describes the call (:class:`CallSite`; a dynamic
site's probes are its :meth:`CallSite.probe`), and :func:`settled_range` and
:func:`decided_before_tracing` find sites whose winner is known, so that little or
nothing is traced. After tracing, :func:`decide_site` takes the group's decision from
the graph's session (graph_sessions.py): made earlier in the job, stored on disk and
screened again, or benchmarked in lockstep (timing.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TYPE_CHECKING

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._inductor.kernel.collective import graph_sessions
from torch._inductor.kernel.collective.choice_modules import Neighbours
from torch._inductor.kernel.collective.choices import (
    choice_label,
    DEFAULT,
    identities,
    Implementations,
    trace_failure,
    writes_into_input,
)
from torch._inductor.kernel.collective.detection import (
    call_names_a_group,
    communicated_groups,
    outside,
    synchronised_group,
)
from torch._inductor.kernel.collective.graph_state import graph_state
from torch._inductor.kernel.collective.graph_sessions import (
    GroupChoice,
    GroupSession,
    KeyWork,
    SettledSite,
    SiteDecision,
    SiteReport,
)
from torch._inductor.kernel.collective.ladder import Incumbent
from torch._inductor.kernel.collective.records import (
    Action,
    CollectiveAutotuneRecord,
    KeyTiming,
    site_key,
    Source,
)
from torch._inductor.kernel.collective.timing import (
    benchmark,
    BenchmarkInputs,
    build,
    pick,
    screen_stored,
    SiteBenchmark,
    SiteTiming,
    timed_with,
    timing_mode,
)
from torch._inductor.runtime.collective_benchmarking import (
    benchmark_device,
    BenchmarkSettings,
    ChoiceTiming,
    TimingMode,
)
from torch._inductor.runtime.collective_confidence import Confidence, judge
from torch._inductor.runtime.collective_decisions import (
    DecisionStore,
    digest,
    environment,
    KeptLadder,
    StoredDecision,
)
from torch._inductor.runtime.collective_protocol import (
    participant,
    process_group_initialized,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torch._inductor.ir import ChoiceCaller

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CallSite:
    """A collective op's call being lowered and the key of its decision; ``labels``
    end with the op's own implementation."""

    name: str
    # None where the site was not prepared before tracing.
    op: torch._ops.OpOverload | None
    group: ProcessGroup
    settings: BenchmarkSettings
    device: torch.device
    mode: TimingMode
    labels: tuple[str, ...]
    code: dict[str, str]
    inputs: Sequence[Any]
    min_speedup_threshold: float
    neighbours: Neighbours
    key: str
    incumbent: Incumbent | None = None  # for a dynamic site's probe
    # Positions of the tensor inputs the op declares it writes into.
    mutable: tuple[int, ...] = ()
    prepared_at: float = dataclasses.field(default_factory=time.monotonic)
    # A dynamic site's probe: the size its choices are timed at; None for a static one.
    size: int | None = None
    # The call site's autotuning name, which a dynamic site's probes share.
    autotune_name: str = ""

    def probe(
        self,
        name: str,
        size: int,
        choices: tuple[str, ...] | None,
        incumbent: Incumbent | None,
    ) -> CallSite:
        """This dynamic site's probe at ``size`` (lowered as ``name``) among
        ``choices`` (None: all), keyed by the site, the size and the choices."""
        labels = self.labels if choices is None else tuple(choices)
        return dataclasses.replace(
            self,
            name=name,
            labels=labels,
            key=digest(self.key, size, labels),
            incumbent=incumbent,
            size=size,
            autotune_name=self.name,
            prepared_at=time.monotonic(),
        )

    def settled_site(self) -> SettledSite:
        """What a graph's cache entry keeps of this site with its decisions."""
        return SettledSite(
            self.name,
            self.autotune_name or self.name,
            environment(self.group, self.device),
            self.code,
        )


def prepare_site(
    name: str,
    implementations: Implementations,
    inputs: Sequence[Any],
    timing: SiteTiming,
    neighbours: Neighbours,
) -> CallSite | None:
    """The call of ``implementations.op`` being lowered, where its arguments name a
    process group while collective tuning is on; None otherwise (its choices may still
    communicate: the site is then built after tracing). The site's group is the call's
    for good."""
    from torch._inductor import config

    op = implementations.op
    _prepared_sites().pop(name, None)
    arguments = (implementations.non_tensor_args or [{}])[0]
    if not (
        config.collective_autotune
        and process_group_initialized()
        and inputs
        and call_names_a_group(op, arguments)
    ):
        return None
    group = synchronised_group(op, arguments, ())
    labels = implementations.labels()
    call = LoweredCall(
        name=name,
        op=op,
        inputs=inputs,
        labels=(*labels, DEFAULT),
        implementations=list(zip(labels, implementations.decompositions)),
        mutable=mutable_inputs(op),
    )
    device = benchmark_device(inputs[0].get_device())
    site = _call_site(call, group, device, timing, neighbours)
    _prepared_sites()[name] = site
    return site


@dataclasses.dataclass(frozen=True)
class LoweredCall:
    """A collective op's call being lowered, before it is keyed."""

    name: str
    # None where only the traced choices tell (the site was not prepared).
    op: torch._ops.OpOverload | None
    inputs: Sequence[Any]
    # The choices' labels, ending with the op's own.
    labels: tuple[str, ...]
    # The implementation of each choice that has one, by label.
    implementations: Sequence[tuple[str, Callable[..., Any]]]
    # Positions of the tensor inputs the op declares it writes into.
    mutable: tuple[int, ...] = ()


def _call_site(
    call: LoweredCall,
    group: ProcessGroup,
    device: torch.device,
    timing: SiteTiming,
    neighbours: Neighbours,
) -> CallSite:
    """The site of ``call``, under the settings in force, keyed by its
    implementations' code identities."""
    settings = _once_per_graph(("settings",), BenchmarkSettings.from_config)
    mode = timing_mode(settings, device, timing.benchmark_with_cudagraphs)
    op, implementations = call.op, call.implementations
    # Keyed by id() (callables may be unhashable); the cache keeps them alive so no
    # id is reused.
    code = _once_per_graph(
        ("code", op, tuple((lbl, id(fn)) for lbl, fn in implementations)),
        lambda: (list(implementations), identities(op, implementations)),
    )[1]
    key = site_key(
        call.name,
        call.inputs,
        call.labels,
        code,
        KeyTiming(mode, timing.min_speedup_threshold, neighbours),
    )
    return CallSite(
        name=call.name,
        op=op,
        group=group,
        settings=settings,
        device=device,
        mode=mode,
        labels=call.labels,
        code=code,
        inputs=call.inputs,
        min_speedup_threshold=timing.min_speedup_threshold,
        neighbours=neighbours,
        key=key,
        mutable=call.mutable,
    )


def _once_per_graph(key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    constants = graph_state().constants
    if key not in constants:
        constants[key] = compute()
    return constants[key]


def settled_range(site: CallSite) -> CollectiveAutotuneRecord | None:
    """The record of a dynamic site's probe whose key is settled already (by an earlier
    site or compile) and can be taken without asking the group, so no choice is traced;
    None otherwise. Every rank takes it exactly as :func:`decide_site` would."""
    session = graph_sessions.joined_session(site.group)
    if session is None:
        return None
    decision = graph_sessions.decided_without_group(session, site.key, DEFAULT)
    if decision is None:
        return None
    from torch._dynamo.utils import counters

    counters["inductor"]["collective_autotune_sites"] += 1
    started = time.monotonic()
    choice = graph_sessions.settle_key(
        session,
        site.key,
        GroupChoice(decision.choices[0], decision.provisional),
        site.settled_site(),
    )
    return _record(
        site,
        session,
        dataclasses.replace(decision, choices=(choice.winner,)),
        (),
        choice,
        started,
    )


def decided_before_tracing(site: CallSite) -> str | None:
    """The group's decision for ``site``'s key if already known (a Store read, no
    waiting)."""
    session = graph_sessions.joined_session(site.group)
    if session is not None and site.key in session.settled:
        return session.settled[site.key].winner
    decisions = graph_sessions.group_decisions(site.group, site.settings.timeout)
    choice = graph_sessions.decided(decisions, site.key)
    return None if choice is None else choice.winner


def known_decision(site: CallSite) -> GroupChoice | None:
    """The group's decision for ``site``'s key where this rank holds it already and
    needs no vote for it (the session does not vote); None otherwise."""
    session = graph_sessions.session_for(site.group, site.settings)
    if session.votes:
        return None
    known = session.decisions.known(site.key)
    return None if known is None else GroupChoice.decode(known)


def mutable_inputs(op: torch._ops.OpOverload) -> tuple[int, ...]:
    """The positions, among ``op``'s tensor arguments, of those it declares it
    writes."""
    arguments = [
        a for a in op._schema.arguments if isinstance(a.type, torch.TensorType)
    ]
    return tuple(
        i
        for i, a in enumerate(arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def prepared_group(name: str) -> ProcessGroup | None:
    """The group of op ``name``'s site as prepared before tracing, or None."""
    site = _prepared_sites().get(name)
    return site.group if site is not None else None


def _prepared_sites() -> dict[str, CallSite]:
    """This graph's sites prepared before tracing, by op name, taken by decide_site."""
    return graph_state().prepared_sites


def prepare_probe(site: CallSite) -> None:
    """Hand a dynamic site's probe, prepared by its ladder, to :func:`decide_site`."""
    _prepared_sites()[site.name] = site


# -- after tracing --------------------------------------------------------------------


def decide_site(
    name: str,
    choices: list[ChoiceCaller],
    inputs: BenchmarkInputs,
    process_group: ProcessGroup,
    timing: SiteTiming,
) -> tuple[CollectiveAutotuneRecord, dict[str, ChoiceCaller]]:
    """The group's decision for the call site of op ``name``, and its ``choices`` by
    label. Raises CollectiveAutotuneError on every rank if the group's collectives
    failed mid-benchmark."""
    from torch._dynamo.utils import counters
    from torch._inductor import config

    started = time.monotonic()
    prepared = _prepared_sites().pop(name, None)
    by_label = {choice_label(c, prepared.op if prepared else None): c for c in choices}
    if not config.collective_autotune:
        return untuned_record(name, process_group), by_label
    if prepared is not None:
        neighbours = timed_with(prepared.neighbours, choices)
        site = dataclasses.replace(prepared, group=process_group, neighbours=neighbours)
    else:
        site = _traced_site(name, by_label, choices, inputs, process_group, timing)
    counters["inductor"]["collective_autotune_sites"] += 1
    member = participant(site.settings.timeout)
    waited_before, requests_before = member.waited_s, member.client.requests
    work = _SiteWork(site, by_label, inputs)
    record = _agreed_record(work, started)
    waited_s = member.waited_s - waited_before
    return (
        dataclasses.replace(
            record,
            waited_s=waited_s,
            build_s=work.build_s,
            trace_s=started - site.prepared_at if prepared is not None else 0.0,
            phases=tuple(work.phases.items()),
            store_requests=member.client.requests - requests_before,
            tuning_s=record.tuning_s - work.build_s - waited_s,
        ),
        by_label,
    )


def untuned_record(name: str, group: ProcessGroup) -> CollectiveAutotuneRecord:
    """The record of a site while collective autotuning is off: the op's own
    implementation, untimed."""
    import torch.distributed as dist

    return CollectiveAutotuneRecord(
        op=name,
        group_name=group.group_name,
        group_ranks=tuple(dist.get_process_group_ranks(group)),
        key="",
        session="",
        decision=Action.USE,
        source=Source.AGREEMENT,
        reason="collective autotuning is off (TORCHINDUCTOR_COLLECTIVE_AUTOTUNE=0)",
        timings=(),
        winner=DEFAULT,
    )


def _agreed_record(work: _SiteWork, started: float) -> CollectiveAutotuneRecord:
    """This rank's record of the group's decision for ``work``'s site."""
    from torch._inductor import config

    site = work.site
    session = graph_sessions.session_for(site.group, site.settings)
    decision, voting = graph_sessions.agree_key(
        session,
        site.key,
        KeyWork(
            default=DEFAULT,
            report=lambda: work.report(session),
            build=work.build,
            verify=work.verify,
            timing_allowed=not config.deterministic,
        ),
    )
    timings, winner, reason, confidence = work.timed_winner(decision, voting)
    unsure = confidence is not None and not confidence.settled
    decision = dataclasses.replace(
        decision, reason=reason, provisional=decision.provisional or unsure
    )
    source, stored, reason = _settled(
        site, decision, voting, timings, winner, confidence
    )
    if (
        source == Source.BENCHMARK
        and site.incumbent is not None
        and site.incumbent.between
        and stored.winner == site.incumbent.winner
    ):
        source = Source.LADDER
    decision = dataclasses.replace(decision, source=source, reason=reason)
    record = _record(site, voting, decision, timings, stored, started)
    return dataclasses.replace(record, confidence=confidence)


def _traced_site(
    name: str,
    by_label: dict[str, ChoiceCaller],
    choices: list[ChoiceCaller],
    inputs: BenchmarkInputs,
    group: ProcessGroup,
    timing: SiteTiming,
) -> CallSite:
    """The site of op ``name``, not prepared before tracing, built from its traced
    ``choices``."""
    call = LoweredCall(
        name=name,
        op=None,
        inputs=inputs.input_nodes,
        labels=tuple(by_label),
        implementations=[
            (lbl, c.decomposition)
            for lbl, c in by_label.items()
            if getattr(c, "decomposition", None) is not None
        ],
    )
    device = benchmark_device(inputs.layout.device)
    return _call_site(call, group, device, timing, timed_with(Neighbours(), choices))


@dataclasses.dataclass
class _SiteWork:
    """This rank's work to decide one site: report, build, screen and time."""

    site: CallSite
    by_label: dict[str, ChoiceCaller]
    inputs: BenchmarkInputs
    build_s: float = 0.0  # seconds compiling choices
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def report(self, session: GroupSession) -> SiteReport:
        """What this rank knows of the key before anything is built."""
        persisted = _persisted(self.site)
        # No new Store read: a decision published since reaches the vote via the
        # rank that read it.
        known = session.decisions.known(self.site.key)
        return SiteReport(
            key=self.site.key,
            choices=self.site.labels,
            decided=GroupChoice.decode(known) if known is not None else None,
            stored=persisted.digest() if persisted else None,
            stored_winner=persisted.winner if persisted else None,
            stored_runner_up=(
                (persisted.runner_up or None)
                if persisted and persisted.provisional
                else None
            ),
            failed={
                **{
                    label: "not traced on this rank"
                    for label in self.site.labels
                    if label not in self.by_label
                },
                **{
                    label: why
                    for label, c in self.by_label.items()
                    if (why := self._unusable(getattr(c, "gm", None), trace_failure(c)))
                },
            },
        )

    def _unusable(self, gm: torch.fx.GraphModule | None, failure: str) -> str:
        """Why a choice (its traced ``gm``) cannot be tuned here, or "": it failed
        while traced, writes into an input, or communicates beyond the site's group."""
        if failure or gm is None:
            return failure
        return writes_into_input(gm, self.site.mutable) or outside(
            self.site.group, communicated_groups(gm)
        )

    def build(self, labels: Sequence[str]) -> dict[str, str]:
        """Compile ``labels`` for the benchmark; why each that did not build failed."""
        begin = time.monotonic()
        chosen = {
            label: self.by_label[label] for label in labels if label in self.by_label
        }
        failures = build(
            self.site.name,
            chosen,
            self.site.device,
            self.site.neighbours,
            self.site.mode,
            any_size=self.site.size is not None,
        )
        self.build_s += time.monotonic() - begin
        return failures

    def verify(self, winner: str, session: GroupSession) -> str:
        """Screen the stored ``winner`` on every rank: "" if it passed, else why."""
        with no_python_dispatcher():
            return screen_stored(
                self._benchmark(), winner, session.session.scoped(self.site.key)
            )

    def _benchmark(self) -> SiteBenchmark:
        """This site's traced choices, as its group times them."""
        site = self.site
        return SiteBenchmark(
            self.inputs,
            self.by_label,
            site.group,
            site.settings,
            site.mode,
            site.neighbours,
            site.mutable,
        )

    def timed_winner(
        self, decision: SiteDecision, voting: GroupSession
    ) -> tuple[tuple[ChoiceTiming, ...], str, str, Confidence | None]:
        """Timings (none if decided without them), winner, reason and confidence."""
        if decision.action != Action.BENCHMARK:
            return (), decision.choices[0], decision.reason, None
        picked = list(decision.choices)
        site = self.site
        screened = site.incumbent if site.incumbent and site.incumbent.between else None
        # A gloo worker thread would inherit the Python dispatcher and deadlock on
        # the GIL this thread holds in wait_tensor.
        with no_python_dispatcher():
            timings, self.phases = benchmark(
                self._benchmark(),
                picked,
                voting.session.scoped(site.key),
                keep_default=site.min_speedup_threshold > 1.0,
                incumbent=screened.winner if screened else None,
            )
        winner, picked_because = pick(
            picked, timings, site.min_speedup_threshold, site.incumbent
        )
        confidence = judge(timings, winner, host_paced=site.mode is TimingMode.EAGER)
        if screened is not None:
            picked_because = (
                f"screened against {screened.winner}, the winner at {screened.won_at}: "
                f"{picked_because}"
            )
        return (
            tuple(timings),
            winner,
            f"{decision.reason}; {picked_because}",
            confidence,
        )


def _settled(
    site: CallSite,
    decision: SiteDecision,
    voting: GroupSession,
    timings: tuple[ChoiceTiming, ...],
    winner: str,
    confidence: Confidence | None,
) -> tuple[Source, GroupChoice, str]:
    """(source, the group's decision as kept, reason) of the decision the group keeps;
    a benchmarked one is also stored on disk, provisional where timed without
    confidence. The timings travel with it: from this benchmark, or from disk."""
    unsure = confidence is not None and not confidence.settled
    measured = GroupChoice(
        winner,
        decision.provisional,
        unsure,
        {t.name: t.max_us for t in timings},
        {t.name: t.low_us for t in timings},
        {t.name: t.high_us for t in timings},
    )
    persisted = _persisted(site) if decision.source == Source.DISK else None
    if persisted is not None:
        measured = dataclasses.replace(
            measured,
            timings_us=dict(persisted.timings_us),
            low_us=dict(persisted.low_us),
            high_us=dict(persisted.high_us),
        )
    stored = graph_sessions.settle_key(voting, site.key, measured, site.settled_site())
    source, reason = decision.source, decision.reason
    if stored.winner != winner:
        return source, stored, f"the group decided {stored.winner} first"
    if source == Source.BENCHMARK and _persistence_on():
        DecisionStore().save(
            StoredDecision(
                site.key,
                site.settled_site().environment,
                winner,
                measured.timings_us,
                provisional=unsure,
                runner_up=confidence.runner_up if unsure and confidence else "",
                confidence=confidence.describe() if confidence else "",
                low_us=measured.low_us,
                high_us=measured.high_us,
            )
        )
    return source, stored, reason


def _record(
    site: CallSite,
    session: GroupSession,
    decision: SiteDecision,
    timings: tuple[ChoiceTiming, ...],
    stored: GroupChoice,
    started: float,
) -> CollectiveAutotuneRecord:
    import torch.distributed as dist

    return CollectiveAutotuneRecord(
        op=site.name,
        group_name=site.group.group_name,
        group_ranks=tuple(dist.get_process_group_ranks(site.group)),
        key=site.key,
        session=session.session.key,
        decision=decision.action,
        source=decision.source,
        reason=decision.reason,
        timings=timings,
        winner=stored.winner,
        mode=site.mode,
        timed_with=str(site.neighbours) if timings else "",
        provisional=decision.provisional,
        tuning_s=time.monotonic() - started,
        measurement=None if site.size is None else stored.measurement(site.size),
    )


def keep_ladder(site: CallSite, op: str, ranges: Sequence[tuple[float, str]]) -> None:
    """Keep the ``ranges`` (top, winner) of the dynamic call ``site`` of ``op`` beside
    its decisions, for an engine to read before it compiles."""
    if not _persistence_on():
        return
    settled = site.settled_site()
    DecisionStore().save_ladder(
        KeptLadder(
            site.key,
            op,
            settled.environment,
            site.code,
            tuple(top for top, _ in ranges),
            tuple(winner for _, winner in ranges),
        )
    )


def _persistence_on() -> bool:
    from torch._inductor import config

    return bool(config.collective_autotune_persist)


def _persisted(site: CallSite) -> StoredDecision | None:
    """This rank's stored decision for the key, unless persistence is off or
    retuning."""
    from torch._inductor import config

    if not _persistence_on() or config.collective_autotune_retune:
        return None
    return DecisionStore().load(site.key, environment(site.group, site.device))
