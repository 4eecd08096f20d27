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

The messages, and what each costs a rank in Store requests (`StoreClient` counts them):

    JOIN       append (rank, what it brings) to the session's joins; add arrived += 1
    DECIDE     the rank whose add completes the group reads the joins and proposes a
               decision; a rank whose deadline passes proposes a fallback; the first
               proposal stored (compare_set) is the session's, adopted by every rank:
               4 requests, late ranks included (their wait returns at once)
    VOTE       append (rank, outcome) to the topic's votes; add count += 1; the rank
               completing the count sets `done`, the others wait for it; every rank
               reads the votes once: 4 requests, whatever the group's size
    PUBLISH    compare_set the group's decision for a key: the first value stored is
               the group's, for the rest of the job: 1 request
    ABORT      a rank that finds the group's collectives untrustworthy (a device
               collective timed out, a choice raised inside one) stores its reason and
               adds ABORTED to the group's progress counter: every wait of the group
               raises at its next look, naming that reason

Waits are server-side (`Store.wait`), in slices of one *look interval* (an eighth of
the timeout, between 50 ms and 5 s); between slices a rank looks at its group's
progress counter, one request, which also carries aborts. So a waiting rank costs at
most two requests per look interval, and a group of any size costs each of its ranks
the same few requests per message.

