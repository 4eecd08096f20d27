"""Sessions over the c10d Store: ranks of a process group agree without a collective.

A *session* lets the ranks of one process group agree on something (whether to go
ahead, which of several implementations to use) before any of them issues a device
collective. It runs over the job's c10d Store because the Store's operations have
real deadlines and leave NCCL/gloo untouched: a late, absent or failed rank can never
leave a half-issued device collective behind. The module knows nothing of what is
agreed: joins, decisions and votes are JSON values that its user gives meaning to.

Every key lives under ``<namespace>/<group name>/``: a group's traffic could move to a
Store of its own without other changes. The namespace is the user's, per job attempt
(``attempt_namespace``: torchrun hands every attempt of an elastic job the same
Store, and what one attempt agreed must not bind the next).

The messages, and what each costs a rank in Store requests (``StoreClient`` counts
them):

    JOIN       append (rank, what it brings) to the session's joins; add arrived += 1
    DECIDE     the rank whose add completes the group reads the joins and proposes a
               decision; a rank whose deadline passes proposes a fallback; the first
               proposal stored (compare_set) is the session's, adopted by every rank:
               4 requests, late ranks included (their wait returns at once)
    VOTE       append (rank, value) to the topic's votes; add count += 1; the rank
               completing the count sets ``done``, the others wait for it; every rank
               reads the votes once: 4 requests, whatever the group's size
    PUBLISH    compare_set a value for a key (``GroupDecisions``): the first value
               stored is the group's, for the rest of the attempt: 1 request
    ABORT      a rank that finds the group untrustworthy stores its reason and adds
               ABORTED to the group's progress counter: every wait of the group raises
               at its next look, naming that reason

A join or a vote travels as one JSON object a line, ``{"rank": r, "value": v}``
(``Message``): the value is any JSON value, None travelling as null, and a line that
is not such an object fails the session with a ``MalformedMessageError``.

Waits are server-side (``Store.wait``), in slices of one *look interval*
(``look_interval``: an eighth of the timeout, at least 1.5 s where the timeout allows
it, at most 5 s); between slices a rank looks at its group's progress counter, one
request, which also carries aborts. A waiting rank costs at most two requests per look
interval, and a group of any size costs each of its ranks the same few requests per
message.

Deadlines bound *silence*, not work. While a process works on something its peers may
wait for, a daemon thread adds one to the progress counter of each of its groups every
look interval (``Liveness``); what it is doing is written when that changes, to be
read only for an error message. A rank waiting in the Store is silent, so two ranks
waiting for each other (in different sessions) cannot keep each other waiting. Each
wait ends ``timeout`` seconds after the last progress of its group (``Silence``), so a
dead or stuck rank ends every wait on it within ``timeout`` plus one look:

    * JOIN/DECIDE: past the deadline the waiter proposes a fallback; a rank arriving
      later reads the decision and follows it at once, without a wait of its own.
    * VOTE: past the deadline the session fails with a ``StoreSessionError`` on every
      rank that can still vote, naming the ranks that did not vote and what they were
      last heard doing; an ABORT meanwhile ends the wait at the next look.
    * Waiting for a published value: past the deadline the wait returns None.

The client is a connection of its own (``connect``), opened off the calling thread at
its first request, and the timeout bounds every wait on the Store in total, connecting
included: a Store that does not answer within it, whichever of the process's threads
asked, is lost for the whole process (``StoreLostError`` on every request, at once, and
the Store is never tried again). c10d's own client bounds neither connecting nor a
request to a Store that stopped answering.

The user names things through a ``Vocabulary``: its error types (subclasses of this
module's), its name for the timeout, and its own name in log lines and thread names.
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
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, ClassVar, TYPE_CHECKING

import torch.distributed as dist


if TYPE_CHECKING:
    from torch.distributed import Store


__all__ = [
    "ABORTED",
    "Deadline",
    "GroupDecisions",
    "Liveness",
    "MalformedMessageError",
    "Message",
    "Participant",
    "Silence",
    "StoreClient",
    "StoreLostError",
    "StoreSession",
    "StoreSessionError",
    "Vocabulary",
    "abort_key",
    "attempt_namespace",
    "connect",
    "describe",
    "doing_key",
    "look_interval",
    "member_groups",
    "progress_key",
    "wait_until",
]

log = logging.getLogger(__name__)

# What an abort adds to its group's progress counter: far above any count of beats, so
# that one read tells both whether the group progressed and whether it aborted.
ABORTED = 1 << 40


# -- errors ----------------------------------------------------------------------------


class StoreSessionError(dist.DistError):
    """The ranks of a group can no longer agree over the Store: a peer was silent past
    the timeout, a rank aborted, or a session ended without a decision."""


class StoreLostError(StoreSessionError, dist.DistNetworkError):
    """The c10d Store stopped answering: no rank can agree with its peers any more."""


class MalformedMessageError(StoreSessionError, ValueError):
    """A join, vote or decision read from the Store is not what the protocol writes."""


def describe(error: BaseException) -> str:
    """An error in one line, for a vote or a message: its type and first line."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """How a user of the protocol names it in errors, log lines and thread names."""

    # What uses the Store: in log lines, and the phase of a request nobody named.
    user: str = "store session"
    # The start of the client's and the heartbeat's thread names.
    threads: str = "store-session"
    # The user's name for the timeout, in error messages.
    timeout_name: str = "timeout"
    # What the protocol raises: the user's subclasses, so that its own handlers catch.
    session_error: type[StoreSessionError] = StoreSessionError
    lost_error: type[StoreLostError] = StoreLostError


# -- time ------------------------------------------------------------------------------


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


# -- keys ------------------------------------------------------------------------------


def attempt_namespace(root: str) -> str:
    """The Store namespace under ``root`` of this job attempt: torchrun's run id and
    restart count, so that a restarted attempt, which torchrun hands the same Store,
    starts afresh."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return f"{root}/job"
    return f"{root}/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def progress_key(namespace: str, group_name: str) -> str:
    return f"{namespace}/{group_name}/progress"


