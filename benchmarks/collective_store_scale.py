"""The c10d Store's load from collective autotuning's session protocol, at many ranks.

    python benchmarks/collective_store_scale.py --out benchmarks/results/store_scale_cpu.json
    python benchmarks/collective_store_scale.py --quick --out /tmp/store_scale.json  # ~30 s

Every simulated rank is a thread with a TCPStore client of its own, all on one real
TCPStore server (libuv backend) in this process, and runs what one graph's compile costs
the Store on its group (kernel/collective/graph_sessions.py), with sleeps standing in for tracing,
building and benchmarking (no device collectives, no Inductor):

    the compile beats (Liveness.working, as Dynamo's compile callback does), then
    JOIN/DECIDE        StoreSession.agree, one per graph and group
    per key, K times:  a read of the group's decision before tracing
                       (GroupDecisions.get); for a benchmarked key the build (beating:
                       with nothing stored on disk a rank builds before it votes); the
                       VOTE on ``site/<key>`` (its report reuses the read); for a
                       benchmarked key the benchmark (a step that says what it does
                       without beating); then PUBLISH (GroupDecisions.publish)

A rank's heartbeat beats into each of its groups of more than one rank, as
``_member_groups`` does: its group, and the world where the group is not the world.

Each request is recorded (``StoreClient._request`` wrapped: time, operation, key), so the
cost of each message is known, as are the requests made while a rank waits
(``Liveness.waiting`` wrapped). What the server handles is more than the client's
requests: c10d's ``get`` is a WAIT then a GET, and a wait that times out is a WAIT then a
CANCEL_WAIT; both are counted as *server messages*. The server thread's CPU time comes
from /proc, so the server's cost per message is measured, not guessed.

Scenarios: groups of 8 at 64, 512 and as many ranks as the machine carries, and one group
of 64 ranks; each with every rank on time (behind one barrier), and with one rank of each
group late to the JOIN by 2.5 look intervals (its peers wait, silent, in slices). A sweep
of the timeout shows a waiting rank's request rate against the look interval, and a
microbenchmark measures the server's cost per request. Results go to ``--out`` as JSON,
with the machine, the torch version and the code's git commit; a table is printed.

The protocol module is the repository's own (torch/distributed/_store_session.py, the
generic Store session protocol that Inductor's collective_protocol builds on): the
installed torch's when tools/overlay.py linked it there, else loaded from the file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any
from collections.abc import Callable, Iterator, Sequence


# c10d logs a warning for every wait that times out; a waiting rank's waits time out by
# design, once per look interval. Must be set before torch loads its C++ side.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# c10d looks up the peer's name of every new connection (getnameinfo, on the client and on
# the server's loop thread); ::ffff:127.0.0.1 is not in /etc/hosts, so each is a DNS query,
# and a resolver that drops one stalls that connect for the resolver's timeout (5 s by
# default; on some sandboxes one query in ~25). Read when the resolver first starts.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import torch
import torch.distributed as dist


REPO = Path(__file__).resolve().parents[1]
PROTOCOL_FILE = REPO / "torch" / "distributed" / "_store_session.py"
PROTOCOL_MODULE = "torch.distributed._store_session"
# The name the repository's file is loaded under when the installed torch does not have it.
PRIVATE_MODULE = "_store_session_under_test"
HOST = "127.0.0.1"
# Where the simulated sessions keep their keys (a fresh server per scenario).
NAMESPACE = "collective_autotune/store_scale"


def load_protocol() -> ModuleType:
    """The repository's protocol module.

    Where tools/overlay.py linked the repository's torch/ into the installed torch, the
    installed module is the repository's file: import it normally, so that this code and
    Inductor's share one module. Otherwise (a pristine torch, which has no such module)
    load the file under a private name, leaving the installed torch untouched.
    """
    installed = (
        Path(torch.__file__).resolve().parent / "distributed" / PROTOCOL_FILE.name
    )
    if installed.exists() and os.path.samefile(installed, PROTOCOL_FILE):
        return importlib.import_module(PROTOCOL_MODULE)
    if PRIVATE_MODULE in sys.modules:
        return sys.modules[PRIVATE_MODULE]
    spec = importlib.util.spec_from_file_location(PRIVATE_MODULE, PROTOCOL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_MODULE] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


protocol = load_protocol()


# -- what one rank's requests were ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a rank's Store client."""

    t: float  # time.monotonic() when it was sent
    op: str  # the c10d Store method: set, get, add, append, check, compare_set, wait
    message: str  # the protocol message it belongs to (see message_of)
    # What the server handled for it: a get is a WAIT then a GET, a wait that timed out a
    # WAIT then a CANCEL_WAIT (c10d's TCPStore client); anything else one message.
    server_messages: int
    # Value bytes it carried, both ways (keys left out): what a vote's read grows with.
    payload: int


