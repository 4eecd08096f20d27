"""Cross-rank agreement for collective custom-op autotuning, over the c10d Store.

Collective autotuning is agreed per *graph*: one session per compiled graph and
process group, which every rank of that group joins before it issues any device
collective. The Store is used because its operations have real deadlines and leave
NCCL/gloo untouched, so a late, absent or failed rank can never leave a half-issued
device collective behind.

A session is named by the graph's *plan*: a digest of the collective-tuned call sites
that the graph holds on the group (op, input sizes, strides and dtypes, arguments).
Ranks compiling the same graph compute the same plan; a plan's session is held once
per job, because it leaves every key it covered decided in the group (below), so a
later graph with the same plan needs no session. No rank counts anything, so a rank
that compiled something its peers did not can never shift the sessions that follow.

States of one session, as seen by one rank::

    JOIN       set  join/<rank> = what this rank brings; add arrived += 1
    DECIDE     the rank whose arrival completes the group proposes a decision computed
               from all joins; a rank whose arrival deadline passes proposes a fallback.
               compare_set on `decision` keeps the first proposal only, and every rank,
               including one arriving after the deadline, adopts the stored value.
    VOTE       after each step that may fail, every rank posts its outcome under
               vote/<topic>/<rank> and reads everybody's; so a failure anywhere is a
               failure everywhere.
    ABORT      a rank that finds the group's collectives untrustworthy (a device
               collective timed out, a peer vanished) posts `abort` before raising;
               every rank waiting in this session raises too, naming that reason.

A session's joins and decision stay in the Store for the job (a rank arriving later
must read them); the votes of a topic are deleted by the last rank that reads them.

What a session decides about each key (op, shapes, choices, timing mode) becomes the
group's decision for that key, kept under ``decided/<key>`` for the rest of the job:
the first value stored wins (compare_set) and every rank adopts the stored one, so
later graphs and recompiles reuse it without benchmarking, identically everywhere.

Deadlines (each is ``timeout`` seconds, ``collective_benchmark_timeout``):

    * JOIN/DECIDE: from this rank's arrival. A rank arriving later reads the decision
      and follows it at once, without a wait of its own.
    * VOTE: from the moment this rank posts its own outcome. A rank that cannot vote
      in time (blocked in a device collective, or dead) makes the session fail with
      a CollectiveAutotuneError on every rank that can still vote.
    * Waiting for a key that a session decided but has not published: ``timeout``,
      then the op's own implementation is proposed (compare_set) and the stored value
      adopted.
    * Device work of the benchmark (collective_benchmarking) is bounded by the same
      timeout, and ends in ABORT when it passes.

Keys live under ``collective_autotune/<group name>/`` of the default store.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from typing import Any, Callable, Optional, TYPE_CHECKING


if TYPE_CHECKING:
    from torch.distributed import Store


log = logging.getLogger(__name__)

_NAMESPACE = "collective_autotune"
# Polling interval bounds while waiting on store keys: short enough that a ready
# group proceeds within a fraction of a millisecond, long enough not to load the store.
_POLL_MIN_S = 0.0001
_POLL_MAX_S = 0.02


class CollectiveAutotuneError(RuntimeError):
    """The group can no longer agree or its collectives can no longer be trusted."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """A session's decision, identical on every rank.

    ``kind`` says what the group does (the caller defines the kinds); ``detail`` is
    JSON-serialisable data that goes with it.
    """

    kind: str
    reason: str
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def decode(raw: bytes) -> Decision:
        d = json.loads(raw)
        return Decision(d["kind"], d["reason"], d["detail"])


class Deadline:
    """A point in (monotonic) time that a wait must not pass."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end


def _group_store(store: Store, group_name: str, suffix: str) -> Store:
    import torch.distributed as dist

    return dist.PrefixStore(f"{_NAMESPACE}/{group_name}/{suffix}/", store)


class GroupDecisions:
    """The group's decision for each key, kept in the Store for the job."""

    def __init__(self, store: Store, group_name: str) -> None:
        self._store = _group_store(store, group_name, "decided")

    def get(self, key: str) -> Optional[str]:
        return self._store.get(key).decode() if self._store.check([key]) else None

    def publish(self, key: str, value: str) -> str:
        """Propose ``value`` for ``key``; the value stored first, which every rank uses."""
        return self._store.compare_set(key, "", value).decode()

    def wait(self, key: str, deadline: Deadline) -> Optional[str]:
        """The decision for ``key`` once published, or None if ``deadline`` passes."""
        return self.get(key) if _poll(self._store, [key], deadline) else None