def abort_key(namespace: str, group_name: str) -> str:
    return f"{namespace}/{group_name}/abort"


def doing_key(namespace: str, global_rank: int) -> str:
    return f"{namespace}/doing/{global_rank}"


# -- messages --------------------------------------------------------------------------


class WireMessage:
    """A frozen dataclass that travels as one JSON object: its fields by name, each
    value checked against the field's annotation when read (str, int, float, bool, an
    enum by its value, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``, ``Any``, or
    another WireMessage), so that what the protocol reads is what it writes or a
    ``MalformedMessageError`` (or the class's ``malformed_error``) naming the field."""

    malformed_error: ClassVar[type[Exception]] = MalformedMessageError

    def to_wire(self) -> dict[str, Any]:
        return {f.name: _to_json(getattr(self, f.name)) for f in _fields(type(self))}

    @classmethod
    def from_wire(cls, value: Any) -> Any:
        """The message ``value`` (a decoded JSON object) holds."""
        fields = _fields(cls)
        if not isinstance(value, dict) or set(value) != {f.name for f in fields}:
            raise cls.malformed_error(f"not a {cls.__name__}: {str(value)[:200]!r}")
        hints = typing.get_type_hints(cls)
        try:
            return cls(
                **{
                    f.name: _from_json(hints[f.name], value[f.name], f.name)
                    for f in fields
                }
            )
        except _WrongField as e:
            raise cls.malformed_error(f"{cls.__name__}: {e}") from None

    def encode(self) -> str:
        return json.dumps(self.to_wire(), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Any:
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise cls.malformed_error(
                f"a {cls.__name__} is not JSON: {raw[:200]!r}"
            ) from e
        return cls.from_wire(value)


class _WrongField(ValueError):
    pass


def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(cls)  # type: ignore[arg-type]


def _to_json(value: Any) -> Any:
    if isinstance(value, WireMessage):
        return value.to_wire()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _from_json(hint: Any, value: Any, name: str) -> Any:
    """``value`` read as ``hint`` says; _WrongField naming field ``name``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_json(inner, value, name)
    if origin is tuple and isinstance(value, list):
        return tuple(_from_json(args[0], v, name) for v in value)
    if origin is dict and isinstance(value, dict):
        return {k: _from_json(args[1], v, name) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, WireMessage):
        return hint.from_wire(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            pass
    elif hint is float and type(value) in (int, float):
        return float(value)
    elif isinstance(hint, type) and type(value) is hint:
        return value
    raise _WrongField(f"{name} is not a {hint}: {str(value)[:200]!r}")


@dataclasses.dataclass(frozen=True)
class Message(WireMessage):
    """One rank's message in a session: its join, or its vote on a topic; the value is
    any JSON value (None is null). On the wire one object on one line."""

    rank: int
    value: Any

    @classmethod
    def from_wire(cls, value: Any) -> Message:
        message = super().from_wire(value)
        if message.rank < 0:
            raise MalformedMessageError(f"no group rank: {str(value)[:200]!r}")
        return message

    @staticmethod
    def read_all(raw: str) -> dict[int, Any]:
        """The value of each rank's message in ``raw`` (appended lines), by rank."""
        return {m.rank: m.value for m in map(Message.decode, raw.splitlines())}


def _decode_value(raw: bytes | str) -> Any:
    """A decision as the Store keeps it (one JSON value)."""
    try:
        return json.loads(raw)
    except ValueError as e:
        raise MalformedMessageError(f"not a JSON value: {raw[:200]!r}") from e


# -- the Store client ------------------------------------------------------------------


@dataclasses.dataclass
class _Request:
    """One request of a StoreClient, as its thread runs it."""

    call: Callable[[], Any]
    # What the requesting thread was doing, for the error if the Store is lost.
    phase: str
    # Seconds the Store may take before its answer is owed: a wait's, or none.
    owed_after: float = 0.0
    waits: bool = False
    # Opening the connection: it has no caller of its own; any failure loses the Store.
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
    return getattr(dist.Store, name)


class StoreClient:
    """This process's client of the job's Store for sessions.

    Counts its requests (``requests``: a multi-key read counts once), and turns any
    failure of the Store itself into a StoreLostError naming its address and what the
    rank was doing. Safe to share between threads. ``vocabulary`` (a class attribute,
    which a user's subclass sets) names its errors and threads.

    c10d bounds neither connecting (a refused connection is retried for about twice
    its timeout, plus a back-off) nor any request to a Store that stops answering
    without closing the connection (a host stopped or cut off: the request waits for
    its answer for ever, whatever the timeout). So the requests run on a thread of the
    client's own, one at a time in the order they came, the connection opened (by
    ``open_store``, with the timeout) before the first, and a caller waits at most
    ``timeout`` seconds after the Store owed the answer of the request in progress (a
    wait's answer is owed once its seconds passed): every caller queued behind it
    shares that deadline, so a heartbeat and a session never each spend a timeout. A
    Store that failed a request or missed the deadline is *lost*: every request after
    that raises at once, naming the loss, and the Store is never tried again (a request
    stuck in c10d stays on the client's daemon thread, which holds nothing up at exit).
    """

    vocabulary: ClassVar[Vocabulary] = Vocabulary()
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

    def session_error(self, text: str) -> StoreSessionError:
        """The user's session error saying ``text``."""
        return self.vocabulary.session_error(text)

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
        phase = getattr(self._phase, "value", None) or self.vocabulary.user
        waits = fn is _store_method("wait")
        request = _Request(
            lambda: fn(self.store, *args),
            phase,
            owed_after=args[1].total_seconds() if waits else 0.0,
            waits=waits,
        )
        with self._changed:
            if self.lost is not None:
                raise self._lost_error(phase, again=True)
            self.requests += 1
            self._enqueue(request)
            self._await(request)
            if not request.done:
                raise self._lost_error(phase, again=False)
        if request.error is None:
            return request.value
        if request.waits:  # it ran out (anything else lost the Store)
            error = self.vocabulary.lost_error(f"a wait during {phase} ran out")
            raise error from request.error
        raise request.error

    def _enqueue(self, request: _Request) -> None:
        """Queue ``request`` (the caller holds ``_changed``), behind the connection's
        opening where none is open, and start the client's thread where none runs."""
        if self.store is None and not self._opening:
            self._opening = True
            self._queue.append(_Request(self._open, "connecting", connects=True))
        self._queue.append(request)
        if self._thread is None:
            thread = threading.Thread(
                target=self._work, name=f"{self.vocabulary.threads}-store", daemon=True
            )
            thread.start()
            self._thread = thread
        self._changed.notify_all()  # a thread waiting for work takes it

    def _await(self, request: _Request) -> None:
        """Wait (the caller holds ``_changed``) until ``request`` is done, or the Store
        is lost: by another request, or by the one in progress missing its deadline."""
        while not request.done and self.lost is None:
            current = self._current
            if current is None or current.started is None:
                self._changed.wait()
                continue
            overdue = current.started + current.owed_after + self.timeout
            if time.monotonic() >= overdue:
                self._lose(
                    current.phase,
                    f"no answer within {self.timeout:g} s "
                    f"({self.vocabulary.timeout_name})",
                    None,
                )
                return
            self._changed.wait(overdue - time.monotonic())

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
            except Exception as e:  # to its caller, or the Store is lost
                error = e
            with self._changed:
                self._current = None
                # After a loss what the request got does not matter: its caller raised.
                if self.lost is None:
                    if error is not None and _loses_the_store(request, error):
                        self._lose(request.phase, describe(error), error)
                    else:
                        request.value, request.error = value, error
                        request.done = True
                self._changed.notify_all()

    def _lose(self, phase: str, reason: str, cause: BaseException | None) -> None:
        """The Store is lost (the caller holds ``_changed``): every request in flight
        or queued raises, every later one at once."""
        self.lost = _Loss(phase, reason, time.monotonic(), cause)
        self._queue.clear()
        self._changed.notify_all()
        log.warning(
            "%s: the c10d Store (%s) stopped answering during %s: %s; "
            "this process does not try it again",
            self.vocabulary.user,
            self.address,
            phase,
            reason,
        )

    def _lost_error(self, phase: str, again: bool) -> StoreLostError:
        loss = self.lost
        assert loss is not None
        if again:
            text = (
                f"the c10d Store ({self.address}) stopped answering during "
                f"{loss.phase} {time.monotonic() - loss.at:.1f} s ago: {loss.reason}; "
                f"this process does not try it again ({phase})"
            )
        else:
            seen = "" if phase == loss.phase else f" (seen during {loss.phase})"
            text = (
                f"the c10d Store ({self.address}) stopped answering during {phase}: "
                f"{loss.reason}{seen}"
            )
        error = self.vocabulary.lost_error(text)
        error.__cause__ = loss.cause
        return error


def _loses_the_store(request: _Request, error: Exception) -> bool:
    """Whether ``request`` failing with ``error`` means the Store is lost: any failure
    to connect, any c10d error but a wait that ran out (anything else is the
    caller's)."""
    if request.connects:
        return True
    return isinstance(error, dist.DistError) and not (request.waits and _ran_out(error))


def _ran_out(error: BaseException) -> bool:
    """Whether a c10d error is a wait that ran out (a lost Store raises
    DistNetworkError)."""
    return isinstance(error, dist.DistStoreError) and not isinstance(
        error, dist.DistNetworkError
    )


def connect(timeout: float, client: type[StoreClient] = StoreClient) -> StoreClient:
    """A ``client`` of this job's default Store with ``timeout`` as its deadline.

    Over TCP a connection of its own, opened on the client's thread before its first
    request (a lost Store then ends every request within the timeout, not the job's
    Store timeout), its keys outside the job's prefixes; any other Store is shared.
    """
    default = dist.distributed_c10d._get_default_store()
    root = default
    while isinstance(root, dist.PrefixStore):
        root = root.underlying_store
    if not isinstance(root, dist.TCPStore):
        return client(default, type(root).__name__, timeout)
    host, port, libuv = root.host, root.port, root.libuvBackend

    def open_connection(seconds: float) -> Store:
        # The Store was up when the job started: a refused connection means it is gone,
        # which c10d would retry for twice the timeout.
        socket.create_connection((host, port), timeout=seconds).close()
        return dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=seconds),
            use_libuv=libuv,
        )

    return client(None, f"{host}:{port}", timeout, open_connection)


