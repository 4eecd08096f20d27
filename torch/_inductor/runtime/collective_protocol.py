"""Cross-rank agreement for collective custom-op autotuning, over the c10d Store.

Autotuning a collective op is a *session*: one op, one process group, every rank of
that group. Before any rank issues a device collective the group agrees, over the
c10d Store, on what the session will do. The Store is used because its operations
have real deadlines and leave NCCL/gloo untouched, so a late, absent or failed rank
can never leave a half-issued device collective behind.

States of one session, as seen by one rank::

    JOIN       set  join/<rank> = what this rank is about to tune; add arrived += 1
    DECIDE     the rank whose arrival completes the group proposes a decision computed
               from all joins; a rank whose arrival deadline passes proposes a fallback.
               compare_set on `decision` keeps the first proposal only, and every rank,
               including one arriving after the deadline, adopts the stored value.
    VOTE       (benchmark decisions only) after each step that may fail, every rank
               posts its outcome under vote/<topic>/<rank> and reads everybody's; so a
               failure anywhere is a failure everywhere.
    ABORT      a rank that finds the group's collectives untrustworthy (a device
               collective timed out, a peer vanished) posts `abort` before raising;
               every rank waiting in this session raises too, naming that reason.
    CLOSE      add done += 1; the rank completing the group deletes the session's keys.

Deadlines (each is ``timeout`` seconds, ``collective_benchmark_timeout``):

    * JOIN/DECIDE: from this rank's arrival. A rank arriving later reads the decision
      and follows it at once, without a wait of its own.
    * VOTE: from the moment this rank posts its own outcome. A rank that cannot vote
      in time (blocked in a device collective, or dead) makes the session fail with
      a CollectiveAutotuneError on every rank that can still vote.
    * Device work of the benchmark (collective_benchmarking) is bounded by the same
      timeout, and ends in ABORT when it passes.

Keys live under ``collective_autotune/<group name>/<session key>/`` of the default
store, the session key being the op's digest and a session number (see
session_number); a session abandoned by a rank that never arrives leaves its few
keys behind, and each op keeps one ``latest/<op>`` key for the job's lifetime.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable, Optional, TYPE_CHECKING


if TYPE_CHECKING:
    from torch.distributed import Store


log = logging.getLogger(__name__)

_NAMESPACE = "collective_autotune"
# Polling interval bounds while waiting on store keys: short enough that a ready
# group proceeds within about a millisecond, long enough not to load the store.
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.05


class CollectiveAutotuneError(RuntimeError):
    """The group can no longer agree or its collectives can no longer be trusted."""


@dataclasses.dataclass(frozen=True)
class Join:
    """What one rank is about to tune, as posted to the store."""

    rank: int
    fingerprint: str
    choices: tuple[str, ...]
    # Names of the choices that this rank could build (compile) locally.
    runnable: tuple[str, ...]

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def decode(raw: bytes) -> Join:
        d = json.loads(raw)
        return Join(d["rank"], d["fingerprint"], tuple(d["choices"]), tuple(d["runnable"]))


@dataclasses.dataclass(frozen=True)
class Decision:
    """The one decision of a session, identical on every rank.

    ``benchmark``: time ``choices`` (in this order) on every rank.
    ``use``: take ``choices[0]`` without timing anything.
    """

    kind: str
    choices: tuple[str, ...]
    reason: str

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def decode(raw: bytes) -> Decision:
        d = json.loads(raw)
        return Decision(d["kind"], tuple(d["choices"]), d["reason"])


class Deadline:
    """A point in (monotonic) time that a wait must not pass."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end


def session_number(store: Store, group_name: str, op_key: str, local_next: int) -> int:
    """The number of this rank's next session for ``op_key`` on the group.

    Ranks count their own sessions, so the k-th session of one rank meets the k-th of
    its peers. A rank that tuned an op alone (its peers never compiled it) would
    otherwise stay one session ahead of them for good; the group's newest number,
    kept in the store, lets the others catch up. A rank that is merely late joins the
    number it counted and so reads the decision it missed.
    """
    import torch.distributed as dist

    latest = dist.PrefixStore(f"{_NAMESPACE}/{group_name}/latest/", store)
    while True:  # publish max(local_next, newest) unless a peer raced ahead meanwhile
        current = latest.get(op_key).decode() if latest.check([op_key]) else ""
        number = max(local_next, int(current or 0))
        if str(number) == current:
            return number
        if latest.compare_set(op_key, current, str(number)) == str(number).encode():
            return number


