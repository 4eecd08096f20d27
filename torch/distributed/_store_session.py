"""Sessions over the c10d Store: a process group's ranks agree without a collective.

A session lets the ranks of one group agree (whether to go ahead, which implementation
to use) before any of them issues a device collective. It runs over the job's c10d
Store, whose operations have deadlines, so a late, absent or failed rank never leaves a
half-issued collective behind. Joins, decisions and votes are JSON values whose meaning
is the user's. Deadlines bound silence, not work: a wait ends ``timeout`` seconds after
its group's last progress (``Silence``), which working ranks beat (``Liveness``) and
waiting ranks do not. A Store that misses a deadline is lost for the whole process.
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

# An abort's increment of the progress counter: above any beat count, so one read
# tells both progress and abort.
ABORTED = 1 << 40


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

    user: str = "store session"
    threads: str = "store-session"
    timeout_name: str = "timeout"
    # The user's subclasses, so that the user's handlers catch what the protocol raises.
    session_error: type[StoreSessionError] = StoreSessionError
    lost_error: type[StoreLostError] = StoreLostError


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
    """How often a waiting rank looks at its group's progress and a working one beats:
    an eighth of the timeout, at least 1.5 s where the timeout allows, at most 5 s."""
    return min(max(timeout / 8, min(1.5, timeout / 2)), 5.0)


def attempt_namespace(root: str) -> str:
    """The Store namespace under ``root`` of this job attempt: torchrun hands a
    restarted attempt the same Store, and what one attempt agreed must not bind it."""
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


class WireMessage:
    """A frozen dataclass that travels as one JSON object. Reading checks each field
    against its annotation and raises ``malformed_error`` naming a field that fails."""

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
    """One rank's join or vote, with any JSON value; one JSON object per line."""

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


@dataclasses.dataclass
class _Request:
    """One request of a StoreClient, as its thread runs it."""

    call: Callable[[], Any]
    phase: str
    # Seconds the Store may take before its answer is owed: a wait's, or none.
    owed_after: float = 0.0
    waits: bool = False
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
    """This process's client of the job's Store for sessions; thread-safe. Counts its
    requests (a multi-key read counts once).

    c10d bounds neither connecting nor a request to a Store that stops answering, so
    requests run in order on the client's own daemon thread, and a caller waits at
    most ``timeout`` past when the answer in progress was owed. A Store that fails a
    request or misses that deadline is lost: every later request raises at once.
    """

    vocabulary: ClassVar[Vocabulary] = Vocabulary()
    # Idle seconds before the client's thread ends: cheaper than a thread per request.
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
        self._open_store = open_store
        self._opening = False
        self._phase = threading.local()
        self._changed = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._current: _Request | None = None
        self._thread: threading.Thread | None = None

    def session_error(self, text: str) -> StoreSessionError:
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
        """True once every key of ``keys`` is set; False after ``seconds``."""
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
    """Whether ``error`` loses the Store: any failure to connect, or any c10d error but
    a wait that ran out."""
    if request.connects:
        return True
    return isinstance(error, dist.DistError) and not (request.waits and _ran_out(error))


def _ran_out(error: BaseException) -> bool:
    """Whether a c10d error is a wait that ran out, not a lost Store."""
    return isinstance(error, dist.DistStoreError) and not isinstance(
        error, dist.DistNetworkError
    )


def connect(timeout: float, client: type[StoreClient] = StoreClient) -> StoreClient:
    """A ``client`` of this job's default Store with ``timeout`` as its deadline: over
    TCP a connection of its own, outside the job's prefixes; any other Store shared."""
    default = dist.distributed_c10d._get_default_store()
    root = default
    while isinstance(root, dist.PrefixStore):
        root = root.underlying_store
    if not isinstance(root, dist.TCPStore):
        return client(default, type(root).__name__, timeout)
    host, port, libuv = root.host, root.port, root.libuvBackend

    def open_connection(seconds: float) -> Store:
        # A refused connection means the Store is gone; c10d would keep retrying.
        socket.create_connection((host, port), timeout=seconds).close()
        return dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=seconds),
            use_libuv=libuv,
        )

    return client(None, f"{host}:{port}", timeout, open_connection)


class Liveness:
    """This process's heartbeat, so that its peers wait for it as long as it works.

    While it works, a daemon thread adds one to each group's progress counter every
    look interval and records what it does (for error messages); waiting is silent.
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
        """Beat, saying ``doing``, while the block runs. Without ``beat`` it only says:
        lockstep work (a benchmark) bounds itself and must not keep waits alive."""
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
    """The groups this process beats into: its process groups of more than one rank."""
    rank = dist.get_rank()
    return sorted(
        pg.group_name
        for pg, ranks in dist.distributed_c10d._world.pg_group_ranks.items()
        if rank in ranks and len(ranks) > 1
    )


@dataclasses.dataclass
class Participant:
    """One process as the protocol sees it, and what it has done so far."""

    client: StoreClient
    liveness: Liveness
    global_rank: int
    namespace: str
    store: Any = None
    # Store prefixes of sessions joined: joining one again reads its decision.
    joined: set[str] = dataclasses.field(default_factory=set)
    # Decisions of each group read or published so far: a decision never changes.
    known: dict[str, str] = dataclasses.field(default_factory=dict)
    waited_s: float = 0.0


class Silence(Deadline):
    """A deadline ``seconds`` after the last progress of the group waited for.

    Each look is one request, which also tells whether the group aborted. Silence
    counts from the first look, so a peer beating once a look interval gets two looks.
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
    ``silence``. Raises the session error where the group aborted meanwhile."""
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


class GroupDecisions:
    """The group's decision (a string, the first published) for each key, kept in the
    Store for the attempt under ``scope``, the user's digest of what they hold for."""

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
        """Propose ``value`` for ``key``; return the value stored first."""
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
        # False where this rank only read a decision taken before it joined.
        self.took_part = False

    def agree(
        self,
        join: Any,
        decide: Callable[[list[Any]], Any],
        fallback: Callable[[str], Any],
    ) -> Any:
        """Post ``join`` (a JSON value) and return the session's decision.

        ``decide`` maps the joins, in group rank order, to a decision on the rank that
        completes the group; ``fallback`` maps why the group did not assemble within
        ``timeout`` of silence to a decision. The first decision stored wins.
        """
        client = self.participant.client
        with client.during(f"joining session {self.key}"):
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
        # compare_set is the session's linearization point: the first proposal wins.
        stored = self.participant.client.compare_set(
            self._prefix + "decision", "", json.dumps(proposal, sort_keys=True)
        )
        return _decode_value(stored)

    def vote(self, topic: str, value: Any) -> list[Any]:
        """Post this rank's ``value`` for ``topic``; return every rank's, by group rank.
        Raises the session error naming the ranks silent for ``timeout`` seconds."""
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
