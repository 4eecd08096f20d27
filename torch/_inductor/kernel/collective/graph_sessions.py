"""Collective autotuning per graph: one Store session per graph and process group.

At its first collective-tuned call site a graph joins one session per group; each
distinct key is then agreed at its first site with one vote, in lockstep, by the ranks
that joined, and the result is the group's decision for the key for the rest of the job
attempt. A cache hit that inlines collective decisions is used only when the group
already decided those keys or every rank loads the same graph; otherwise it becomes a
miss, so that a warm rank never skips a session its cold peers wait in."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TYPE_CHECKING

import torch
from torch._inductor.kernel.collective import dispatch, dynamo_callbacks, range_graphs
from torch._inductor.kernel.collective.choices import (
    current_identity,
    registered_and_may_communicate,
)
from torch._inductor.kernel.collective.graph_state import (
    graph_state,
    recorded_graph_state,
)
from torch._inductor.kernel.collective.detection import (
    covering_group,
    named_groups,
    node_arguments,
    op_name,
)
from torch._inductor.kernel.collective.records import (
    Action,
    cleared_with_inductor_caches,
    CollectiveAutotuneRecord,
    keep_record,
    keep_size_path,
    Measurement,
    SizePath,
    SizePathRecord,
    Source,
)
from torch._inductor.runtime.collective_benchmarking import describe_knob
from torch._inductor.runtime.collective_decisions import (
    current_environment,
    Environment,
    digest,
    group_scope,
    InlinedDecision,
)
from torch._inductor.runtime import collective_protocol
from torch._inductor.runtime.collective_protocol import (
    CollectiveAutotuneError,
    CollectiveSession,
    Decision,
    DecisionKind,
    GroupDecisions,
    Join,
    MalformedMessageError,
    participant,
    process_group_initialized,
    WireMessage,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings


log = logging.getLogger(__name__)

# Why a site takes the decision an earlier site of the same graph settled for its key.
SETTLED_IN_GRAPH = "decided at an earlier site of this graph"


# -- plans -------------------------------------------------------------------------


def _plan(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """The collective-tuned call sites of ``gm`` by the group their calls name, each
    described by what every rank sees alike (never node names or device indices). A
    call that names no group is none here: its choices may still communicate, and its
    site then joins a session of its own."""
    sites: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(
            node.target, torch._ops.OpOverload
        ):
            continue
        if not registered_and_may_communicate(node.target):
            continue
        group, descriptor = _site(node, gm)
        if group is not None:
            sites.setdefault(group, []).append(descriptor)
    return {g: sorted(s) for g, s in sites.items()}


def _site(node: torch.fx.Node, gm: torch.nn.Module) -> tuple[str | None, str]:
    """The name of the group the call ``node`` names (None: none) and the call
    described without it."""
    arguments = node_arguments(node, gm)
    named = [n for n in named_groups(node.target, arguments) if n.group is not None]
    parts = [op_name(node.target)]  # type: ignore[arg-type]
    for name, value in arguments.items():
        if any(n.argument == name for n in named):
            continue
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(meta, torch.Tensor):
            parts.append(f"{list(meta.shape)}/{list(meta.stride())}/{meta.dtype}")
        else:
            parts.append(repr(value))
    group = covering_group([n.group for n in named]) if named else None  # type: ignore[misc]
    return (group.group_name if group is not None else None), "|".join(parts)


# -- what the group decided ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupChoice(WireMessage):
    """The group's decision for a key, as the Store keeps it for the attempt."""

    malformed_error = MalformedMessageError

    winner: str
    # A fallback, or timed without confidence: holds for this attempt only.
    provisional: bool = False
    # Provisional only for want of confidence: a ladder may still take it as incumbent.
    unsure: bool = dataclasses.field(default=False, compare=False)
    # Slowest-rank median microseconds of each choice timed for the key: a dynamic
    # site's ranges follow from them, alike wherever the decision is read.
    timings_us: dict[str, float] = dataclasses.field(
        default_factory=dict, compare=False
    )
    # Their samples' quartiles: within them, no timing tells two choices apart.
    low_us: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
    high_us: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)

    def measurement(self, size: int) -> Measurement:
        """The decision as a dynamic call site's probe at ``size`` reads it."""
        return Measurement(
            size,
            self.winner,
            self.timings_us,
            not self.provisional or self.unsure,
            self.low_us,
            self.high_us,
        )


