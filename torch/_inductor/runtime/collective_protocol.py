"""Collective autotuning's sessions: what Inductor agrees over the c10d Store.

The protocol itself (JOIN/DECIDE, VOTE, PUBLISH, ABORT, heartbeats, deadlines, the
Store client and a lost Store) is generic and lives beside c10d, in
``torch.distributed._store_session``. This module gives it Inductor's words: what a
session decides (``Decision``), the errors Inductor raises and catches
(``CollectiveAutotuneError``, ``StoreLostError``), the knob that bounds every wait
(``collective_benchmark_timeout``), and the process's one ``Participant``.

Collective autotuning is agreed per *graph*: one session per compiled graph and
process group, which every rank of that group joins before it issues any device
collective. A session is named by the graph's *plan*: a digest of the collective-tuned
call sites that the graph holds on the group (op, input sizes, strides and dtypes,
arguments). Ranks compiling the same graph compute the same plan; a plan's session is
held once per job, because it leaves every key it covered decided in the group, so a
later graph with the same plan needs no session. No rank counts anything, so a rank
that compiled something its peers did not can never shift the sessions that follow.

A rank joins with what it brings (the digest of a cached graph it loaded, and its
collective autotuning settings); the session decides ``compile``, ``load``,
``fallback`` (the group did not assemble within the timeout) or ``mismatch`` (the
ranks' settings differ). Where the group compiles, the ranks that joined agree each
key of the graph in the session's votes (kernel/collective/graph_sessions.py), and
publish the group's decision for it. Device work of the benchmark
(collective_benchmarking) is bounded by its own budget and by the timeout from its
start, whatever the heartbeats say; a rank that finds the group's collectives
untrustworthy (a device collective timed out, a choice raised inside one) aborts the
session.

Every key lives under ``collective_autotune/<attempt>/<group name>/``. The protocol's
Store client is a connection of its own, opened (off the compiling thread) at the
process's first compile that may need it; ``collective_benchmark_timeout`` bounds every
wait on the Store in total, and a Store that does not answer within it is lost for
the whole process (StoreLostError on every request, at once, and the Store is never
tried again, in a later compile or at exit).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from torch.distributed import _store_session
from torch.distributed._store_session import (
    attempt_namespace as _attempt_namespace,
    Liveness,
    member_groups as _member_groups,
    Participant,
    StoreSession,
    StoreSessionError,
    Vocabulary,
    WireMessage,
)


NAMESPACE = "collective_autotune"


class CollectiveAutotuneError(StoreSessionError):
    """The group can no longer agree or its collectives can no longer be trusted.

    A StoreSessionError (a torch.distributed.DistError): the protocol raises it for a
    silent or aborted group, and Inductor for a benchmark the group cannot trust.
    """


class StoreLostError(CollectiveAutotuneError, _store_session.StoreLostError):
    """The c10d Store stopped answering: no rank can agree with its peers any more."""


class MalformedMessageError(
    CollectiveAutotuneError, _store_session.MalformedMessageError
):
    """A message of the group's is not one this code writes."""


VOCABULARY = Vocabulary(
    user="collective autotuning",
    threads="collective-autotune",
    timeout_name="collective_benchmark_timeout",
    session_error=CollectiveAutotuneError,
    lost_error=StoreLostError,
)


class DecisionKind(str, enum.Enum):
    """What a session decides for its graph."""

    # Every rank compiles the graph and agrees its keys in the session's votes.
    COMPILE = "compile"
    # Every rank loaded the identical compiled graph from its cache: use it.
    LOAD = "load"
    # The group did not assemble in time: every rank uses the op's own implementation.
    FALLBACK = "fallback"
    # The ranks were configured differently: every rank stops with the reason.
    MISMATCH = "mismatch"


@dataclasses.dataclass(frozen=True)
class Decision(WireMessage):
    """A session's decision, identical on every rank."""

    malformed_error = MalformedMessageError

    kind: DecisionKind
    reason: str


@dataclasses.dataclass(frozen=True)
class Join(WireMessage):
    """What a rank brings to a session: the digest of the compiled graph it loaded from
    its cache ("": it loaded none) and its collective autotuning settings."""

    malformed_error = MalformedMessageError

    loaded: str
    settings: dict[str, Any]


class StoreClient(_store_session.StoreClient):
    """The Store client of collective autotuning: its errors are Inductor's."""

    vocabulary = VOCABULARY


class CollectiveSession(StoreSession):
    """The Store side of one session: one graph's plan on one process group."""

    # Whether this rank agrees keys in this session's votes: it joined before the
    # decision was taken (it did not merely read it), and the group compiles.
    votes = False

    def agree(  # type: ignore[override]
        self,
        join: Join,
        decide: Callable[[list[Join]], Decision],
        fallback: Callable[[str], Decision],
    ) -> Decision:
        """Post ``join`` and return the session's decision (StoreSession.agree).

        A rank that joined this session for an earlier graph of the same plan reads
        its decision and does not vote.
        """
        decision = Decision.from_wire(
            super().agree(
                join.to_wire(),
                lambda joins: decide(list(map(Join.from_wire, joins))).to_wire(),
                lambda why: fallback(why).to_wire(),
            )
        )
        # A fallback or a load needs no votes; a compile was decided with this rank in.
        self.votes = self.took_part and decision.kind == DecisionKind.COMPILE
        return decision


def process_group_initialized() -> bool:
    """Whether torch.distributed is built in and its default process group is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def attempt_namespace() -> str:
    """The Store namespace of this job attempt (see _store_session)."""
    return _attempt_namespace(NAMESPACE)


def connect(timeout: float) -> StoreClient:
    """A client of this job's default Store with ``timeout`` as its deadline."""
    client = _store_session.connect(timeout, StoreClient)
    assert isinstance(client, StoreClient)
    return client


_participant: Participant | None = None


def participant(timeout: float) -> Participant:
    """This process's Participant, with a client of the job's Store made at first use
    (and again for a new default process group), its client's deadline ``timeout``.
    Never waits: the client connects on its own thread, at its first request."""
    import torch.distributed as dist

    global _participant
    store = dist.distributed_c10d._get_default_store()
    namespace = attempt_namespace()
    current = _participant
    if current is None or current.store is not store or current.namespace != namespace:
        # A new attempt on the same Store keeps the connection, and a loss it saw.
        same = current is not None and current.store is store
        client = current.client if current is not None and same else connect(timeout)
        rank = dist.get_rank()
        liveness = Liveness(client, namespace, rank, _member_groups)
        current = _participant = Participant(client, liveness, rank, namespace, store)
    current.client.timeout = timeout
    return current
