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
group's decision for that key, kept under ``decided/<scope>/<key>`` for the rest of
the job, where ``scope`` digests the group's environment (size, backend, torch
version): a group of another environment never reads it. The first value stored
wins (compare_set) and every rank adopts the stored one, so later graphs and
recompiles reuse it without benchmarking, identically everywhere.

Deadlines bound *silence*, not work. A rank that works on something its peers may
wait for beats (Liveness): while Dynamo compiles a graph (which covers tracing and
lowering the choices), while it compiles a key's choices, while it benchmarks. Its
heartbeat ``alive/<global rank>`` says what it is doing. A rank waiting in the Store
is silent. Each wait below ends ``timeout`` seconds (``collective_benchmark_timeout``)
after the last progress it saw, a new heartbeat of a rank of its group (Silence),
and checks it at least every ``_BEAT_S``; so a dead rank, or one silent for the
timeout, ends every wait on it within ``timeout + _BEAT_S`` (plus a poll), and the
message names it and what it was last heard doing:

    * JOIN/DECIDE: progress = a heartbeat of the group. Past the deadline the waiter
      proposes a fallback; a rank arriving later reads the decision and follows it
      at once, without a wait of its own.
    * VOTE: progress = a heartbeat of the group. Past the deadline the session fails
      with a CollectiveAutotuneError on every rank that can still vote; an ABORT
      posted meanwhile ends the wait at once.
    * Waiting for a key that a session decided but has not published: progress = a
      heartbeat of the group; past the deadline the op's own implementation is
      proposed (compare_set) and the stored value adopted.
    * Device work of the benchmark (collective_benchmarking) is bounded by
      ``timeout`` from its start, whatever the heartbeats say (a rank blocked in a
      device collective beats on), and ends in ABORT when it passes.

A live rank that keeps compiling is waited for as long as it does: the timeout turns
a dead or stuck peer into a clear error, it does not cap a peer's compile time.

Keys live under ``collective_autotune/<group name>/`` of the default store, the
heartbeats under ``collective_autotune/alive/``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence, TYPE_CHECKING


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


# -- liveness ---------------------------------------------------------------------------

# How often a working rank beats, and how often a waiter looks at its peers' beats:
# small against any sensible timeout, rare enough not to load the store.
_BEAT_S = 0.25