def decided(decisions: GroupDecisions, key: str) -> GroupChoice | None:
    """The group's decision for ``key`` if published (no waiting)."""
    raw = decisions.get(key)
    return None if raw is None else GroupChoice.decode(raw)


# -- the graph's sessions ------------------------------------------------------------


@dataclasses.dataclass
class GroupSession:
    """This rank's view of one session: its decision and whether this rank votes."""

    group: ProcessGroup
    # The plan of the graph being compiled, which its cache entry records.
    plan: str
    session: CollectiveSession
    decision: Decision
    decisions: GroupDecisions
    settings: BenchmarkSettings
    # Keys already settled in this graph: later sites of a key reuse them unvoted.
    settled: dict[str, GroupChoice] = dataclasses.field(default_factory=dict)
    # What the graph inlines of each settled key, for its cache entry.
    inlined: dict[str, InlinedDecision] = dataclasses.field(default_factory=dict)

    @property
    def votes(self) -> bool:
        """Whether this rank agrees keys with its peers in lockstep."""
        return self.session.votes


# Sessions joined by a rejected cache hit: the compile that follows takes them over.
_pending: dict[tuple[str, str], GroupSession] = cleared_with_inductor_caches({})


def session_for(group: ProcessGroup, settings: BenchmarkSettings) -> GroupSession:
    """The session of the graph being lowered on ``group``. At first use the graph joins
    all its groups' sessions in one order on every rank, so none wait in a cycle."""
    from torch._inductor.virtualized import V

    state = graph_state()
    sessions = state.sessions
    if sessions is None:
        sessions = {}
        plan = _plan(V.graph.module)
        for name in sorted(plan):
            member = _resolve(name)
            if member is not None:
                sessions[name] = _join(
                    member, digest(plan[name], _timing_context()), settings, loaded=""
                )
        state.sessions = sessions
    if group.group_name not in sessions:
        # A site the plan could not see (a hidden collective, or another group).
        node = V.graph.current_node
        descriptor = _site(node, V.graph.module)[1] if node is not None else ""
        sessions[group.group_name] = _join(
            group, digest([descriptor], _timing_context()), settings, loaded=""
        )
    return sessions[group.group_name]


def joined_session(group: ProcessGroup) -> GroupSession | None:
    """The session of the graph being lowered on ``group``, once joined (no waiting)."""
    return (graph_state().sessions or {}).get(group.group_name)


def _timing_context() -> tuple[Any, ...]:
    """What changes keys without changing the graph: whether CUDA graphs are on."""
    from torch._inductor import config

    return (bool(config.triton.cudagraphs),)