# -- liveness --------------------------------------------------------------------------


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
                    target=self._beat,
                    name=f"{self._client.vocabulary.threads}-heartbeat",
                    daemon=True,
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


def member_groups() -> list[str]:
    """The groups this process beats into: its process groups of more than one rank
    (any of them may hold a session that waits for this process's work)."""
    rank = dist.get_rank()
    return sorted(
        pg.group_name
        for pg, ranks in dist.distributed_c10d._world.pg_group_ranks.items()
        if rank in ranks and len(ranks) > 1
    )


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
    # Sessions this process joined (their Store prefixes): a second session of the same
    # key on the same group reads their decision instead of joining again.
    joined: set[str] = dataclasses.field(default_factory=set)
    # Decisions of each group read or published so far: a decision never changes.
    known: dict[str, str] = dataclasses.field(default_factory=dict)
    waited_s: float = 0.0


# -- waiting ---------------------------------------------------------------------------


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
        self,
        participant: Participant,
        group_name: str,
        members: Sequence[int],
        seconds: float,
    ) -> None:
        super().__init__(seconds)
        self._participant = participant
        self._group = group_name
        # The global rank of each group rank.
        self._members = list(members)
        self._last: int | None = None
        self._last_progress = time.monotonic()

    def look(self) -> None:
        """Read the group's progress; raise the session error if it aborted."""
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

    def aborted(self) -> StoreSessionError:
        client = self._participant.client
        reason = client.get(abort_key(self._participant.namespace, self._group))
        return client.session_error(
            f"{client.vocabulary.user} stopped on every rank of the group: "
            f"{reason.decode()}"
        )

    def last_heard(self, group_ranks: Sequence[int]) -> str:
        """What each of ``group_ranks`` was last heard doing, for an error message."""
        client = self._participant.client
        namespace = self._participant.namespace
        parts = []
        for r in group_ranks:
            doing = client.get_if_set(doing_key(namespace, self._members[r]))
            if doing is None:
                parts.append(f"group rank {r} never reported progress")
            else:
                parts.append(f"group rank {r} was last heard {doing.decode()}")
        since = time.monotonic() - self._last_progress
        parts.append(f"the group's last progress was {since:.1f} s ago")
        return "; ".join(parts)