def message_of(op: str, key: str, amount: int | None) -> str:
    """The protocol message that a request on ``key`` belongs to, from the key's layout
    (_store_session: ``<namespace>/<group>/session/<plan>/...``, ``.../progress``,
    ``.../decided/<scope>/<key>``, ``<namespace>/doing/<rank>``)."""
    if "/vote/" in key:
        topic = key.rsplit("/", 1)[0]
        return "VOTE build" if topic.endswith("/build") else "VOTE site"
    if "/session/" in key:
        return "JOIN/DECIDE"
    if key.endswith("/progress"):
        return "look" if amount == 0 else "heartbeat"
    if "/decided/" in key:
        return "PUBLISH" if op == "compare_set" else "decision read"
    if "/doing/" in key:
        return "doing"
    if key.endswith("/abort"):
        return "ABORT"
    return "other"


class RecordingClient(protocol.StoreClient):
    """The protocol's Store client, recording each request as it is sent.

    ``requests`` is the protocol's own counter; ``log`` is kept too because the heartbeat
    thread and the main thread share the client (list.append is atomic, ``+= 1`` on an
    attribute is not).
    """

    def __init__(self, store: Any, address: str, timeout: float) -> None:
        super().__init__(store, address, timeout)
        self.log: list[Request] = []

    def _request(self, fn: Callable[..., Any], *args: Any) -> Any:
        op = getattr(fn, "__name__", "?")
        key = args[0][0] if isinstance(args[0], list) else args[0]
        amount = args[1] if op == "add" else None
        payload = sum(len(a) for a in args[1:] if isinstance(a, (str, bytes)))
        sent = time.monotonic()
        timed_out = False
        try:
            result = super()._request(fn, *args)
            payload += len(result) if isinstance(result, bytes) else 0
            return result
        except protocol.StoreLostError as e:
            timed_out = op == "wait" and not isinstance(
                e.__cause__, dist.DistNetworkError
            )
            raise
        finally:
            server = 2 if op == "get" or timed_out else 1
            self.log.append(
                Request(sent, op, message_of(op, key, amount), server, payload)
            )


class RecordingLiveness(protocol.Liveness):
    """The protocol's heartbeat, recording when this rank waits for its peers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits: list[tuple[float, float]] = []

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        began = time.monotonic()
        try:
            with super().waiting():
                yield
        finally:
            self.waits.append((began, time.monotonic()))


# -- the simulation ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StandIns:
    """Seconds that sleeps stand in for, per key: what the real compile does there."""

    trace_s: float = 0.002  # tracing the key's choices
    build_s: float = 0.005  # compiling them (beats)
    bench_s: float = 0.005  # benchmarking them on the device (silent: it bounds itself)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One simulated job: ``ranks`` ranks in groups of ``group_size`` consecutive ranks,
    each rank compiling one graph that holds ``keys`` distinct keys on its group."""

    name: str
    ranks: int
    group_size: int
    keys: int = 4
    # How many of the keys are benchmarked (built, then a benchmark): in a fresh job every
    # key nobody decided yet is.
    benchmarked: int = 4
    # collective_benchmark_timeout; the look interval is look_interval(timeout).
    timeout: float = 30.0
    # Where > 0, the last rank of each group starts its JOIN this many seconds late.
    late_s: float = 0.0

    @property
    def look_s(self) -> float:
        return protocol.look_interval(self.timeout)


@dataclasses.dataclass
class RankRun:
    """What one simulated rank did."""

    rank: int
    group: int
    late: bool
    start: float = 0.0
    end: float = 0.0
    error: str = ""
    # The rank's client and heartbeat, read once the scenario is over: a heartbeat that
    # its thread decided on before the compile ended can still be sent after it.
    client: Any = None
    liveness: Any = None

    @property
    def counted(self) -> int:
        """The protocol's own count, StoreClient.requests (counted before sending)."""
        return self.client.requests

    @property
    def log(self) -> list[Request]:
        """Each request, recorded once answered."""
        return self.client.log

    @property
    def waits(self) -> list[tuple[float, float]]:
        return self.liveness.waits