def _join(
    group: ProcessGroup,
    plan: str,
    settings: BenchmarkSettings,
    loaded: str,
    name: str = "",
) -> GroupSession:
    """Join session ``name`` (the plan's by default) of ``group`` with what this rank
    ``loaded``; raises CollectiveAutotuneError on every rank if settings differ."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    name = name or plan
    pending = _pending.pop((group.group_name, name), None)
    if pending is not None:
        return pending
    counters["inductor"]["collective_autotune_sessions"] += 1
    member = participant(settings.timeout)
    session = CollectiveSession(
        member,
        group.group_name,
        name,
        dist.get_rank(group),
        dist.get_process_group_ranks(group),
        settings.timeout,
    )
    decision = session.agree(
        Join(loaded, settings.knobs()),
        decide=_decide_graph,
        fallback=lambda why: Decision(DecisionKind.FALLBACK, why),
    )
    if decision.kind == DecisionKind.MISMATCH:
        raise CollectiveAutotuneError(f"group {group.group_name}: {decision.reason}")
    return GroupSession(
        group,
        plan,
        session,
        decision,
        group_decisions(group, settings.timeout),
        settings,
    )


def group_decisions(group: ProcessGroup, timeout: float) -> GroupDecisions:
    """The decisions ``group`` keeps in the Store for the attempt, by environment."""
    return collective_protocol.group_decisions(group, group_scope(group), timeout)


def _decide_graph(joins: list[Join]) -> Decision:
    """Stop if the ranks' settings differ; load the cached graph only if every rank
    loaded the identical one; otherwise every rank compiles it."""
    mismatch = _differing_settings([j.settings for j in joins])
    if mismatch:
        return Decision(DecisionKind.MISMATCH, mismatch)
    loaded = [j.loaded for j in joins]
    if loaded[0] and all(x == loaded[0] for x in loaded):
        return Decision(
            DecisionKind.LOAD,
            "every rank loaded the same compiled graph from its cache",
        )
    hits = [r for r, x in enumerate(loaded) if x]
    if not hits:
        return Decision(DecisionKind.COMPILE, "every rank compiles the graph")
    return Decision(
        DecisionKind.COMPILE,
        f"group ranks {hits} hit their caches but not with one graph on every rank; "
        "every rank compiles it",
    )


def _differing_settings(per_rank: list[dict[str, Any]]) -> str:
    """Which knobs differ between the ranks, with their values per rank, or ""."""
    clauses = []
    for knob in sorted(per_rank[0]):
        values = [settings.get(knob) for settings in per_rank]
        if any(v != values[0] for v in values):
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            clauses.append(
                f"{describe_knob(knob)} differs: "
                + ", ".join(
                    f"{v} on group ranks {ranks}" for v, ranks in by_value.items()
                )
            )
    if not clauses:
        return ""
    return (
        "the ranks of the group must tune with the same collective autotuning "
        "settings; " + "; ".join(clauses)
    )


def _resolve(group_name: str) -> ProcessGroup | None:
    """The group named ``group_name`` if this rank belongs to it."""
    import torch.distributed as dist

    try:
        group = torch._C._distributed_c10d._resolve_process_group(group_name)
    except RuntimeError as e:  # c10d knows no such group
        log.debug("group %s is not this rank's: %s", group_name, e)
        return None
    return group if dist.get_rank(group) >= 0 else None


# -- agreeing one key ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SiteReport(WireMessage):
    """What one rank knows of a key before anything is built: its vote on the key."""

    malformed_error = MalformedMessageError

    key: str
    choices: tuple[str, ...]
    # The group's decision for the key, if one was published.
    decided: GroupChoice | None
    # This rank's stored decision, if it holds one: its digest and winner.
    stored: str | None
    stored_winner: str | None
    # Choices that cannot be used here (raised while traced, did not build), and why.
    failed: dict[str, str]
    # Whether ``failed`` already includes this rank's build failures.
    built: bool = False
    # For a provisional stored decision: the runner-up to time its winner against.
    stored_runner_up: str | None = None


def _reasons(value: Any) -> bool:
    """Whether ``value`` maps choices to why they failed."""
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


@dataclasses.dataclass(frozen=True)
class SiteDecision:
    """How the group settles one key: ``use`` a choice, or ``benchmark`` some."""

    action: Action
    choices: tuple[str, ...]
    reason: str
    source: Source
    provisional: bool = False


# Builds the given labels; returns why each one that failed did.
Build = Callable[[Sequence[str]], dict[str, str]]
# Screens a stored winner against the op's own implementation on every rank: "" if it
# passed, else why not (the same words on every rank).
Verify = Callable[[str, GroupSession], str]


@dataclasses.dataclass(frozen=True)
class KeyWork:
    """This rank's part in deciding a key: the op's own choice (``default``), and the
    work that runs only where the group needs it, on every rank alike."""

    default: str
    report: Callable[[], SiteReport]
    build: Build
    verify: Verify
    # False under config.deterministic: the group decides untimed.
    timing_allowed: bool


def agree_key(
    session: GroupSession, key: str, work: KeyWork
) -> tuple[SiteDecision, GroupSession]:
    """The group's decision for ``key``, identical on every rank, and the session a
    benchmark of it must vote in."""
    default = work.default
    known = decided_without_group(session, key, default)
    if known is not None:
        return known, session
    if not session.votes:
        followed = _follow(session, key, default)
        if followed is not None:
            return followed, session
        # An earlier compile of this plan held the session without meeting this key:
        # the key gets a session of its own, settled for this graph's later sites.
        session = dataclasses.replace(
            _join(
                session.group,
                session.plan,
                session.settings,
                loaded="",
                name=digest(key, "key"),
            ),
            plan=session.plan,
            settled=session.settled,
            inlined=session.inlined,
        )
        if not session.votes:
            # Its peers decided it in that session without this rank: they publish it.
            followed = _follow(session, key, default) or _published(
                session, key, default
            )
            return followed, session
    return _vote_key(session, work.report(), work), session


def decided_without_group(
    session: GroupSession, key: str, default: str
) -> SiteDecision | None:
    """The decision for ``key`` this rank can take without asking its group, so that no
    choice need be traced: settled earlier in this graph, or (where the session does
    not vote) read or published before. None where the key needs more."""
    settled = session.settled.get(key)
    if settled is not None:
        return SiteDecision(
            Action.USE,
            (settled.winner,),
            SETTLED_IN_GRAPH,
            Source.JOB,
            settled.provisional,
        )
    if session.votes or session.decisions.known(key) is None:
        return None
    return _follow(session, key, default)


def _follow(session: GroupSession, key: str, default: str) -> SiteDecision | None:
    """The decision of a rank that does not vote in ``session``; None where the session
    was held by an earlier compile of its plan, which did not decide ``key``."""
    stored = decided(session.decisions, key)
    if session.decision.kind == DecisionKind.FALLBACK:
        # The group did not assemble: the op's own unless the key was decided before.
        winner, provisional = (
            (stored.winner, stored.provisional)
            if stored is not None
            else (default, True)
        )
        return SiteDecision(
            Action.USE,
            (winner,),
            session.decision.reason,
            Source.AGREEMENT,
            provisional,
        )
    if stored is not None:
        return _taken(stored, "decided earlier in this job")
    if session.decision.kind == DecisionKind.LOAD:
        # The ranks that loaded the graph publish its decisions right away.
        return _published(session, key, default)
    return None


def _taken(choice: GroupChoice, reason: str) -> SiteDecision:
    """Use what the group decided for a key in this attempt."""
    return SiteDecision(
        Action.USE, (choice.winner,), reason, Source.JOB, choice.provisional
    )


def _published(session: GroupSession, key: str, default: str) -> SiteDecision:
    """The decision its peers publish for ``key``, or, past the deadline, the op's own
    implementation (proposed like any decision, so every rank ends with the same)."""
    stored = session.decisions.wait(key)
    if stored is not None:
        return _taken(GroupChoice.decode(stored), "decided by the group")
    return SiteDecision(
        Action.USE,
        (default,),
        "the group did not publish a decision in time",
        Source.AGREEMENT,
        provisional=True,
    )


def _vote_key(session: GroupSession, report: SiteReport, work: KeyWork) -> SiteDecision:
    """The group's decision for ``report``'s key from one vote on every rank's report:
    published, the op's own, a stored one screened again, or the choices built."""
    topic = f"site/{report.key}"
    if not (report.stored or report.decided):
        # The group can only time the choices: build them first, so one vote does.
        runnable = [n for n in report.choices if n not in report.failed]
        with session.session.working(f"compiling the choices of {topic}"):
            report = dataclasses.replace(
                report, failed={**work.build(runnable), **report.failed}, built=True
            )
    votes = session.session.vote(topic, report.to_wire())
    reports = [SiteReport.from_wire(vote) for vote in votes]
    published = next((r.decided for r in reports if r.decided is not None), None)
    if published is not None:
        return _taken(published, "decided earlier in this job")
    differing = _differing(reports, work.default)
    if differing is not None:
        return differing
    failed = _failures([rep.failed for rep in reports])
    stored = _stored_decision(session, topic, reports, failed, work)
    if stored is not None:
        return stored
    return _decision_on_built(session, topic, reports, failed, work)


