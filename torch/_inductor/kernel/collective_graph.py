"""Collective autotuning per graph: one session per graph and group, decisions kept.

Inductor lowers a collective-tuned op call by call. Agreeing with the group at each
call site would cost an arrival per site, and a group could give two sites of one key
different winners. Instead, at the first collective-tuned call site of a graph, each
rank takes the graph's *plan* (the collective-tuned call sites in its FX graph, per
process group) and joins one session per group (runtime/collective_protocol). From
then on every distinct *key* (op, shapes, choices, timing mode) is agreed at its first
call site by the ranks that joined, in lockstep (they lower the same graph in the same
order), with one vote; the result becomes the group's decision for the key, kept in
the Store for the job, which every later site, graph and recompile reuses. A key is
benchmarked only when nobody decided it yet and the ranks' stored decisions
(runtime/collective_decisions) are not identical.

The FX-graph and AOTAutograd caches stay on. A compiled graph that inlines collective
decisions carries them (``CompiledFxGraph.collective_decisions``, which the caches keep
with the graph), and a cache hit of such a graph is used only when every inlined decision is the group's: either the
group decided those keys already in this job, or every rank of the group loads the
identical graph, which the ranks find out by joining the graph's session with what
they loaded. Otherwise the hit is turned into a miss and every rank compiles the
graph, so a rank with warm caches never skips a session its cold peers wait in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from typing import Any, Callable, Optional, Sequence, TYPE_CHECKING

import torch
from torch._inductor.kernel.collective_detection import GROUP_ARGUMENTS, op_name
from torch._inductor.kernel.collective_records import digest, note_cached_sites
from torch._inductor.runtime.collective_decisions import (
    current_environment,
    group_scope,
    InlinedDecision,
)
from torch._inductor.runtime.collective_protocol import (
    CollectiveSession,
    Decision,
    GroupDecisions,
    liveness,
)


if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


log = logging.getLogger(__name__)

# Why a site takes the decision an earlier site of the same graph settled for its key.
SETTLED_IN_GRAPH = "decided at an earlier site of this graph"

# Ops registered for autotuning whose name or schema says they communicate.
_collective_ops: set[str] = set()


def note_registration(op: Any, collective: bool) -> None:
    """Remember an op registered with register_custom_op_autotuning, if collective."""
    if collective:
        _collective_ops.add(op_name(op))


# -- plans -------------------------------------------------------------------------


def _plan(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """The collective-tuned call sites of ``gm`` by group name, each as a descriptor.

    Sites are described by what every rank sees alike (op, input sizes, strides and
    dtypes, other arguments), never by node names or device indices.
    """
    sites: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if op_name(node.target) not in _collective_ops:
            continue
        group, descriptor = _site(node)
        sites.setdefault(group, []).append(descriptor)
    return {g: sorted(s) for g, s in sites.items()}


def _site(node: torch.fx.Node) -> tuple[str, str]:
    import torch.distributed as dist

    schema = node.target._schema  # type: ignore[union-attr]
    group = ""
    parts = [op_name(node.target)]
    for i, argument in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name, argument.default_value)
        if argument.name in GROUP_ARGUMENTS:
            group = _group_name(value)
            continue
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(meta, torch.Tensor):
            parts.append(f"{list(meta.shape)}/{list(meta.stride())}/{meta.dtype}")
        else:
            parts.append(repr(value))
    return group or dist.group.WORLD.group_name, "|".join(parts)


def _group_name(value: Any) -> str:
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return value.group_name
    return value if isinstance(value, str) else ""


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
    # Keys already settled in this graph: later sites of a key reuse them unvoted.
    settled: dict[str, str] = dataclasses.field(default_factory=dict)
    # What the graph inlines of each settled key, for its cache entry.
    inlined: dict[str, InlinedDecision] = dataclasses.field(default_factory=dict)

    @property
    def votes(self) -> bool:
        """Whether this rank agrees keys with its peers in lockstep."""
        return self.session.joined and self.decision.kind == "compile"


# Sessions joined by a cache hit that the group turned into a compile: the compile
# that follows takes them over, as a participant.
_pending: dict[tuple[str, str], GroupSession] = {}
# The sessions of each graph being lowered, by group name.
_graph_sessions: weakref.WeakKeyDictionary[Any, dict[str, GroupSession]] = weakref.WeakKeyDictionary()


def session_for(group: ProcessGroup, timeout: float) -> GroupSession:
    """The session of the graph being lowered on ``group`` (joined at first use).

    At its first collective-tuned call site a graph joins the sessions of all its
    groups that contain this rank, in one order that every rank shares, so that ranks
    of several groups cannot wait for each other in a cycle.
    """
    from torch._inductor.virtualized import V

    graph = V.graph
    sessions = _graph_sessions.get(graph)
    if sessions is None:
        sessions = {}
        plan = _plan(graph.module)
        for name in sorted(plan):
            member = _resolve(name)
            if member is not None:
                sessions[name] = _join(member, digest(plan[name], _timing_context()), timeout, loaded="")
        _graph_sessions[graph] = sessions
    if group.group_name not in sessions:
        # A site that the plan could not see (its op hides that it communicates, or
        # its choices run on another group): a session of its own.
        node = V.graph.current_node
        descriptor = _site(node)[1] if node is not None else ""
        sessions[group.group_name] = _join(
            group, digest([descriptor], _timing_context()), timeout, loaded=""
        )
    return sessions[group.group_name]


def joined_session(group: ProcessGroup) -> Optional[GroupSession]:
    """The session of the graph being lowered on ``group``, once joined (no waiting)."""
    from torch._inductor.virtualized import V

    return _graph_sessions.get(V.graph, {}).get(group.group_name)


def _timing_context() -> tuple[Any, ...]:
    """What changes keys without changing the graph: how the model will run."""
    from torch._inductor import config

    return (bool(config.triton.cudagraphs), config.collective_benchmark_mode)


def _join(group: ProcessGroup, plan: str, timeout: float, loaded: str, name: str = "") -> GroupSession:
    import torch.distributed as dist

    name = name or plan
    pending = _pending.pop((group.group_name, name), None)
    if pending is not None:
        return pending
    store = dist.distributed_c10d._get_default_store()
    session = CollectiveSession(
        store, group.group_name, name, dist.get_rank(group),
        dist.get_process_group_ranks(group), timeout,
    )
    decision = session.agree(
        {"loaded": loaded}, decide=_decide_graph, fallback=lambda why: Decision("fallback", why)
    )
    return GroupSession(group, plan, session, decision, group_decisions(group, timeout))


def group_decisions(group: ProcessGroup, timeout: float) -> GroupDecisions:
    """The decisions ``group`` keeps in the Store for the job, under its environment."""
    import torch.distributed as dist

    return GroupDecisions(
        dist.distributed_c10d._get_default_store(), group.group_name,
        dist.get_process_group_ranks(group), group_scope(group), timeout,
    )


def _decide_graph(joins: list[dict[str, Any]]) -> Decision:
    """Load the cached graph only if every rank loaded the identical one."""
    loaded = [j["loaded"] for j in joins]
    if loaded[0] and all(x == loaded[0] for x in loaded):
        return Decision("load", "every rank loaded the same compiled graph from its cache")
    hits = [r for r, x in enumerate(loaded) if x]
    if not hits:
        return Decision("compile", "every rank compiles the graph")
    return Decision(
        "compile",
        f"group ranks {hits} hit their caches but not with one graph on every rank; "
        "every rank compiles it",
    )


def _resolve(group_name: str) -> Optional[ProcessGroup]:
    """The group named ``group_name`` if this rank belongs to it."""
    import torch.distributed as dist

    try:
        group = torch._C._distributed_c10d._resolve_process_group(group_name)
    except Exception:  # noqa: BLE001 - a group of another job or another rank set
        return None
    return group if dist.get_rank(group) >= 0 else None


# -- agreeing one key ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """What one rank knows of a key before anything is built."""

    key: str
    choices: tuple[str, ...]
    # The group's decision for the key, if one was published.
    decided: str
    # This rank's stored decision: its digest and winner, or empty.
    stored: str
    stored_winner: str
    # Choices whose implementation raised while traced here, with the reason.
    failed: dict[str, str]


@dataclasses.dataclass(frozen=True)
class SiteDecision:
    """How the group settles one key: ``use`` a choice, or ``benchmark`` some."""

    kind: str
    choices: tuple[str, ...]
    reason: str
    # Where the decision comes from: "benchmark", "job", "disk", "agreement".
    source: str


def agree_key(
    session: GroupSession,
    key: str,
    report: Callable[[], SiteReport],
    default: str,
    build: Callable[[], dict[str, str]],
    timing_allowed: bool,
) -> tuple[SiteDecision, GroupSession]:
    """The group's decision for ``key``, identical on every rank; and the session
    whose votes a benchmark of the key must use.

    ``report`` gives what this rank knows of the key; it is asked for only where the
    ranks vote. ``build`` compiles this rank's choices and returns why each one that
    did not build failed; it runs only when nothing decided the key without timing it.
    """
    settled = session.settled.get(key)
    if settled is not None:
        return SiteDecision("use", (settled,), SETTLED_IN_GRAPH, "job"), session
    if not session.votes:
        followed = _follow(session, key, default)
        if followed is not None:
            return followed, session
        # This plan's session was held by an earlier compile, which did not meet this
        # key (another timing mode, or a backward graph whose sites look like the
        # forward's, say): the key gets a session of its own. What it settles is
        # settled in this graph, for the key's later sites to reuse untraced.
        session = dataclasses.replace(
            _join(session.group, session.plan, session.session.timeout, loaded="",
                  name=digest(key, "key")),
            plan=session.plan,
            settled=session.settled,
            inlined=session.inlined,
        )
        if not session.votes:
            # Its peers decided it in that session without this rank: they publish it.
            followed = _follow(session, key, default) or _published(session, key, default)
            return followed, session
    return _vote_key(session, report(), default, build, timing_allowed), session


def _follow(session: GroupSession, key: str, default: str) -> Optional[SiteDecision]:
    """The decision of a rank that does not vote in ``session``; None where the session
    was held by an earlier compile of its plan, which did not decide ``key``."""
    stored = session.decisions.get(key)
    if session.decision.kind == "fallback":
        # The group did not assemble: the op's own implementation, unless the key
        # was decided before.
        return SiteDecision("use", (stored or default,), session.decision.reason, "agreement")
    if stored is not None:
        return SiteDecision("use", (stored,), "decided earlier in this job", "job")
    if session.decision.kind == "load":
        # The ranks that loaded the graph publish its decisions right away.
        return _published(session, key, default)
    return None


def _published(session: GroupSession, key: str, default: str) -> SiteDecision:
    """The decision its peers publish for ``key``, or, past the deadline, the op's own
    implementation (proposed like any decision, so every rank ends with the same)."""
    stored = session.decisions.wait(key)
    if stored is not None:
        return SiteDecision("use", (stored,), "decided by the group", "job")
    return SiteDecision("use", (default,), "the group did not publish a decision in time", "agreement")


def _vote_key(
    session: GroupSession,
    report: SiteReport,
    default: str,
    build: Callable[[], dict[str, str]],
    timing_allowed: bool,
) -> SiteDecision:
    topic = f"site/{report.key}"
    reports = [_decode_report(r) for r in session.session.vote(topic, _encode(report))]
    decided = next((r.decided for r in reports if r.decided), "")
    if decided:
        return SiteDecision("use", (decided,), "decided earlier in this job", "job")
    differing = [
        r for r, rep in enumerate(reports)
        if (rep.key, rep.choices) != (reports[0].key, reports[0].choices)
    ]
    if differing:
        common = [n for n in reports[0].choices if all(n in rep.choices for rep in reports)]
        chosen = default if default in common else (common or [default])[0]
        return SiteDecision(
            "use", (chosen,),
            f"group ranks {differing} tune a different op, shape or choice list than "
            f"group rank 0; all use {chosen}",
            "agreement",
        )
    failed = _failures([rep.failed for rep in reports])
    stored = {rep.stored for rep in reports}
    winner = reports[0].stored_winner
    if len(stored) == 1 and "" not in stored and winner not in failed:
        return SiteDecision("use", (winner,), "every rank holds the same stored decision", "disk")
    with liveness.working(f"compiling the choices of {topic}"):
        built = build()
    outcomes = session.session.vote(f"{topic}/build", json.dumps(built, sort_keys=True))
    for name, why in _failures([json.loads(outcome) for outcome in outcomes]).items():
        failed.setdefault(name, why)
    for name, why in failed.items():
        log.warning("choice %s is dropped on every rank of the group: %s", name, why)
    runnable = [n for n in reports[0].choices if n not in failed]
    note = "".join(f"; dropped {name} ({why})" for name, why in sorted(failed.items()))
    if not runnable:
        return SiteDecision("use", (default,), f"no choice builds on every rank{note}", "agreement")
    if len(runnable) == 1:
        return SiteDecision("use", tuple(runnable), f"the only choice built on every rank{note}", "agreement")
    if not timing_allowed:
        chosen = default if default in runnable else runnable[0]
        return SiteDecision("use", (chosen,), f"config.deterministic: untimed{note}", "agreement")
    return SiteDecision("benchmark", tuple(runnable), f"benchmarked on every rank{note}", "benchmark")


def _failures(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """Each failed choice with the ranks it failed on and why, one clause per reason:
    ``group ranks [0, 1]: why``, the same words on every rank."""
    failed: dict[str, dict[str, list[int]]] = {}
    for r, reasons in enumerate(per_rank):
        for name, why in sorted(reasons.items()):
            failed.setdefault(name, {}).setdefault(why, []).append(r)
    return {
        name: "; ".join(
            f"group rank {ranks[0]}: {why}" if len(ranks) == 1 else f"group ranks {ranks}: {why}"
            for why, ranks in by_reason.items()
        )
        for name, by_reason in failed.items()
    }


def settle_key(
    session: GroupSession, key: str, winner: str, op: str, environment: dict[str, Any]
) -> str:
    """Publish ``winner`` as the group's decision for ``key``; the stored decision.

    The first decision stored for a key is the group's: a rank whose proposal lost
    (another session of the group decided the key first) takes the stored one, as
    every other rank does. ``environment`` (runtime/collective_decisions) is the one
    the decision holds in; the graph's cache entry records it.
    """
    stored = session.settled.get(key)
    if stored is None:
        stored = session.decisions.publish(key, winner)
        if stored != winner:
            log.info("key %s: the group had decided %s already; using it instead of %s", key, stored, winner)
        session.settled[key] = stored
    session.inlined[key] = InlinedDecision(
        session.group.group_name, session.plan, key, stored, op, environment
    )
    return stored


def _encode(report: SiteReport) -> str:
    return json.dumps(dataclasses.asdict(report), sort_keys=True)


def _decode_report(raw: str) -> SiteReport:
    d = json.loads(raw)
    return SiteReport(d["key"], tuple(d["choices"]), d["decided"], d["stored"], d["stored_winner"], d["failed"])


# -- the FX-graph cache gate ---------------------------------------------------------


def inlined_decisions(graph: Any) -> tuple[InlinedDecision, ...]:
    """The decisions that ``graph`` (a GraphLowering) inlines, for its compiled graph
    and cache entry."""
    return tuple(
        decision
        for session in _graph_sessions.get(graph, {}).values()
        for decision in session.inlined.values()
    )


def cached_graph_may_load(decisions: Sequence[InlinedDecision]) -> bool:
    """Whether a cached graph that inlines ``decisions`` may be used.

    True for graphs without collective decisions. Otherwise every inlined decision
    must be the group's: already decided so in this job, or made for the group's
    current environment (size, backend, device model, interconnect, NVLS, torch and
    NCCL versions) and loaded identically by every rank of the group (one session
    per group). A hit that fails this is a miss, and the session it joined passes on
    to the compile that follows. ``FxGraphCache.cache_hit_post_compile`` asks this of
    every hit (also those of AOTAutograd entries).
    """
    from torch._inductor import config

    if not decisions:
        return True
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or config.collective_autotune_retune:
        return False
    timeout = config.collective_benchmark_timeout
    sites: dict[tuple[str, str], list[InlinedDecision]] = {}
    for decision in decisions:
        sites.setdefault((decision.group_name, decision.plan), []).append(decision)
    for (group_name, plan), inlined in sorted(sites.items()):
        embedded = {d.key: d.winner for d in inlined}
        group = _resolve(group_name)
        if group is None:
            return False
        decisions_of_group = group_decisions(group, timeout)
        current = {key: decisions_of_group.get(key) for key in embedded}
        if all(v is not None for v in current.values()):
            if current != embedded:
                log.info("a cached graph inlines %s, the group decided %s: compiling it", embedded, current)
                return False
            continue
        pending = _pending.get((group_name, plan))
        if pending is not None:  # this hit's graph was already decided to be compiled
            return False
        foreign = [d.environment for d in inlined if d.environment != current_environment(group, d.environment)]
        if foreign:
            # This rank cannot use the hit; joining with nothing loaded tells its peers.
            log.info("a cached graph inlines decisions made in %s: compiling it", foreign[0])
        loaded = "" if foreign else digest(sorted(embedded.items()))
        joined = _join(group, plan, timeout, loaded=loaded)
        if joined.decision.kind != "load":
            log.info("cached graph not loaded: %s", joined.decision.reason)
            if joined.votes:
                _pending[(group_name, plan)] = joined
            return False
        if any(joined.decisions.publish(k, v) != v for k, v in embedded.items()):
            return False
    note_cached_sites([(d.group_name, d.plan, d.key, d.winner, d.op) for _, ds in sorted(sites.items()) for d in ds])
    return True