SETTINGS = {"collective_benchmark_timeout": 30.0, "collective_benchmark_rounds": 20}


def _report(key: str, decided: str | None) -> dict:
    """A site report of the size the real one has (kernel/collective/graph_sessions.py:SiteReport)."""
    labels = ["default", "one_all_reduce", "symm_mem_one_shot", "symm_mem_two_shot"]
    return {
        "key": key,
        "choices": labels,
        "decided": decided,
        "stored": None,
        "stored_winner": None,
        "failed": {},
    }


def compile_graph(
    sc: Scenario,
    stand_ins: StandIns,
    run: RankRun,
    client: Any,
    liveness: Any,
) -> None:
    """What compiling one graph costs the Store on this rank's group, in the order
    kernel/collective/graph_sessions.py issues it."""
    member = protocol.Participant(client, liveness, run.rank, NAMESPACE)
    group = _group_name(sc, run.group)
    members = list(range(run.group * sc.group_size, (run.group + 1) * sc.group_size))
    group_rank = run.rank - members[0]
    # Dynamo's compile callback beats for the whole compile (kernel/collective/dynamo_callbacks.py).
    with liveness.working("compiling graph 0"):
        if run.late:
            time.sleep(sc.late_s)
        session = protocol.StoreSession(
            member, group, "plan0", group_rank, members, sc.timeout
        )
        decision = session.agree(
            {"loaded": "", "settings": SETTINGS},
            decide=lambda joins: {"kind": "compile", "reason": "compile"},
            fallback=lambda why: {"kind": "fallback", "reason": why},
        )
        if decision["kind"] != "compile":
            raise RuntimeError(f"rank {run.rank}: the session decided {decision}")
        decisions = protocol.GroupDecisions(
            member, group, members, "scope0", sc.timeout
        )
        for k in range(sc.keys):
            key = f"key{k}"
            decisions.get(key)  # collective/selection.py:decided_before_tracing
            time.sleep(stand_ins.trace_s)
            # Nothing stored on disk: _vote_key builds the choices first and votes once,
            # the report (_SiteWork.report) reusing what was read (decisions.known).
            if k < sc.benchmarked:
                with liveness.working(f"compiling the choices of site/{key}"):
                    time.sleep(stand_ins.build_s)
            session.vote(f"site/{key}", _report(key, decisions.known(key)))
            if k < sc.benchmarked:
                # collective_benchmarking's _running: says what it does, does not beat.
                with liveness.working(f"benchmarking the choices of {key}", beat=False):
                    time.sleep(stand_ins.bench_s)
            decisions.publish(key, json.dumps(["one_all_reduce", False]))  # settle_key


def _group_name(sc: Scenario, group: int) -> str:
    return f"tp{group}" if sc.group_size < sc.ranks else "world"


def _member_groups(sc: Scenario, group: int) -> list[str]:
    """The groups this rank beats into: its group, and the world where that is another
    group (_store_session.member_groups: every group of more than one rank)."""
    return sorted({_group_name(sc, group), "world"})


def _rank_main(
    sc: Scenario,
    stand_ins: StandIns,
    run: RankRun,
    store: Any,
    address: str,
    start: threading.Barrier,
) -> None:
    run.client = client = RecordingClient(store, address, sc.timeout)
    groups = _member_groups(sc, run.group)
    run.liveness = liveness = RecordingLiveness(
        client, NAMESPACE, run.rank, lambda: groups
    )
    start.wait()
    run.start = time.monotonic()
    try:
        compile_graph(sc, stand_ins, run, client, liveness)
    except Exception as e:
        run.error = f"{type(e).__name__}: {e}"
    run.end = time.monotonic()


# -- the machine --------------------------------------------------------------------------


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _thread_cpu_s(tids: Sequence[int]) -> float:
    """CPU seconds the threads ``tids`` of this process have run (/proc schedstat, ns)."""
    total = 0
    for tid in tids:
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