def _differing(reports: list[SiteReport], default: str) -> SiteDecision | None:
    """Where some ranks tune another op, shape or choice list than group rank 0: the
    op's own implementation (or the first common choice), provisional; else None."""
    differing = [
        r
        for r, rep in enumerate(reports)
        if (rep.key, rep.choices) != (reports[0].key, reports[0].choices)
    ]
    if not differing:
        return None
    common = [n for n in reports[0].choices if all(n in rep.choices for rep in reports)]
    chosen = default if default in common else (common or [default])[0]
    return SiteDecision(
        Action.USE,
        (chosen,),
        f"group ranks {differing} tune a different op, shape or choice list than "
        f"group rank 0; all use {chosen}",
        Source.AGREEMENT,
        provisional=True,
    )


def _stored_decision(
    session: GroupSession,
    topic: str,
    reports: list[SiteReport],
    failed: dict[str, str],
    work: KeyWork,
) -> SiteDecision | None:
    """Use a stored decision that every rank holds and whose winner passes its screen
    again; else None, adding a failed winner to ``failed``."""
    choices = reports[0].choices
    stored = {rep.stored for rep in reports}
    winner = reports[0].stored_winner
    if not (
        len(stored) == 1
        and None not in stored
        and winner in choices
        and winner not in failed
    ):
        return None
    # A provisional decision is timed again against its runner-up only.
    runner_up = reports[0].stored_runner_up
    again = (runner_up,) if runner_up in choices and runner_up not in failed else ()
    verdict = _verify_stored(session, topic, winner, work, again)
    if not verdict and again:
        return SiteDecision(
            Action.BENCHMARK,
            (winner, *again),
            f"every rank holds the same stored decision, provisional: {winner} timed "
            f"against {runner_up} again",
            Source.BENCHMARK,
        )
    if not verdict:
        return SiteDecision(
            Action.USE,
            (winner,),
            "every rank holds the same stored decision, which passed its screen again",
            Source.DISK,
            provisional=bool(runner_up),
        )
    log.warning(
        "the stored decision for %s (winner %s) is not used: %s; tuning afresh",
        topic,
        winner,
        verdict,
    )
    failed[winner] = f"the stored winner {verdict}"
    return None