def wait_until(participant: Participant, keys: list[str], silence: Silence) -> bool:
    """True once every key of ``keys`` is set; False once the group was silent past
    ``silence``. Raises the session error where the group aborted meanwhile. This
    rank is silent meanwhile: waiting is no progress."""
    began = time.monotonic()
    client = participant.client
    look_s = look_interval(silence.seconds)
    try:
        with participant.liveness.waiting():
            while True:
                if client.wait(keys, min(look_s, max(silence.remaining(), 0.001))):
                    return True
                silence.look()
                if silence.expired():
                    return False
    finally:
        participant.waited_s += time.monotonic() - began


# -- published values ------------------------------------------------------------------


class GroupDecisions:
    """The group's decision for each key, kept in the Store for the attempt.

    Kept under the group's ``scope`` (the user's digest of what the decisions hold
    for), so that no group for which they do not hold ever reads them. A decision is
    a string, the first one published for its key.
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
        """Propose ``value`` for ``key``; the value stored first, which every rank
        uses."""
        full = self._prefix + key
        client = self._participant.client
        with client.during(f"publishing the decision for {key}"):
            stored = client.compare_set(full, "", value).decode()
        self._participant.known[full] = stored
        return stored

    def wait(self, key: str) -> str | None:
        """The decision for ``key`` once published, or None if the group was silent
        for ``timeout`` before (any of its ranks may be the one that publishes)."""
        silence = Silence(self._participant, self._group, self._members, self._timeout)
        with self._participant.client.during(f"waiting for the decision for {key}"):
            if wait_until(self._participant, [self._prefix + key], silence):
                return self.get(key)
        return None


# -- one session -----------------------------------------------------------------------


class StoreSession:
    """The Store side of one session: one key's agreement on one process group."""

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
        # Whether this rank took part in the decision (it joined before the decision
        # was taken, or completed it), rather than reading one taken before.
        self.took_part = False

    # -- JOIN / DECIDE ---------------------------------------------------------------

    def agree(
        self,
        join: Any,
        decide: Callable[[list[Any]], Any],
        fallback: Callable[[str], Any],
    ) -> Any:
        """Post ``join`` (a JSON value) and return the session's decision.

        ``decide`` maps every rank's join (in group rank order) to a decision (a JSON
        value); it runs on the rank whose arrival completes the group. ``fallback``
        turns the reason why the group did not assemble into a decision; it runs on a
        rank whose deadline passed. Waits until the ranks not yet here were silent for
        ``timeout`` seconds. A rank that joined this session before reads its decision
        and does not take part.
        """
        client = self.participant.client
        with client.during(f"joining session {self.key}"):
            # By the session's Store prefix: the same key on another group is another
            # session.
            if self._prefix in self.participant.joined:
                return self._decided_before()
            self.participant.joined.add(self._prefix)
            self.took_part = True
            client.append(
                self._prefix + "joins", Message(self.rank, join).encode() + "\n"
            )
            if client.add(self._prefix + "arrived", 1) == self.world_size:
                joins = self._joins()
                decision = self._settle(
                    decide([joins[r] for r in range(self.world_size)])
                )
            else:
                decision = self._await_decision(fallback)
        self.participant.known[self._prefix + "decision"] = json.dumps(decision)
        return decision

    def _decided_before(self) -> Any:
        decided = self.participant.known.get(self._prefix + "decision")
        if decided is None:
            raise self.participant.client.session_error(
                f"session {self.key}: this rank joined it before and it ended without "
                f"a decision there (see that error)"
            )
        return _decode_value(decided)

    def _await_decision(self, fallback: Callable[[str], Any]) -> Any:
        """The decision once taken, or this rank's fallback proposal's outcome where
        the ranks not yet here were silent past the timeout."""
        client = self.participant.client
        silence = self._silence()
        if wait_until(self.participant, [self._prefix + "decision"], silence):
            return _decode_value(client.get(self._prefix + "decision"))
        absent = [r for r in range(self.world_size) if r not in self._joins()]
        return self._settle(
            fallback(
                f"group ranks {absent} did not arrive within {self.timeout:g} s "
                f"({client.vocabulary.timeout_name}) of the group's last sign of "
                f"progress: {silence.last_heard(absent)}"
            )
        )

    def _joins(self) -> dict[int, Any]:
        raw = self.participant.client.get(self._prefix + "joins").decode()
        return self._read(raw, "the joins")

    def _settle(self, proposal: Any) -> Any:
        # compare_set is the session's single linearization point: the first
        # proposal is stored, later ones get the stored value back.
        stored = self.participant.client.compare_set(
            self._prefix + "decision", "", json.dumps(proposal, sort_keys=True)
        )
        return _decode_value(stored)

    # -- VOTE ------------------------------------------------------------------------

    def vote(self, topic: str, value: Any) -> list[Any]:
        """Post this rank's ``value`` (a JSON value) for ``topic``; return every rank's
        value, by group rank.

        Waits until the ranks that did not vote were silent for ``timeout`` seconds
        (a rank that works beats); then raises the session error naming them, where
        they were last heard of, and what the others reported.
        """
        client = self.participant.client
        base = f"{self._prefix}vote/{self._topic_prefix}{topic}/"
        with client.during(f"the vote on {topic}"):
            client.append(base + "votes", Message(self.rank, value).encode() + "\n")
            silence = self._silence()
            if client.add(base + "count", 1) == self.world_size:
                client.set(base + "done", "1")
            elif not wait_until(self.participant, [base + "done"], silence):
                return self._late_votes(topic, base, silence)
            votes = self._read(client.get(base + "votes").decode(), topic)
        return [votes[r] for r in range(self.world_size)]

    def _late_votes(self, topic: str, base: str, silence: Silence) -> list[Any]:
        """Every rank's vote where all voted but the one to say so was slow; else the
        session error naming the silent ranks."""
        client = self.participant.client
        raw = client.get_if_set(base + "votes")
        votes = self._read(raw.decode() if raw is not None else "", topic)
        missing = [r for r in range(self.world_size) if r not in votes]
        if not missing:
            return [votes[r] for r in range(self.world_size)]
        raise client.session_error(
            f"{topic}: group ranks {missing} did not report and were silent for "
            f"{self.timeout:g} s ({client.vocabulary.timeout_name}); they are gone, or "
            f"stuck in a device collective. {silence.last_heard(missing)}. "
            f"Reports received: {votes}"
        )

    def _read(self, raw: str, what: str) -> dict[int, Any]:
        """The messages appended to a key, by group rank; the session error where one
        is malformed."""
        try:
            return Message.read_all(raw)
        except MalformedMessageError as e:
            error = self.participant.client.session_error(f"{what}: {e}")
            raise error from e

    def scoped(self, prefix: str) -> StoreSession:
        """This session, with ``prefix`` before every vote topic: the votes of one key
        among the several that a session agrees."""
        view = copy.copy(self)
        view._topic_prefix = f"{self._topic_prefix}{prefix}/"
        return view

    # -- ABORT -----------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Tell every rank of the group to stop; the first reason posted is kept."""
        client = self.participant.client
        namespace = self.participant.namespace
        with client.during("aborting"):
            client.compare_set(
                abort_key(namespace, self.group_name),
                "",
                f"group rank {self.rank}: {reason}",
            )
            client.add(progress_key(namespace, self.group_name), ABORTED)

    def check_abort(self) -> None:
        """Raise the session error if some rank aborted (one request)."""
        with self.participant.client.during("checking for an abort"):
            self._silence().look()

    def _silence(self) -> Silence:
        return Silence(self.participant, self.group_name, self.members, self.timeout)