def _connections_to(port: int) -> int:
    """Established TCP connections to ``port`` on this machine (/proc/net/tcp{,6})."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                remote, state = fields[2], fields[3]
                n += int(remote.rsplit(":", 1)[1], 16) == port and state == "01"
    return n


class Server:
    """The one TCPStore server (libuv), in this process; its thread's CPU time is known
    because it is the one thread that starting it adds."""

    def __init__(self) -> None:
        before = _threads()
        self.store = dist.TCPStore(
            HOST, 0, is_master=True, wait_for_workers=False, use_libuv=True
        )
        self.tids = sorted(_threads() - before)
        self.port = self.store.port
        self.address = f"{HOST}:{self.port}"

    def cpu_s(self) -> float:
        return _thread_cpu_s(self.tids)

    def connections(self) -> int:
        """Clients connected to it, its own (the master's) included."""
        return _connections_to(self.port)

    def client(self, timeout: float) -> Any:
        return dist.TCPStore(
            HOST,
            self.port,
            is_master=False,
            timeout=timedelta(seconds=timeout),
            use_libuv=True,
        )

    def clients(self, n: int, timeout: float) -> list[Any]:
        """``n`` clients, connected side by side: a connect that stalls in its name
        lookup (above) then holds up only itself."""
        with ThreadPoolExecutor(max_workers=min(64, n)) as pool:
            return list(pool.map(lambda _: self.client(timeout), range(n)))


def _wait_for_heartbeats(seconds: float) -> None:
    """Let the heartbeat threads end (each does at its next look, without a request), so
    that the next scenario starts on a quiet machine."""
    deadline = time.monotonic() + seconds
    for t in threading.enumerate():
        if t.name.endswith("-heartbeat"):
            t.join(max(0.0, deadline - time.monotonic()))


# -- one scenario -------------------------------------------------------------------------


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "max": ordered[-1],
        "min": ordered[0],
    }


def waiting_rate(run: RankRun, look_s: float) -> tuple[int, float, int]:
    """The requests this rank sent while it waited, in waits that outlasted one look
    interval, those waits' seconds, and the heartbeats among them.

    Short waits (a lockstep vote's single wait) are left out: one request over a
    millisecond is no rate. Heartbeats are not counted as waiting: the heartbeat is
    silent while its rank waits, but a beat that its thread decided on just before the
    wait began can land inside it (counted apart, to show that it is only that).
    """
    long_waits = [(a, b) for a, b in run.waits if b - a >= look_s]
    inside = [r for r in run.log for a, b in long_waits if a <= r.t <= b]
    beats = sum(1 for r in inside if r.message == "heartbeat")
    return len(inside) - beats, sum(b - a for a, b in long_waits), beats