def _decision_on_built(
    session: GroupSession,
    topic: str,
    reports: list[SiteReport],
    failed: dict[str, str],
    work: KeyWork,
) -> SiteDecision:
    """The group's decision from the choices that built on every rank (built now
    where some ranks had not): none, one, or those to benchmark."""
    choices = reports[0].choices
    if not all(rep.built for rep in reports):
        # Some ranks held a stored decision and built nothing yet.
        runnable = [n for n in choices if n not in failed]
        for name, why in _built(
            session, f"{topic}/build", work.build, runnable
        ).items():
            failed.setdefault(name, why)
    for name, why in failed.items():
        log.warning("choice %s is dropped on every rank of the group: %s", name, why)
    runnable = [n for n in choices if n not in failed]
    note = "".join(f"; dropped {name} ({why})" for name, why in sorted(failed.items()))
    if not runnable:
        return SiteDecision(
            Action.USE,
            (work.default,),
            f"no choice builds on every rank{note}",
            Source.AGREEMENT,
        )
    if len(runnable) == 1:
        return SiteDecision(
            Action.USE,
            tuple(runnable),
            f"the only choice built on every rank{note}",
            Source.AGREEMENT,
        )
    if not work.timing_allowed:
        chosen = work.default if work.default in runnable else runnable[0]
        return SiteDecision(
            Action.USE,
            (chosen,),
            f"config.deterministic: untimed{note}",
            Source.AGREEMENT,
        )
    return SiteDecision(
        Action.BENCHMARK,
        tuple(runnable),
        f"benchmarked on every rank{note}",
        Source.BENCHMARK,
    )


