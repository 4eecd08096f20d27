"""Inductor's side of collective autotuning sessions over the c10d Store.

The generic protocol lives in ``torch.distributed._store_session``. Every rank of a
group joins one session per compiled graph, named by the graph's *plan* (a digest of
its collective-tuned call sites), before it issues any device collective."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

from torch.distributed import _store_session
from torch.distributed._store_session import (
    attempt_namespace as _attempt_namespace,
    describe,
    GroupDecisions,
    Liveness,
    member_groups as _member_groups,
    Participant,
    StoreSession,
    StoreSessionError,
    Vocabulary,
    WireMessage,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


# What Inductor's collective package takes of the Store protocol, through this module
# alone (the layering test holds it to that).
__all__ = [
    "CollectiveAutotuneError",
    "CollectiveSession",
    "Decision",
    "DecisionKind",
    "describe",
    "group_decisions",
    "GroupDecisions",
    "Join",
    "MalformedMessageError",
    "participant",
    "process_group_initialized",
    "StoreLostError",
    "WireMessage",
]


NAMESPACE = "collective_autotune"


class CollectiveAutotuneError(StoreSessionError):
    """The group can no longer agree, or its collectives can no longer be trusted."""


class StoreLostError(CollectiveAutotuneError, _store_session.StoreLostError):
    """The c10d Store stopped answering; it is not tried again in this process."""


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
    """Every rank compiles, loads its identical cached graph, uses the op's own
    implementation (the group did not assemble in time), or stops (settings differ)."""

    COMPILE = "compile"
    LOAD = "load"
    FALLBACK = "fallback"
    MISMATCH = "mismatch"


@dataclasses.dataclass(frozen=True)
class Decision(WireMessage):
    malformed_error = MalformedMessageError

    kind: DecisionKind
    reason: str


@dataclasses.dataclass(frozen=True)
class Join(WireMessage):
    malformed_error = MalformedMessageError

    # Digest of the compiled graph loaded from the cache; "" for none.
    loaded: str
    settings: dict[str, Any]


class StoreClient(_store_session.StoreClient):
    vocabulary = VOCABULARY


class CollectiveSession(StoreSession):
    # This rank votes on keys: it joined before the decision, and the group compiles.
    votes = False

    def agree(  # type: ignore[override]
        self,
        join: Join,
        decide: Callable[[list[Join]], Decision],
        fallback: Callable[[str], Decision],
    ) -> Decision:
        """Post ``join`` and return the decision; a rank that joined before reads it."""
        decision = Decision.from_wire(
            super().agree(
                join.to_wire(),
                lambda joins: decide(list(map(Join.from_wire, joins))).to_wire(),
                lambda why: fallback(why).to_wire(),
            )
        )
        self.votes = self.took_part and decision.kind == DecisionKind.COMPILE
        return decision

    def working(
        self, doing: str, beat: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """While in the block this rank is heard ``doing`` (beating, unless the work
        bounds its own waits): its peers wait for it rather than give up on it."""
        return self.participant.liveness.working(doing, beat=beat)


def process_group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def attempt_namespace() -> str:
    return _attempt_namespace(NAMESPACE)


def connect(timeout: float) -> StoreClient:
    client = _store_session.connect(timeout, StoreClient)
    assert isinstance(client, StoreClient)
    return client


_participant: Participant | None = None


def participant(timeout: float) -> Participant:
    """This process's Participant; never waits (the client connects on its thread)."""
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


def group_decisions(group: ProcessGroup, scope: str, timeout: float) -> GroupDecisions:
    """The decisions ``group`` keeps in the Store for the attempt, in ``scope`` (a
    digest of what they depend on)."""
    import torch.distributed as dist

    return GroupDecisions(
        participant(timeout),
        group.group_name,
        dist.get_process_group_ranks(group),
        scope,
        timeout,
    )