class CollectiveSession:
    """The store side of one session: one graph's plan on one process group."""

    def __init__(
        self,
        store: Store,
        group_name: str,
        session_key: str,
        rank: int,
        world_size: int,
        timeout: float,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.key = session_key
        self._store = _group_store(store, group_name, f"session/{session_key}")
        self._topic_prefix = ""
        # Whether this rank joined before the decision was taken (it did not merely
        # read it): only such ranks take part in the session's votes.
        self.joined = False

    # -- JOIN / DECIDE ----------------------------------------------------------

    def agree(
        self,
        join: dict[str, Any],
        decide: Callable[[list[dict[str, Any]]], Decision],
        fallback: Callable[[str], Decision],
    ) -> Decision:
        """Post ``join`` and return the session's decision.

        ``decide`` maps every rank's join (in group rank order) to a decision; it runs
        on the rank whose arrival completes the group. ``fallback`` turns the reason
        why the group did not assemble into a decision; it runs on a rank whose
        deadline passed. Waits at most ``timeout`` seconds from now.
        """
        deadline = Deadline(self.timeout)
        late = self._read("decision")
        if late is not None:
            log.info(
                "rank %d arrived after session %s was decided; following it",
                self.rank, self.key,
            )
            return Decision.decode(late)
        self._store.set(self._join_key(self.rank), json.dumps(join, sort_keys=True))
        self.joined = True
        if self._store.add("arrived", 1) >= self.world_size:
            joins = [
                json.loads(raw)
                for raw in self._store.multi_get(
                    [self._join_key(r) for r in range(self.world_size)]
                )
            ]
            return self._settle(decide(joins))
        # Wait for the rank that completes the group to publish the decision.
        if _poll(self._store, ["decision"], deadline):
            return Decision.decode(self._store.get("decision"))
        absent = [
            r
            for r in range(self.world_size)
            if not self._store.check([self._join_key(r)])
        ]
        return self._settle(
            fallback(
                f"group ranks {absent} did not arrive within {self.timeout:g} s "
                "(collective_benchmark_timeout)"
            )
        )

    def _settle(self, proposal: Decision) -> Decision:
        # compare_set is the session's single linearization point: the first
        # proposal is stored, later ones get the stored value back.
        return Decision.decode(self._store.compare_set("decision", "", proposal.encode()))

    # -- VOTE -------------------------------------------------------------------

    def vote(self, topic: str, outcome: str) -> list[str]:
        """Post this rank's ``outcome`` for ``topic``; return every rank's outcome.

        Waits at most ``timeout`` seconds; raises CollectiveAutotuneError naming the
        ranks that did not vote and what the others reported. The last rank to read
        a topic's votes deletes them.
        """
        keys = self._vote_keys(topic)
        self._store.set(keys[self.rank], outcome)
        if not _poll(self._store, keys, Deadline(self.timeout), self.check_abort):
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise CollectiveAutotuneError(
                f"{topic}: group ranks {missing} did not report within "
                f"{self.timeout:g} s (collective_benchmark_timeout); they are blocked "
                f"in a device collective or gone. Reports received: "
                f"{self.peer_reports(topic)}"
            )
        outcomes = [raw.decode() for raw in self._store.multi_get(keys)]
        read = f"read/{self._topic_prefix}{topic}"
        if self._store.add(read, 1) >= self.world_size:
            for key in [*keys, read]:
                self._store.delete_key(key)
        return outcomes

    def scoped(self, prefix: str) -> CollectiveSession:
        """This session, with ``prefix`` before every vote topic: the votes of one key
        among the several that a graph's session agrees."""
        view = copy.copy(self)
        view._topic_prefix = f"{self._topic_prefix}{prefix}/"
        return view

    # -- ABORT ------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Tell every rank of the session to stop; the first reason posted is kept."""
        self._store.compare_set("abort", "", f"group rank {self.rank}: {reason}")

    def check_abort(self) -> None:
        """Raise CollectiveAutotuneError if some rank aborted the session."""
        reason = self._read("abort")
        if reason is not None:
            raise CollectiveAutotuneError(
                f"collective autotuning stopped on every rank of the group: "
                f"{reason.decode()}"
            )

    def peer_reports(self, topic: str) -> dict[int, str]:
        """The outcomes posted so far for ``topic``, by group rank (no waiting)."""
        reports = {}
        for r, key in enumerate(self._vote_keys(topic)):
            raw = self._read(key)
            if raw is not None:
                reports[r] = raw.decode()
        return reports

    # -- helpers ----------------------------------------------------------------

    @staticmethod
    def _join_key(rank: int) -> str:
        return f"join/{rank}"

    def _vote_keys(self, topic: str) -> list[str]:
        return [f"vote/{self._topic_prefix}{topic}/{r}" for r in range(self.world_size)]

    def _read(self, key: str) -> Optional[bytes]:
        return self._store.get(key) if self._store.check([key]) else None


# Seconds this process spent waiting for peers in the Store, for the records.
_waited_s = 0.0


def waited_seconds() -> float:
    """Seconds this process has waited for peers so far (arrivals, votes, decisions)."""
    return _waited_s


def _poll(
    store: Store,
    keys: list[str],
    deadline: Deadline,
    check_abort: Optional[Callable[[], None]] = None,
) -> bool:
    """True once all ``keys`` exist; False if ``deadline`` passes first."""
    global _waited_s
    began = time.monotonic()
    interval = _POLL_MIN_S
    try:
        while not store.check(keys):
            if check_abort is not None:
                check_abort()
            if deadline.expired():
                return False
            time.sleep(min(interval, deadline.remaining()))
            interval = min(interval * 1.5, _POLL_MAX_S)
        return True
    finally:
        _waited_s += time.monotonic() - began