def _verify_stored(
    session: GroupSession,
    topic: str,
    winner: str,
    work: KeyWork,
    also: Sequence[str] = (),
) -> str:
    """Screen the stored ``winner`` against the op's own implementation on every rank,
    also building ``also``: "" if all built and it passed, else why not."""
    labels = list(dict.fromkeys([work.default, winner, *also]))
    failed = _built(session, f"{topic}/verify", work.build, labels)
    if failed:
        return "; ".join(f"{name}: {why}" for name, why in sorted(failed.items()))
    return work.verify(winner, session)


def _built(
    session: GroupSession, topic: str, build: Build, labels: Sequence[str]
) -> dict[str, str]:
    """Build ``labels`` on this rank and vote: why each failed, on which ranks."""
    with session.session.working(f"compiling the choices of {topic}"):
        failures = build(labels)
    votes = session.session.vote(topic, failures)
    if not all(_reasons(vote) for vote in votes):
        raise MalformedMessageError(
            f"a vote on {topic} is malformed: {str(votes)[:200]!r}"
        )
    return _failures(votes)


def _failures(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """Each failed choice with the ranks it failed on and why, one clause per reason:
    ``group ranks [0, 1]: why``, the same words on every rank."""
    failed: dict[str, dict[str, list[int]]] = {}
    for r, reasons in enumerate(per_rank):
        for name, why in sorted(reasons.items()):
            failed.setdefault(name, {}).setdefault(why, []).append(r)
    return {
        name: "; ".join(
            f"group rank {ranks[0]}: {why}"
            if len(ranks) == 1
            else f"group ranks {ranks}: {why}"
            for why, ranks in by_reason.items()
        )
        for name, by_reason in failed.items()
    }


def settle_key(
    session: GroupSession, key: str, choice: GroupChoice, site: SettledSite
) -> GroupChoice:
    """Publish ``choice`` for ``key`` and return the stored decision: the first one
    published for a key is the group's. The graph's cache entry records it with the
    ``site`` it was made for."""
    stored = session.settled.get(key)
    if stored is None:
        # A decision never changes: what this process knows is what the Store holds.
        known = session.decisions.known(key)
        stored = GroupChoice.decode(
            known
            if known is not None
            else session.decisions.publish(key, choice.encode())
        )
        if stored.winner != choice.winner:
            log.info(
                "key %s: the group had decided %s already; using it instead of %s",
                key,
                stored.winner,
                choice.winner,
            )
        session.settled[key] = stored
    session.inlined[key] = InlinedDecision(
        session.group.group_name,
        session.plan,
        key,
        stored.winner,
        site.name,
        site.environment,
        site.code,
        stored.provisional,
        site=site.autotune_name,
    )
    return stored


@dataclasses.dataclass(frozen=True)
class SettledSite:
    """What a graph's cache entry keeps of the call site a decision was made for."""

    name: str  # the site's (a probe's: its range's) autotuning name
    autotune_name: str  # the call site's, for its size path
    environment: Environment
    # The code identity of each implementation the decision holds for.
    code: dict[str, str]


# -- the FX-graph cache gate ---------------------------------------------------------


def inlined_decisions(graph: Any) -> tuple[InlinedDecision, ...]:
    """The decisions that ``graph`` (a GraphLowering) inlines, for its compiled graph
    and cache entry, each with the size ranges the graph was guarded on."""
    state = recorded_graph_state(graph)
    if state is None or not state.sessions:
        return ()
    guarded = range_graphs.guarded_range(graph)
    decisions = []
    for session in state.sessions.values():
        for decision in session.inlined.values():
            path = dispatch.size_path_of(graph, decision.site)
            decisions.append(
                dataclasses.replace(
                    decision,
                    guarded_range=guarded,
                    qualified_op=path.op if path else "",
                    size_path=path.path.value if path else "",
                    winners=path.winners if path else (),
                )
            )
    return tuple(decisions)


def _unguarded_here(decisions: Sequence[InlinedDecision]) -> str | None:
    """Why a cached graph that inlines ``decisions`` is not right in this compile: it
    was compiled behind a range guard that nothing here would check."""
    guarded = next((d.guarded_range for d in decisions if d.guarded_range), "")
    unchecked = range_graphs.unchecked_guards() if guarded else None
    if unchecked is None:
        return None
    return f"it was compiled for {guarded} behind a guard, and {unchecked}"


def _sites_of(
    decisions: Sequence[InlinedDecision],
) -> dict[tuple[str, str], list[InlinedDecision]] | None:
    """``decisions`` by group and plan, or None where this process may take no cached
    decision (collective autotuning off, no process group, or retuning)."""
    from torch._inductor import config

    if not (config.collective_autotune and process_group_initialized()):
        return None
    if config.collective_autotune_retune:
        return None
    sites: dict[tuple[str, str], list[InlinedDecision]] = {}
    for decision in decisions:
        sites.setdefault((decision.group_name, decision.plan), []).append(decision)
    return sites


# True while an engine loads a compiled artifact it saved (loading_saved_artifact).
_loading_saved: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "loading_saved_collective_artifact", default=False
)