Deadlines bound *silence*, not work. While a process works on something its peers may
wait for (Dynamo compiling a graph, building a key's choices, benchmarking), a daemon
thread adds one to the progress counter of each of its groups every look interval
(Liveness); what it is doing is written once per step, to be read only for an error
message. A rank waiting in the Store is silent, so two ranks waiting for each other (in
different sessions) cannot keep each other waiting. Each wait ends ``timeout`` seconds
(``collective_benchmark_timeout``) after the last progress of its group (Silence), so a
dead or stuck rank ends every wait on it within ``timeout`` plus one look:

    * JOIN/DECIDE: past the deadline the waiter proposes a fallback; a rank arriving
      later reads the decision and follows it at once, without a wait of its own.
    * VOTE: past the deadline the session fails with a CollectiveAutotuneError on
      every rank that can still vote, naming the ranks that did not vote and what they
      were last heard doing; an ABORT meanwhile ends the wait at the next look.
    * Waiting for a key that a session decided but has not published: past the
      deadline the op's own implementation is proposed (compare_set) and the stored
      value adopted.
    * Device work of the benchmark (collective_benchmarking) is bounded by its own
      budget and by ``timeout`` from its start, whatever the heartbeats say.

A live rank that keeps compiling is waited for as long as it does: the timeout turns
a dead or stuck peer into a clear error, it does not cap a peer's compile time.

Every key lives under ``collective_autotune/<attempt>/``, where the attempt names the
elastic run and its restart count (torchrun hands every attempt the same Store: what
one attempt agreed, a fallback say, must not bind the next), then under the group's
name: a group's traffic could move to a Store of its own without other changes. The
protocol's Store client is a connection of its own, opened (off the compiling thread) at
the process's first compile that may need it, and ``collective_benchmark_timeout`` bounds
every wait on the Store in total, connecting included: a Store that does not answer
within it, whichever of the process's threads asked, is lost for the whole process
(StoreLostError on every request, at once, and the Store is never tried again, in a
later compile or at exit). The job's client waits the job's timeout, 30 minutes by
default, and c10d's own client bounds neither connecting nor a request to a Store that
stopped answering (StoreClient).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence, TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store


log = logging.getLogger(__name__)

NAMESPACE = "collective_autotune"
# What an abort adds to its group's progress counter: far above any count of beats, so
# that one read tells both whether the group progressed and whether it aborted.
ABORTED = 1 << 40


def describe(error: BaseException) -> str:
    """An error in one line, for a vote or a message: its type and first line."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class CollectiveAutotuneError(RuntimeError):
    """The group can no longer agree or its collectives can no longer be trusted."""


class StoreLostError(CollectiveAutotuneError):
    """The c10d Store stopped answering: no rank can agree with its peers any more."""


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
class Decision:
    """A session's decision, identical on every rank."""

    kind: DecisionKind
    reason: str

    def encode(self) -> str:
        return json.dumps({"kind": self.kind.value, "reason": self.reason})

    @staticmethod
    def decode(raw: bytes | str) -> Decision:
        d = json.loads(raw)
        return Decision(DecisionKind(d["kind"]), d["reason"])


class Deadline:
    """A point in (monotonic) time that a wait must not pass."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end


def look_interval(timeout: float) -> float:
    """How often a waiting rank looks at its group's progress, and a working one beats:
    a small part of the timeout (a live peer is seen progressing several times within
    it), and at least 1.5 s where the timeout allows it. A wait costs a request per
    interval, a look between intervals and its last answer, so a waiting rank then
    costs the Store under two requests a second, however short its wait."""
    return min(max(timeout / 8, min(1.5, timeout / 2)), 5.0)


def attempt_namespace() -> str:
    """The Store namespace of this job attempt: torchrun's run id and restart count, so
    that a restarted attempt, which torchrun hands the same Store, starts afresh."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return f"{NAMESPACE}/job"
    return f"{NAMESPACE}/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


# -- the Store client --------------------------------------------------------------------


@dataclasses.dataclass
class _Request:
    """One request of a StoreClient, as its thread runs it."""

    call: Callable[[], Any]
    # What the requesting thread was doing, for the error if the Store is lost.
    phase: str
    # Seconds the Store may take before its answer is owed: a wait's, or none.
    owed_after: float = 0.0
    waits: bool = False
    # Opening the connection: it has no caller of its own, and any failure loses the Store.
    connects: bool = False
    started: float | None = None
    done: bool = False
    value: Any = None
    error: Exception | None = None


@dataclasses.dataclass(frozen=True)
class _Loss:
    """How this process saw the Store lost: never tried again after it."""

    phase: str
    reason: str
    at: float
    cause: BaseException | None


def _store_method(name: str) -> Callable[..., Any]:
    """The c10d Store method ``name``, to be called on a connection that may not be
    open yet (``Store.add(store, ...)``: c10d runs the connection's own)."""
    import torch.distributed as dist

    return getattr(dist.Store, name)


class StoreClient:
    """This process's client of the job's Store for collective autotuning.

    Counts its requests (``requests``: a multi-key read counts once), and turns any
    failure of the Store itself into a StoreLostError naming its address and what the
    rank was doing. Safe to share between threads.

    c10d bounds neither connecting (a refused connection is retried for about twice
    its timeout, plus a back-off) nor any request to a Store that stops answering
    without closing the connection (a host stopped or cut off: the request waits for
    its answer for ever, whatever the timeout). So the requests run on a thread of the
    client's own, one at a time in the order they came, the connection opened (by
    ``open_store``, with the timeout) before the first, and a caller waits at most
    ``timeout`` seconds after the Store owed the answer of the request in progress (a
    wait's answer is owed once its seconds passed): every caller queued behind it
    shares that deadline, so the heartbeat and the session never each spend a
    timeout. A Store that failed a request or missed the deadline is *lost*: every
    request after that raises at once, naming the loss, and the Store is never tried
    again (a request stuck in c10d stays on the client's daemon thread, which holds
    nothing up at exit).
    """

    # How long the client's thread waits for another request before it ends: starting
    # a thread per request would cost more than the request.
    IDLE_S = 1.0

    def __init__(
        self,
        store: Store | None,
        address: str,
        timeout: float,
        open_store: Callable[[float], Store] | None = None,
    ) -> None:
        self.store = store
        self.address = address
        self.timeout = timeout
        self.requests = 0
        self.lost: _Loss | None = None
        # Opens this client's own connection (``store`` None), given the timeout.
        self._open_store = open_store
        self._opening = False
        self._phase = threading.local()
        self._changed = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._current: _Request | None = None
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Name what this thread does with the Store, for the error if it is lost."""
        previous = getattr(self._phase, "value", None)
        self._phase.value = phase
        try:
            yield
        finally:
            self._phase.value = previous

    def set(self, key: str, value: str) -> None:
        self._request(_store_method("set"), key, value)

    def get(self, key: str) -> bytes:
        return self._request(_store_method("get"), key)

    def add(self, key: str, amount: int) -> int:
        return self._request(_store_method("add"), key, amount)

    def append(self, key: str, value: str) -> None:
        self._request(_store_method("append"), key, value)

    def check(self, keys: list[str]) -> bool:
        return self._request(_store_method("check"), keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._request(_store_method("compare_set"), key, expected, desired)

    def get_if_set(self, key: str) -> bytes | None:
        """``key``'s value, or None where it is not set (two requests when it is)."""
        return self.get(key) if self.check([key]) else None

    def wait(self, keys: list[str], seconds: float) -> bool:
        """True once every key of ``keys`` is set; False if ``seconds`` pass first.
        The Store answers when they are set: no polling."""
        try:
            self._request(_store_method("wait"), keys, timedelta(seconds=seconds))
            return True
        except StoreLostError as e:
            if e.__cause__ is not None and _ran_out(e.__cause__):
                return False
            raise

    def _request(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(store, *args)`` on the client's thread; its answer, or, where it is a
        wait that ran out, a StoreLostError caused by c10d's DistStoreError."""
        phase = getattr(self._phase, "value", None) or "collective autotuning"
        waits = fn is _store_method("wait")
        with self._changed:
            if self.lost is not None:
                raise self._lost_error(phase, again=True)
            self.requests += 1
            if self.store is None and not self._opening:
                self._opening = True
                self._queue.append(_Request(self._open, "connecting", connects=True))
            request = _Request(
                lambda: fn(self.store, *args),
                phase,
                owed_after=args[1].total_seconds() if waits else 0.0,
                waits=waits,
            )
            self._queue.append(request)
            if self._thread is None:
                thread = threading.Thread(
                    target=self._work, name="collective-autotune-store", daemon=True
                )
                thread.start()
                self._thread = thread
            self._changed.notify_all()  # a thread waiting for work takes it
            while not request.done and self.lost is None:
                current = self._current
                if current is None or current.started is None:
                    self._changed.wait()
                    continue
                overdue = current.started + current.owed_after + self.timeout
                if time.monotonic() >= overdue:
                    self._lose(
                        current.phase,
                        f"no answer within {self.timeout:g} s (collective_benchmark_timeout)",
                        None,
                    )
                    break
                self._changed.wait(overdue - time.monotonic())
            if not request.done:
                raise self._lost_error(phase, again=False)
        if request.error is None:
            return request.value
        if request.waits:  # it ran out (anything else lost the Store)
            raise StoreLostError(f"a wait during {phase} ran out") from request.error
        raise request.error

    def _open(self) -> None:
        assert self._open_store is not None
        self.store = self._open_store(self.timeout)

    def _work(self) -> None:
        """Run the queued requests, one at a time, until none came for IDLE_S."""
        while True:
            with self._changed:
                if self.lost is None and not self._queue:
                    self._changed.wait(self.IDLE_S)
                if self.lost is not None or not self._queue:
                    self._thread = None
                    return
                request = self._queue.popleft()
                request.started = time.monotonic()
                self._current = request
                self._changed.notify_all()
            value: Any = None
            error: Exception | None = None
            try:
                value = request.call()
            except Exception as e:  # noqa: BLE001 - handed to the caller, or the Store is lost
                error = e
            with self._changed:
                self._current = None
                # After a loss what the request got no longer matters: its caller raised.
                if self.lost is None:
                    if error is not None and _loses_the_store(request, error):
                        self._lose(request.phase, describe(error), error)
                    else:
                        request.value, request.error, request.done = value, error, True
                self._changed.notify_all()

    def _lose(self, phase: str, reason: str, cause: BaseException | None) -> None:
        """The Store is lost (the caller holds ``_changed``): every request in flight
        or queued raises, every later one at once."""
        self.lost = _Loss(phase, reason, time.monotonic(), cause)
        self._queue.clear()
        self._changed.notify_all()
        log.warning(
            "collective autotuning: the c10d Store (%s) stopped answering during %s: %s; "
            "this process does not try it again",
            self.address,
            phase,
            reason,
        )

    def _lost_error(self, phase: str, again: bool) -> StoreLostError:
        loss = self.lost
        assert loss is not None
        if again:
            text = (
                f"the c10d Store ({self.address}) stopped answering during {loss.phase} "
                f"{time.monotonic() - loss.at:.1f} s ago: {loss.reason}; this process does not "
                f"try it again ({phase})"
            )
        else:
            seen = "" if phase == loss.phase else f" (seen during {loss.phase})"
            text = (
                f"the c10d Store ({self.address}) stopped answering during {phase}: "
                f"{loss.reason}{seen}"
            )
        error = StoreLostError(text)
        error.__cause__ = loss.cause
        return error


def _loses_the_store(request: _Request, error: Exception) -> bool:
    """Whether ``request`` failing with ``error`` means the Store is lost: any failure
    to connect, any c10d error but a wait that ran out (anything else is the caller's)."""
    import torch.distributed as dist

    if request.connects:
        return True
    return isinstance(error, dist.DistError) and not (request.waits and _ran_out(error))


def _ran_out(error: BaseException) -> bool:
    """Whether a c10d error is a wait that ran out (a lost Store raises DistNetworkError)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistStoreError) and not isinstance(error, dist.DistNetworkError)


def connect(timeout: float) -> StoreClient:
    """A client of this job's default Store with ``timeout`` as its deadline.

    Over TCP a connection of its own, opened on the client's thread before its first
    request (a lost Store then ends every request within the timeout, not the job's
    Store timeout), its keys outside the job's prefixes; any other Store is shared.
    """
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_store()
    root = default
    while isinstance(root, dist.PrefixStore):
        root = root.underlying_store
    if not isinstance(root, dist.TCPStore):
        return StoreClient(default, type(root).__name__, timeout)
    host, port, libuv = root.host, root.port, root.libuvBackend

    def open_connection(seconds: float) -> Store:
        # The Store was up when the job started: a refused connection means it is gone,
        # which c10d would retry for twice the timeout.
        socket.create_connection((host, port), timeout=seconds).close()
        return dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=seconds), use_libuv=libuv
        )

    return StoreClient(None, f"{host}:{port}", timeout, open_connection)


# -- liveness ----------------------------------------------------------------------------


class Liveness:
    """This process's heartbeat, so that its peers wait for it as long as it works.

    While the process does something its peers may wait for, a daemon thread adds one
    to the progress counter of each group it beats into (``groups()``) every look
    interval, and writes what the process does to ``doing/<global rank>`` when that
    changed (read only for error messages: it costs a request per look at most, never
    one per step). The thread ends when the work does. While the process waits for its
    peers it is silent: a wait is no progress.
    """

    def __init__(
        self,
        client: StoreClient,
        namespace: str,
        global_rank: int,
        groups: Callable[[], Sequence[str]],
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._rank = global_rank
        self._groups = groups
        # What the process does, innermost last, and whether each step beats.
        self._doing: list[tuple[str, bool]] = []
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def working(self, doing: str, beat: bool = True) -> Iterator[None]:
        """Beat, saying ``doing``, while the block runs (nested: the innermost says).

        Without ``beat`` the block only says what it does: work whose peers do it in
        lockstep (a benchmark) bounds itself, and must not keep a wait on it alive.
        """
        with self._lock:
            self._doing.append((doing, beat))
            # A lost Store carries no beats, and is not tried again.
            if self._thread is None and self._client.lost is None:
                self._thread = threading.Thread(
                    target=self._beat, name="collective-autotune-heartbeat", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._doing.pop()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """No beats while the block waits for peers."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

    def _beat(self) -> None:
        said = None
        while True:
            with self._lock:
                if not self._doing:
                    self._thread = None
                    return
                doing, beat = self._doing[-1]
                beat = beat and self._waiting == 0
            try:
                with self._client.during("a heartbeat"):
                    if doing != said:
                        self._client.set(doing_key(self._namespace, self._rank), doing)
                        said = doing
                    if beat:
                        for group in self._groups():
                            self._client.add(progress_key(self._namespace, group), 1)
            except StoreLostError:
                # The main thread meets the lost Store at its next request.
                log.debug("heartbeat stopped: the Store is gone", exc_info=True)
                with self._lock:
                    self._thread = None
                return
            time.sleep(look_interval(self._client.timeout))


def progress_key(namespace: str, group_name: str) -> str:
    return f"{namespace}/{group_name}/progress"


def abort_key(namespace: str, group_name: str) -> str:
    return f"{namespace}/{group_name}/abort"


def doing_key(namespace: str, global_rank: int) -> str:
    return f"{namespace}/doing/{global_rank}"


@dataclasses.dataclass
class Participant:
    """One process as the protocol sees it: its Store client, its heartbeat, its global
    rank, and what it has done so far (sessions joined, seconds waited)."""

    client: StoreClient
    liveness: Liveness
    global_rank: int
    namespace: str
    # The job's default store this participant was made for.
    store: Any = None
    # Sessions this process joined (their Store prefixes): a second graph of the same
    # plan on the same group reads their decision instead of joining again.
    joined: set[str] = dataclasses.field(default_factory=set)
    # Decisions of each group read or published so far: a decision never changes.
    known: dict[str, str] = dataclasses.field(default_factory=dict)
    waited_s: float = 0.0


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
        current = _participant = Participant(
            client, Liveness(client, namespace, rank, _member_groups), rank, namespace, store
        )
    current.client.timeout = timeout
    return current


def _member_groups() -> list[str]:
    """The groups this process beats into: its process groups of more than one rank
    (any of them may hold a session that waits for this process's compile)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    return sorted(
        pg.group_name
        for pg, ranks in dist.distributed_c10d._world.pg_group_ranks.items()
        if rank in ranks and len(ranks) > 1
    )


# -- waiting -------------------------------------------------------------------------


class Silence(Deadline):
    """A deadline ``seconds`` after the last progress of the group waited for.

    Progress is a change of the group's progress counter, which its working ranks beat
    (the waiter itself is silent while it waits); so a peer that works keeps the wait
    alive, and a dead or silent group ends it. Each look is one request, which also
    tells whether the group aborted. Silence counts from the first look: before it the
    waiter knows no value to compare, and a peer beating once a look interval must
    get two looks to show its progress however the two clocks fall.
    """

    def __init__(
        self, participant: Participant, group_name: str, members: Sequence[int], seconds: float
    ) -> None:
        super().__init__(seconds)
        self._participant = participant
        self._group = group_name
        # The global rank of each group rank.
        self._members = list(members)
        self._last: int | None = None
        self._last_progress = time.monotonic()

    def look(self) -> None:
        """Read the group's progress; raise CollectiveAutotuneError if it aborted."""
        client = self._participant.client
        value = client.add(progress_key(self._participant.namespace, self._group), 0)
        if value >= ABORTED:
            raise self.aborted()
        now = time.monotonic()
        if self._last is None or value != self._last:
            self._end = max(self._end, now + self.seconds)
        if self._last is not None and value != self._last:
            self._last_progress = now
        self._last = value

    def aborted(self) -> CollectiveAutotuneError:
        reason = self._participant.client.get(abort_key(self._participant.namespace, self._group))
        return CollectiveAutotuneError(
            f"collective autotuning stopped on every rank of the group: {reason.decode()}"
        )

    def last_heard(self, group_ranks: Sequence[int]) -> str:
        """What each of ``group_ranks`` was last heard doing, for an error message."""
        client = self._participant.client
        parts = []
        for r in group_ranks:
            doing = client.get_if_set(doing_key(self._participant.namespace, self._members[r]))
            if doing is None:
                parts.append(f"group rank {r} never reported progress")
            else:
                parts.append(f"group rank {r} was last heard {doing.decode()}")
        parts.append(
            f"the group's last progress was {time.monotonic() - self._last_progress:.1f} s ago"
        )
        return "; ".join(parts)


def wait_until(participant: Participant, keys: list[str], silence: Silence) -> bool:
    """True once every key of ``keys`` is set; False once the group was silent past
    ``silence``. Raises CollectiveAutotuneError where the group aborted meanwhile. This
    rank is silent meanwhile: waiting is no progress."""
    began = time.monotonic()
    client = participant.client
    try:
        with participant.liveness.waiting():
            while True:
                slice_s = min(look_interval(silence.seconds), max(silence.remaining(), 0.001))
                if client.wait(keys, slice_s):
                    return True
                silence.look()
                if silence.expired():
                    return False
    finally:
        participant.waited_s += time.monotonic() - began


# -- the group's decisions -------------------------------------------------------------


class GroupDecisions:
    """The group's decision for each key, kept in the Store for the attempt.

    Kept under the group's ``scope`` (a digest of its environment: size, backend,
    versions), so that no group of another environment ever reads them.
    """

    def __init__(
        self,
        participant: Participant,
        group_name: str,
        members: Sequence[int],
        scope: str,
        timeout: float,
    ) -> None:
        self._participant = participant
        self._group = group_name
        self._prefix = f"{participant.namespace}/{group_name}/decided/{scope}/"
        self._members = list(members)
        self._timeout = timeout

    def known(self, key: str) -> str | None:
        """The group's decision for ``key`` if this process read or published it."""
        return self._participant.known.get(self._prefix + key)

    def get(self, key: str) -> str | None:
        """The group's decision for ``key`` if published (no waiting)."""
        full = self._prefix + key
        known = self._participant.known.get(full)
        if known is None:
            with self._participant.client.during(f"reading the decision for {key}"):
                raw = self._participant.client.get_if_set(full)
            if raw is not None:
                known = self._participant.known[full] = raw.decode()
        return known

    def publish(self, key: str, value: str) -> str:
        """Propose ``value`` for ``key``; the value stored first, which every rank uses."""
        full = self._prefix + key
        with self._participant.client.during(f"publishing the decision for {key}"):
            stored = self._participant.client.compare_set(full, "", value).decode()
        self._participant.known[full] = stored
        return stored

    def wait(self, key: str) -> str | None:
        """The decision for ``key`` once published, or None if the group was silent for
        ``timeout`` before (any of its ranks may be the one that publishes)."""
        silence = Silence(self._participant, self._group, self._members, self._timeout)
        with self._participant.client.during(f"waiting for the decision for {key}"):
            if wait_until(self._participant, [self._prefix + key], silence):
                return self.get(key)
        return None


# -- one session -------------------------------------------------------------------------


class CollectiveSession:
    """The Store side of one session: one graph's plan on one process group."""

    def __init__(
        self,
        participant: Participant,
        group_name: str,
        session_key: str,
        rank: int,
        members: Sequence[int],
        timeout: float,
    ) -> None:
        self.participant = participant
        self.rank = rank
        # The global rank of each group rank.
        self.members = list(members)
        self.world_size = len(self.members)
        self.timeout = timeout
        self.key = session_key
        self.group_name = group_name
        self._prefix = f"{participant.namespace}/{group_name}/session/{session_key}/"
        self._topic_prefix = ""
        # Whether this rank agrees keys in this session's votes: it joined before the
        # decision was taken (it did not merely read it), and the group compiles.
        self.votes = False

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
        ``timeout`` seconds. A rank that joined this session before (an earlier graph
        of the same plan) reads its decision and does not vote.
        """
        client = self.participant.client
        with client.during(f"joining session {self.key}"):
            # By the session's Store prefix: the same plan on another group is another session.
            if self._prefix in self.participant.joined:
                decided = self.participant.known.get(self._prefix + "decision")
                if decided is None:
                    raise CollectiveAutotuneError(
                        f"session {self.key}: this rank joined it for an earlier graph and it "
                        f"ended without a decision there (see that graph's error)"
                    )
                return Decision.decode(decided)
            self.participant.joined.add(self._prefix)
            client.append(
                self._prefix + "joins", json.dumps([self.rank, join], sort_keys=True) + "\n"
            )
            if client.add(self._prefix + "arrived", 1) == self.world_size:
                joins = self._joins()
                decision = self._settle(decide([joins[r] for r in range(self.world_size)]))
            else:
                silence = self._silence()
                if wait_until(self.participant, [self._prefix + "decision"], silence):
                    decision = Decision.decode(client.get(self._prefix + "decision"))
                else:
                    absent = [r for r in range(self.world_size) if r not in self._joins()]
                    decision = self._settle(
                        fallback(
                            f"group ranks {absent} did not arrive within {self.timeout:g} s "
                            f"(collective_benchmark_timeout) of the group's last sign of progress: "
                            f"{silence.last_heard(absent)}"
                        )
                    )
        self.participant.known[self._prefix + "decision"] = decision.encode()
        # A fallback or a load needs no votes; a compile was decided with this rank in.
        self.votes = decision.kind == DecisionKind.COMPILE
        return decision

    def _joins(self) -> dict[int, dict[str, Any]]:
        raw = self.participant.client.get(self._prefix + "joins").decode()
        return {rank: join for rank, join in map(json.loads, raw.splitlines())}

    def _settle(self, proposal: Decision) -> Decision:
        # compare_set is the session's single linearization point: the first
        # proposal is stored, later ones get the stored value back.
        stored = self.participant.client.compare_set(
            self._prefix + "decision", "", proposal.encode()
        )
        return Decision.decode(stored)

    # -- VOTE -------------------------------------------------------------------

    def vote(self, topic: str, outcome: str) -> list[str]:
        """Post this rank's ``outcome`` for ``topic``; return every rank's outcome.

        Waits until the ranks that did not vote were silent for ``timeout`` seconds
        (a rank that works, compiling or benchmarking, beats); then raises
        CollectiveAutotuneError naming them, where they were last heard of, and
        what the others reported.
        """
        client = self.participant.client
        base = f"{self._prefix}vote/{self._topic_prefix}{topic}/"
        with client.during(f"the vote on {topic}"):
            client.append(base + "votes", json.dumps([self.rank, outcome]) + "\n")
            if client.add(base + "count", 1) == self.world_size:
                client.set(base + "done", "1")
            else:
                silence = self._silence()
                if not wait_until(self.participant, [base + "done"], silence):
                    raw = client.get_if_set(base + "votes")
                    votes = self._votes(raw.decode() if raw is not None else "")
                    missing = [r for r in range(self.world_size) if r not in votes]
                    if not missing:  # every rank voted; the one to say so was slow
                        return [votes[r] for r in range(self.world_size)]
                    raise CollectiveAutotuneError(
                        f"{topic}: group ranks {missing} did not report and were silent for "
                        f"{self.timeout:g} s (collective_benchmark_timeout); they are gone, or "
                        f"stuck in a device collective. {silence.last_heard(missing)}. "
                        f"Reports received: {votes}"
                    )
            votes = self._votes(client.get(base + "votes").decode())
        return [votes[r] for r in range(self.world_size)]

    @staticmethod
    def _votes(raw: str) -> dict[int, str]:
        """The votes appended so far, by group rank."""
        return {rank: outcome for rank, outcome in map(json.loads, raw.splitlines())}

    def scoped(self, prefix: str) -> CollectiveSession:
        """This session, with ``prefix`` before every vote topic: the votes of one key
        among the several that a graph's session agrees."""
        view = copy.copy(self)
        view._topic_prefix = f"{self._topic_prefix}{prefix}/"
        return view

    # -- ABORT ------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Tell every rank of the group to stop; the first reason posted is kept."""
        client = self.participant.client
        namespace = self.participant.namespace
        with client.during("aborting"):
            client.compare_set(
                abort_key(namespace, self.group_name), "", f"group rank {self.rank}: {reason}"
            )
            client.add(progress_key(namespace, self.group_name), ABORTED)

    def check_abort(self) -> None:
        """Raise CollectiveAutotuneError if some rank aborted (one request)."""
        with self.participant.client.during("checking for an abort"):
            self._silence().look()

    # -- helpers ----------------------------------------------------------------

    def _silence(self) -> Silence:
        return Silence(self.participant, self.group_name, self.members, self.timeout)