class CollectiveSession:
    """The store side of one autotuning session of one op on one process group."""

    def __init__(
        self,
        store: Store,
        group_name: str,
        session_key: str,
        rank: int,
        world_size: int,
        timeout: float,
    ) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._store = dist.PrefixStore(
            f"{_NAMESPACE}/{group_name}/{session_key}/", store
        )
        self._keys: set[str] = {"arrived", "decision", "done", "abort"}

    # -- JOIN / DECIDE ----------------------------------------------------------

    def agree(
        self,
        join: Join,
        decide: Callable[[list[Join]], Decision],
        fallback: Callable[[str], Decision],
    ) -> Decision:
        """Post ``join`` and return the session's decision.

        ``decide`` maps every rank's join to a decision; it runs on the rank whose
        arrival completes the group. ``fallback`` turns the reason why the group did
        not assemble into a decision; it runs on a rank whose deadline passed.
        Waits at most ``timeout`` seconds from now.
        """
        deadline = Deadline(self.timeout)
        self._keys.update(self._join_key(r) for r in range(self.world_size))
        late = self._read("decision")
        if late is not None:
            log.info(
                "rank %d arrived after the session was decided; following it", self.rank
            )
            return Decision.decode(late)
        self._store.set(self._join_key(self.rank), join.encode())
        if self._store.add("arrived", 1) >= self.world_size:
            joins = [
                Join.decode(raw)
                for raw in self._store.multi_get(
                    [self._join_key(r) for r in range(self.world_size)]
                )
            ]
            return self._settle(decide(joins))
        # Wait for the rank that completes the group to publish the decision.
        if self._poll(["decision"], deadline):
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
        stored = self._store.compare_set("decision", "", proposal.encode())
        return Decision.decode(stored)

    # -- VOTE -------------------------------------------------------------------

    def vote(self, topic: str, outcome: str) -> list[str]:
        """Post this rank's ``outcome`` for ``topic``; return every rank's outcome.

        Waits at most ``timeout`` seconds; raises CollectiveAutotuneError naming the
        ranks that did not vote and what the others reported.
        """
        keys = [f"vote/{topic}/{r}" for r in range(self.world_size)]
        self._keys.update(keys)
        self._store.set(keys[self.rank], outcome)
        if not self._poll(keys, Deadline(self.timeout), abortable=True):
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise CollectiveAutotuneError(
                f"{topic}: group ranks {missing} did not report within "
                f"{self.timeout:g} s (collective_benchmark_timeout); they are blocked "
                f"in a device collective or gone. Reports received: "
                f"{self.peer_reports(topic)}"
            )
        return [raw.decode() for raw in self._store.multi_get(keys)]

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
        for r in range(self.world_size):
            raw = self._read(f"vote/{topic}/{r}")
            if raw is not None:
                reports[r] = raw.decode()
        return reports

    # -- CLOSE ------------------------------------------------------------------

    def close(self) -> None:
        """Mark this rank done; the last rank of the group deletes the keys."""
        if self._store.add("done", 1) >= self.world_size:
            for key in self._keys:
                self._store.delete_key(key)

    # -- helpers ----------------------------------------------------------------

    @staticmethod
    def _join_key(rank: int) -> str:
        return f"join/{rank}"

    def _read(self, key: str) -> Optional[bytes]:
        return self._store.get(key) if self._store.check([key]) else None

    def _poll(self, keys: list[str], deadline: Deadline, abortable: bool = False) -> bool:
        """True once all ``keys`` exist; False if ``deadline`` passes first."""
        interval = _POLL_MIN_S
        while not self._store.check(keys):
            if abortable:
                self.check_abort()
            if deadline.expired():
                return False
            time.sleep(min(interval, deadline.remaining()))
            interval = min(interval * 2, _POLL_MAX_S)
        return True