@contextlib.contextmanager
def loading_saved_artifact() -> Iterator[None]:
    """While an engine loads an artifact it saved (standalone_compile's
    CompiledArtifact.load): its graphs run the decisions they were saved with,
    provisional ones and those this job decided otherwise included, where environment
    and code are unchanged. Such a load compiles nothing to fall back on, and refusing
    its entry fails it (vLLM's standalone path); a provisional decision is timed again
    when the engine next compiles."""
    token = _loading_saved.set(True)
    try:
        yield
    finally:
        _loading_saved.reset(token)


def cached_graph_usable(decisions: Sequence[InlinedDecision]) -> bool:
    """Whether this rank alone can use a cached graph inlining ``decisions``: none
    provisional, all made in this environment for today's code. No network: the cache
    lookup asks it of every candidate entry and skips refused ones, as failed guards."""
    if not decisions:
        return True
    sites = _sites_of(decisions)
    if sites is None:
        return False
    unguarded = _unguarded_here(decisions)
    if unguarded is not None:
        log.info("a cached graph is passed over: %s", unguarded)
        return False
    saved = _loading_saved.get()
    for (group_name, _), inlined in sorted(sites.items()):
        group = _resolve(group_name)
        why_not = (
            f"it was compiled for group {group_name}, which this job does not have"
            if group is None
            else _why_not_loadable(
                group, inlined, {} if saved else _held_here(group, inlined), saved
            )
        )
        if why_not:
            log.info("a cached graph is passed over: %s", why_not)
            return False
    return True


def _held_here(
    group: ProcessGroup, inlined: list[InlinedDecision]
) -> dict[str, GroupChoice | None]:
    """The group's decisions for the keys of ``inlined`` that this process read or
    published in this attempt (no network)."""
    from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings

    decisions = group_decisions(group, BenchmarkSettings.from_config().timeout)
    known = {d.key: decisions.known(d.key) for d in inlined}
    return {k: None if v is None else GroupChoice.decode(v) for k, v in known.items()}


def group_takes_cached_graph(decisions: Sequence[InlinedDecision]) -> bool:
    """Whether every group whose decisions a cache hit inlines takes them: decided so
    already in this attempt, or every rank loaded this same graph, or it is part of an
    artifact the engine saved (loading_saved_artifact). False turns the hit
    into a miss; the session joined passes to the compile that follows. Called after
    the cache lookup, before a hit is used, so that the lookup does no network."""
    if not decisions:
        return True
    sites = _sites_of(decisions)
    if sites is None:
        return False
    unguarded = _unguarded_here(decisions)
    if unguarded is not None:
        log.info("a cached graph is compiled afresh: %s", unguarded)
        return False
    from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings

    dynamo_callbacks.install(compiling=True)
    settings = BenchmarkSettings.from_config()
    # An artifact the engine saved is each rank's own to load (cached_graph_usable
    # checked it): no vote, as for a model loaded whole (aot_compile).
    saved = _loading_saved.get()
    for (group_name, plan), inlined in sorted(sites.items()):
        if not saved and not _group_loads(group_name, plan, inlined, settings):
            return False
    for decision in decisions:
        _keep_cached(decision)
    for op, site, path, guarded, winners in sorted(
        {
            (d.qualified_op, d.site, d.size_path, d.guarded_range, d.winners)
            for d in decisions
            if d.size_path
        }
    ):
        keep_size_path(
            SizePathRecord(
                op, site, SizePath(path), "loaded from the cache", guarded, winners
            )
        )
    return True