class Liveness:
    """This process's heartbeat in the Store, so that its peers wait for it as long as
    it works and no longer.

    While the process does something its peers may wait for (compiling a graph, the
    choices of a key, benchmarking), a daemon thread bumps
    ``collective_autotune/alive/<global rank>`` every ``_BEAT_S`` with what it is
    doing. While it waits for its peers itself it is silent: a wait is no progress,
    so two ranks that wait for each other (in different sessions) cannot keep each
    other waiting forever. A dead process stops beating at once.

    The thread has a Store client of its own (``Store.clone``): a blocking call of the
    main thread on the shared client would otherwise hold up the beats.
    """

    def __init__(self) -> None:
        self._doing: list[str] = []
        self._waiting = 0
        self._thread: Optional[threading.Thread] = None

    @contextlib.contextmanager
    def working(self, doing: str) -> Iterator[None]:
        """Beat, saying ``doing``, while the block runs (nested: the innermost says)."""
        self._start()
        self._doing.append(doing)
        try:
            yield
        finally:
            self._doing.pop()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """No beats while the block waits for peers."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def _start(self) -> None:
        if self._thread is not None:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        default = dist.distributed_c10d._get_default_store()
        # (a Store without clone is shared: its clients serialise their operations)
        store = default.clone() if hasattr(default, "clone") else default
        key = _alive_key(dist.get_rank())
        self._thread = threading.Thread(
            target=self._beat, args=(store, key), name="collective-autotune-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self, store: Store, key: str) -> None:
        beats = 0
        while True:
            # Read once: the main thread changes these between the two reads.
            doing, waiting = self._doing[-1:], self._waiting
            if doing and not waiting:
                beats += 1
                try:
                    store.set(key, json.dumps({"beat": beats, "doing": doing[0]}))
                except Exception:  # noqa: BLE001 - the store is gone with its group
                    self._thread = None  # a later process group gets a new thread
                    return
            time.sleep(_BEAT_S)


liveness = Liveness()


def _alive_key(global_rank: int) -> str:
    return f"{_NAMESPACE}/alive/{global_rank}"


class Silence(Deadline):
    """A deadline ``seconds`` after the last progress of the ranks waited for.

    Progress is a new heartbeat of any of ``members`` (the group's global ranks, in
    group rank order; the waiter itself is silent while it waits); so a peer that
    works (compiles, benchmarks) keeps the wait alive, and one that is dead, or
    silent for ``seconds``, ends it.
    """

    def __init__(self, seconds: float, store: Store, members: Sequence[int]) -> None:
        super().__init__(seconds)
        self._store = store
        # The global rank of each group rank.
        self._members = list(members)
        # The first look, a beat later: most waits end before it and cost no reads.
        self._next_look = time.monotonic() + _BEAT_S
        # The beats seen at the first look, then the latest: a beat that differs (a
        # first one included) is progress.
        self._last: Optional[dict[int, dict[str, Any]]] = None
        self._seen_at: dict[int, float] = {}

    def remaining(self) -> float:
        self._look()
        return super().remaining()

    def expired(self) -> bool:
        self._look()
        return super().expired()

    def _look(self) -> None:
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + _BEAT_S
        beats = _heartbeats(self._store, self._members)
        if self._last is None:
            self._last, self._seen_at = beats, dict.fromkeys(beats, now)
            return
        for rank, beat in beats.items():
            if beat != self._last.get(rank):
                self._end = max(self._end, now + self.seconds)
                self._last[rank], self._seen_at[rank] = beat, now

    def last_heard(self, group_ranks: Sequence[int]) -> str:
        """Where each of ``group_ranks`` was when last heard of, for an error message."""
        now = time.monotonic()
        parts = []
        for r in group_ranks:
            beat = (self._last or {}).get(self._members[r])
            if beat is None:
                parts.append(f"group rank {r} never reported progress")
            else:
                parts.append(
                    f"group rank {r} was last heard {now - self._seen_at[self._members[r]]:.1f} s "
                    f"ago (or earlier), {beat['doing']}"
                )
        return "; ".join(parts)


def _heartbeats(store: Store, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    keys = {r: _alive_key(r) for r in ranks}
    present = [r for r, k in keys.items() if store.check([k])]
    raw = store.multi_get([keys[r] for r in present]) if present else []
    return {r: json.loads(v) for r, v in zip(present, raw)}


def _group_store(store: Store, group_name: str, suffix: str) -> Store:
    import torch.distributed as dist

    return dist.PrefixStore(f"{_NAMESPACE}/{group_name}/{suffix}/", store)


class GroupDecisions:
    """The group's decision for each key, kept in the Store for the job.

    Kept under the group's ``scope`` (a digest of its environment: size, backend,
    versions), so that no group of another environment ever reads them.
    """

    def __init__(
        self, store: Store, group_name: str, members: Sequence[int], scope: str, timeout: float
    ) -> None:
        self._store = _group_store(store, group_name, f"decided/{scope}")
        self._root = store
        self._members = list(members)
        self._timeout = timeout

    def get(self, key: str) -> Optional[str]:
        return self._store.get(key).decode() if self._store.check([key]) else None

    def publish(self, key: str, value: str) -> str:
        """Propose ``value`` for ``key``; the value stored first, which every rank uses."""
        return self._store.compare_set(key, "", value).decode()

    def wait(self, key: str) -> Optional[str]:
        """The decision for ``key`` once published, or None if the group was silent
        for ``timeout`` before (any of its ranks may be the one that publishes)."""
        silence = Silence(self._timeout, self._root, self._members)
        return self.get(key) if _poll(self._store, [key], silence) else None


class CollectiveSession:
    """The store side of one session: one graph's plan on one process group."""

    def __init__(
        self,
        store: Store,
        group_name: str,
        session_key: str,
        rank: int,
        members: Sequence[int],
        timeout: float,
    ) -> None:
        self.rank = rank
        # The global rank of each group rank, whose heartbeats the waits watch.
        self.members = list(members)
        self.world_size = len(self.members)
        self.timeout = timeout
        self.key = session_key
        self._root = store
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
        deadline passed. Waits until the ranks not yet here were silent for
        ``timeout`` seconds.
        """
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
        silence = self._silence()
        if _poll(self._store, ["decision"], silence):
            return Decision.decode(self._store.get("decision"))
        absent = [
            r
            for r in range(self.world_size)
            if not self._store.check([self._join_key(r)])
        ]
        return self._settle(
            fallback(
                f"group ranks {absent} did not arrive within {self.timeout:g} s "
                f"(collective_benchmark_timeout) of their last sign of progress: "
                f"{silence.last_heard(absent)}"
            )
        )

    def _settle(self, proposal: Decision) -> Decision:
        # compare_set is the session's single linearization point: the first
        # proposal is stored, later ones get the stored value back.
        return Decision.decode(self._store.compare_set("decision", "", proposal.encode()))

    # -- VOTE -------------------------------------------------------------------

    def vote(self, topic: str, outcome: str) -> list[str]:
        """Post this rank's ``outcome`` for ``topic``; return every rank's outcome.

        Waits until the ranks that did not vote were silent for ``timeout`` seconds
        (a rank that works, compiling or benchmarking, beats); then raises
        CollectiveAutotuneError naming them, where they were last heard of, and
        what the others reported. The last rank to read a topic's votes deletes them.
        """
        keys = self._vote_keys(topic)
        self._store.set(keys[self.rank], outcome)
        silence = self._silence()
        if not _poll(self._store, keys, silence, self.check_abort):
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise CollectiveAutotuneError(
                f"{topic}: group ranks {missing} did not report and were silent for "
                f"{self.timeout:g} s (collective_benchmark_timeout); they are gone, or "
                f"stuck in a device collective. {silence.last_heard(missing)}. "
                f"Reports received: {self.peer_reports(topic)}"
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

    def _silence(self) -> Silence:
        return Silence(self.timeout, self._root, self.members)

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
    """True once all ``keys`` exist; False if ``deadline`` passes first. This rank is
    silent meanwhile: waiting is no progress."""
    global _waited_s
    began = time.monotonic()
    interval = _POLL_MIN_S
    try:
        with liveness.waiting():
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