@contextlib.contextmanager
def gil_switch_interval(seconds: float) -> Iterator[None]:
    """CPython's switch interval set to ``seconds`` for the block.

    A simulated rank is a thread; a real one is a process with a GIL of its own. A thread
    waiting for the GIL wakes every switch interval (5 ms by default) to ask for it: with
    thousands waiting, those wake-ups alone took both cores here, requests cost 1.2 ms of
    CPU instead of 0.2 ms, and some ranks got no GIL for longer than the timeout (their
    groups then failed, as the protocol says for a silent rank). The ranks give the GIL up
    at every Store request anyway, so a long interval costs them nothing.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run_scenario(sc: Scenario, stand_ins: StandIns) -> dict[str, Any]:
    """Run ``sc`` on a fresh server; its measurements."""
    with gil_switch_interval(0.5):
        return _run_scenario(sc, stand_ins)


def _run_scenario(sc: Scenario, stand_ins: StandIns) -> dict[str, Any]:
    server = Server()
    began = time.monotonic()
    stores = server.clients(sc.ranks, sc.timeout)
    connect_s = time.monotonic() - began
    connections = server.connections()
    runs = [
        RankRun(
            r,
            r // sc.group_size,
            sc.late_s > 0 and r % sc.group_size == sc.group_size - 1,
        )
        for r in range(sc.ranks)
    ]
    start = threading.Barrier(sc.ranks + 1)
    threads = [
        threading.Thread(
            target=_rank_main,
            args=(sc, stand_ins, run, store, server.address, start),
            name=f"rank{run.rank}",
        )
        for run, store in zip(runs, stores)
    ]
    for t in threads:
        t.start()
    cpu0, server_cpu0 = time.process_time(), server.cpu_s()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    wall_s = max(run.end for run in runs) - t0
    cpu_s, server_cpu_s = time.process_time() - cpu0, server.cpu_s() - server_cpu0
    errors = [run.error for run in runs if run.error]
    del stores, threads
    result = _summarise(sc, runs, t0, wall_s, server_cpu_s)
    result.update(
        connections={
            "simulated_ranks": sc.ranks,
            "benchmark_process": 1,
            "measured": connections,
        },
        connect_s=connect_s,
        process_cpu_s=cpu_s,
        process_cpu_per_wall=cpu_s / wall_s,
        errors=errors[:5],
        failed_ranks=len(errors),
    )
    return result


def _summarise(
    sc: Scenario, runs: list[RankRun], t0: float, wall_s: float, server_cpu_s: float
) -> dict[str, Any]:
    # The protocol's own counters are the count; the logs say what each request was for.
    per_rank = [run.counted for run in runs]
    logged = [len(run.log) for run in runs]
    server_msgs = [sum(r.server_messages for r in run.log) for run in runs]
    payload = [sum(r.payload for r in run.log) for run in runs]
    total, total_msgs = sum(per_rank), sum(server_msgs)
    by_message: dict[str, float] = {}
    for run in runs:
        for r in run.log:
            by_message[r.message] = by_message.get(r.message, 0) + 1
    # Per key: what the K keys' messages cost a rank, without the JOIN and the heartbeat
    # (a rate over the compile's time, not a count per key); and everything over K.
    per_key_messages = ("decision read", "VOTE site", "VOTE build", "doing", "PUBLISH")
    own = [
        sum(1 for r in run.log if r.message in per_key_messages)
        for run in runs
        if not run.late
    ]
    groups: dict[int, list[RankRun]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    session_s = [
        max(r.end for r in g) - min(r.start for r in g) for g in groups.values()
    ]
    # The server's busiest 100 ms.
    bins: dict[int, int] = {}
    for run in runs:
        for r in run.log:
            tenth = int((r.t - t0) * 10)
            bins[tenth] = bins.get(tenth, 0) + 1
    result: dict[str, Any] = {
        "scenario": dataclasses.asdict(sc),
        "look_interval_s": sc.look_s,
        "wall_s": wall_s,
        "requests_per_rank_session": _quantiles(per_rank),
        # Requests counted but not yet answered when this was read (heartbeats in flight).
        "requests_in_flight_at_end": total - sum(logged),
        "requests_per_rank_per_key": {
            k: v / sc.keys for k, v in _quantiles(per_rank).items()
        },
        "key_messages_per_rank_per_key": {
            k: v / sc.keys for k, v in _quantiles(own).items()
        },
        "by_message_per_rank": {m: n / sc.ranks for m, n in sorted(by_message.items())},
        "server_messages_per_rank_session": _quantiles(server_msgs),
        "payload_bytes_per_rank_session": _quantiles(payload),
        "requests_total": total,
        "server_messages_total": total_msgs,
        "requests_per_s": total / wall_s,
        "server_messages_per_s": total_msgs / wall_s,
        "peak_requests_per_s_100ms": 10 * max(bins.values()),
        "server_cpu_s": server_cpu_s,
        "server_cpu_us_per_message": 1e6 * server_cpu_s / total_msgs,
        "server_busy_fraction": server_cpu_s / wall_s,
        "session_s_per_group": _quantiles(session_s),
    }
    waiting = [waiting_rate(run, sc.look_s) for run in runs if not run.late]
    waiting = [(n, s, beats) for n, s, beats in waiting if s > 0]
    if waiting:
        rates = [n / s for n, s, _ in waiting]
        result["waiting"] = {
            "ranks": len(waiting),
            "seconds": _quantiles([s for _, s, _ in waiting]),
            "requests_per_s": _quantiles(rates),
            "heartbeats_inside_waits": sum(beats for _, _, beats in waiting),
            # c10d: each timed-out slice is a WAIT and a CANCEL_WAIT, then the look's ADD.
            "server_messages_per_s_model": 3 / sc.look_s,
            "requests_per_look_interval": statistics.fmean(rates) * sc.look_s,
        }
    return result


# -- the server's cost per request ------------------------------------------------------


def measure_server_cost(
    server: Server, requests: int, clients: Sequence[int]
) -> list[dict]:
    """What one request costs this machine's libuv TCPStore server: ``requests`` adds from
    one client (latency), gets from one client (a WAIT and a GET each), and ``requests``
    adds spread over each count of concurrent clients (throughput), with the server
    thread's CPU time per request."""
    rows = []

    def measure(
        what: str, n_clients: int, n: int, op: Callable[[Any, int], Any], msgs: int
    ):
        stores = server.clients(n_clients, 30.0)
        go = threading.Barrier(n_clients + 1)

        def work(store: Any) -> None:
            go.wait()
            for i in range(n // n_clients):
                op(store, i)

        threads = [threading.Thread(target=work, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        cpu0 = server.cpu_s()
        go.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
        cpu = server.cpu_s() - cpu0
        done = (n // n_clients) * n_clients
        rows.append(
            {
                "what": what,
                "clients": n_clients,
                "requests": done,
                "wall_s": wall,
                "requests_per_s": done / wall,
                "us_per_request_wall": 1e6 * wall / done * n_clients,
                "server_cpu_us_per_request": 1e6 * cpu / done,
                "server_cpu_us_per_message": 1e6 * cpu / (done * msgs),
                "server_busy_fraction": cpu / wall,
            }
        )

    server.store.set("cost/value", "x" * 64)
    measure("add", 1, requests, lambda s, i: s.add("cost/counter", 1), 1)
    measure("get", 1, requests // 4, lambda s, i: s.get("cost/value"), 2)
    for n in clients:
        measure("add", n, requests, lambda s, i: s.add("cost/counter", 1), 1)
    return rows


# -- the run ---------------------------------------------------------------------------


# How many look intervals a late rank is late. Not a whole number: a waiter's slices start
# when it arrives, so a whole number would end the wait just as a slice does (one look
# fewer, or one more, by a hair); halfway, a wait of k.5 intervals holds 2k + 1 requests,
# 2 per interval on average, which is the protocol's documented bound.
LATE_LOOKS = 2.5


def scenarios(quick: bool, max_ranks: int, max_late_ranks: int) -> list[Scenario]:
    """Every rank on time, and one rank per group late to the JOIN by LATE_LOOKS look
    intervals of the timeout (the default's, 30 s), per topology: groups of 8 at 64, 512 and the
    most ranks, and one group of 64 (data-parallel sized)."""
    if quick:
        on_time, late = [(16, 8), (64, 8)], [(16, 8), (64, 8)]
        late_timeout = 4.0
    else:
        on_time = [(64, 8), (512, 8), (max_ranks, 8), (64, 64)]
        late = [(64, 8), (512, 8), (max_late_ranks, 8), (64, 64)]
        late_timeout = 30.0
    late_s = LATE_LOOKS * protocol.look_interval(late_timeout)
    return [
        *(Scenario(f"{n}r_g{g}_on_time", n, g) for n, g in on_time),
        *(
            Scenario(f"{n}r_g{g}_late", n, g, timeout=late_timeout, late_s=late_s)
            for n, g in late
        ),
    ]


def timeout_sweep(quick: bool) -> list[Scenario]:
    """A waiting rank's rate against the look interval: 16 ranks, groups of 8, one rank
    per group late by LATE_LOOKS look intervals."""
    timeouts = (2.0, 8.0) if quick else (2.0, 4.0, 8.0, 16.0, 30.0)
    return [
        Scenario(
            f"16r_g8_late_timeout{t:g}",
            16,
            8,
            timeout=t,
            late_s=LATE_LOOKS * protocol.look_interval(t),
        )
        for t in timeouts
    ]


def machine() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    try:
        with open("/proc/cpuinfo") as f:
            models = [
                ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")
            ]
        model = models[0] if models else ""
    except OSError:
        model = ""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "protocol_module": protocol.__name__,
        "git_commit": git("rev-parse", "HEAD"),
        # Whether the code that made the numbers differs from that commit.
        "git_dirty": bool(
            git(
                "status",
                "--porcelain",
                "--",
                str(Path(__file__).resolve()),
                str(PROTOCOL_FILE),
            )
        ),
        "loadavg_at_start": os.getloadavg(),
    }


# The printed table: (heading, format, value of a scenario's result).
COLUMNS: list[tuple[str, str, Callable[[dict[str, Any]], Any]]] = [
    ("scenario", "<28", lambda r: r["scenario"]["name"]),
    ("ranks", ">5", lambda r: r["scenario"]["ranks"]),
    ("grp", ">4", lambda r: r["scenario"]["group_size"]),
    ("look", ">5.2f", lambda r: r["look_interval_s"]),
    ("req/rk", ">6.1f", lambda r: r["requests_per_rank_session"]["mean"]),
    ("max", ">4", lambda r: r["requests_per_rank_session"]["max"]),
    ("/key", ">6.2f", lambda r: r["requests_per_rank_per_key"]["mean"]),
    ("max", ">6.2f", lambda r: r["requests_per_rank_per_key"]["max"]),
    ("srvmsg", ">6.1f", lambda r: r["server_messages_per_rank_session"]["mean"]),
    ("req/s", ">7.0f", lambda r: r["requests_per_s"]),
    ("peak", ">7.0f", lambda r: r["peak_requests_per_s_100ms"]),
    ("us/msg", ">6.1f", lambda r: r["server_cpu_us_per_message"]),
    ("p50 s", ">6.2f", lambda r: r["session_s_per_group"]["p50"]),
    ("max s", ">6.2f", lambda r: r["session_s_per_group"]["max"]),
    ("conns", ">5", lambda r: r["connections"]["measured"]),
    (
        "wait/s",
        ">6.2f",
        lambda r: r.get("waiting", {}).get("requests_per_s", {}).get("mean"),
    ),
    (
        "max",
        ">5.2f",
        lambda r: r.get("waiting", {}).get("requests_per_s", {}).get("max"),
    ),
]


def _row(r: dict[str, Any]) -> str:
    cells = []
    for _, spec, value in COLUMNS:
        v = value(r)
        cells.append(f"{'-':>{_width(spec)}}" if v is None else f"{v:{spec}}")
    failed = f"  FAILED {r['failed_ranks']} ranks" if r["failed_ranks"] else ""
    return " ".join(cells) + failed


def _width(spec: str) -> int:
    return int(re.match(r"[<>](\d+)", spec).group(1))


def _header() -> str:
    return " ".join(f"{h:{spec[0]}{_width(spec)}}" for h, spec, _ in COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks/results/store_scale_cpu.json")
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, ~30 s: a smoke test"
    )
    parser.add_argument(
        "--max-ranks",
        type=int,
        default=4096,
        help="the largest job simulated (groups of 8): two threads and a connection a rank",
    )
    parser.add_argument(
        "--max-late-ranks",
        type=int,
        default=2048,
        help="the largest job with late ranks: their peers all wake at once when they come",
    )
    parser.add_argument(
        "--only", default="", help="run only scenarios whose name holds this"
    )
    args = parser.parse_args(argv)

    stand_ins = StandIns()
    info = machine()
    print(
        f"torch {info['torch']}, protocol {info['protocol_module']}, {info['cpus']} CPUs"
    )
    cost_server = Server()
    cost = measure_server_cost(
        cost_server,
        4000 if args.quick else 20000,
        (4, 16) if args.quick else (4, 16, 64),
    )
    del cost_server
    print(
        f"{'server cost':<12} {'clients':>7} {'req/s':>8} {'us/req':>7} {'srv us/msg':>10}"
    )
    for c in cost:
        print(
            f"{c['what']:<12} {c['clients']:>7} {c['requests_per_s']:>8.0f}"
            f" {c['us_per_request_wall']:>7.1f} {c['server_cpu_us_per_message']:>10.2f}"
        )
    results = []
    print(_header())
    runs = scenarios(args.quick, args.max_ranks, args.max_late_ranks) + timeout_sweep(
        args.quick
    )
    for sc in runs:
        if args.only and args.only not in sc.name:
            continue
        r = run_scenario(sc, stand_ins)
        results.append(r)
        print(_row(r), flush=True)
        _wait_for_heartbeats(sc.look_s + 1.0)
    out = {
        "machine": info,
        "stand_ins": dataclasses.asdict(stand_ins),
        "server_cost": cost,
        "scenarios": results,
        "quick": args.quick,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(not r["failed_ranks"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