def _group_loads(
    group_name: str,
    plan: str,
    inlined: list[InlinedDecision],
    settings: BenchmarkSettings,
) -> bool:
    """Whether the group of ``group_name`` takes the decisions ``inlined`` in a cached
    graph of ``plan``, as :func:`group_takes_cached_graph` says."""
    embedded = {d.key: GroupChoice(d.winner, d.provisional) for d in inlined}
    group = _resolve(group_name)
    if group is None:
        return False
    known = group_decisions(group, settings.timeout)
    current = {key: decided(known, key) for key in embedded}
    if all(v is not None for v in current.values()):
        if current != embedded:
            log.info(
                "a cached graph inlines %s, the group decided %s: compiling it",
                embedded,
                current,
            )
            return False
        return True
    if (
        group_name,
        plan,
    ) in _pending:  # this hit's graph was already decided to be compiled
        return False
    why_not = _why_not_loadable(group, inlined, current)
    if why_not:
        # This rank cannot use the hit; joining with nothing loaded tells its peers.
        log.info("a cached graph is not used: %s; compiling it", why_not)
    loaded = (
        "" if why_not else digest(sorted((k, v.encode()) for k, v in embedded.items()))
    )
    joined = _join(group, plan, settings, loaded=loaded)
    if joined.decision.kind != DecisionKind.LOAD:
        log.info("cached graph not loaded: %s", joined.decision.reason)
        if joined.votes:
            _pending[(group_name, plan)] = joined
        return False
    return all(
        GroupChoice.decode(joined.decisions.publish(k, v.encode())) == v
        for k, v in embedded.items()
    )


def _why_not_loadable(
    group: ProcessGroup,
    inlined: list[InlinedDecision],
    held: dict[str, GroupChoice | None],
    provisional_ok: bool = False,
) -> str:
    """Why this rank cannot load the cached decisions ``inlined``, or "": the group
    decided otherwise (``held``), one is provisional (unless ``provisional_ok``), or
    environment or code changed."""
    for d in inlined:
        holds = held.get(d.key)
        if holds is not None and holds != GroupChoice(d.winner, d.provisional):
            return f"it inlines {d.winner} for {d.op}, the group decided {holds.winner}"
        if d.provisional and holds is None and not provisional_ok:
            return (
                f"its decision for {d.op} was provisional in an earlier job (a "
                "fallback, or timed without confidence)"
            )
        if d.environment != current_environment(group, d.environment):
            return f"its decision for {d.op} was made in {d.environment}"
        changed = sorted(
            name
            for name, identity in d.code.items()
            if current_identity(name) != identity
        )
        if changed:
            return (
                f"the implementations {changed} of {d.op} changed since it was compiled"
            )
    return ""


def _keep_cached(decision: InlinedDecision) -> None:
    """Record a decision inlined in a graph loaded from the cache."""
    import torch.distributed as dist

    group = torch._C._distributed_c10d._resolve_process_group(decision.group_name)
    keep_record(
        CollectiveAutotuneRecord(
            decision.op,
            decision.group_name,
            tuple(dist.get_process_group_ranks(group)),
            decision.key,
            decision.plan,
            Action.USE,
            Source.CACHE,
            "inlined in a compiled graph loaded from the cache; the group agrees",
            (),
            decision.winner,
            provisional=decision.provisional,
        )
    )
