# Owner(s): ["module: inductor"]
"""A lost Store: every rank raises StoreLostError within the timeout, and exits.

First the protocol's client alone, on a Store that never answers: the heartbeat and
the session share one deadline, connecting counts in it, and a lost Store is never
asked again.

Then real ranks. The job's Store is hosted by a process of its own, as torchrun's agent
hosts it, so that every rank survives its loss; the test kills that process (or stops
it: a host that no longer answers but keeps its connections open, on which c10d's own
requests wait for ever) at one moment of the protocol:

* before the first compile: the rank's first request is the connection it opens;
* while a rank waits in a vote (its peer still builds the key's choices);
* while the ranks benchmark (a choice holds its first call until the Store is gone);
* after the decisions are published, before the next compile.

Each rank is a process of its own running store_loss_rank.py, and ends as a script
does (no ``os._exit``), so that what its exit waits for is measured. Every rank must
raise a StoreLostError (Inductor wraps it: it is found in the exception's chain) within
``collective_benchmark_timeout`` + 5 s of its first request after the loss (its first
request on the compiling thread; a request in flight at the loss counts from the loss),
and exit within 5 s of it. Last, the Store hosted by a rank, as the harness hosts it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import collective_ops as ops
from collective_harness import (
    single_process,
    check,
    CollectiveTestCase,
    Rank,
    run_ranks,
    under_torchrun,
)
from store_loss_rank import PATIENCE_S
from test_collective_op_tuning_failing_choices import dies_while_building_body


TIMEOUT_S = 4.0
# Bounds five times what the error (about the timeout after the rank's first request
# after the loss) and the exit (3-4 s after the error) take: they catch a wait without
# end, not a slow host. What they take is measured by benchmarks/store_loss.py.
ERROR_BOUND_S = 5 * TIMEOUT_S
EXIT_BOUND_S = 20.0
COMPILE_MARGIN_S = 60.0
# What each rank runs.
RANK_SCRIPT = str(Path(__file__).with_name("store_loss_rank.py"))

MOMENTS = [
    "before_the_first_compile",
    "waiting_in_a_vote",
    "benchmarking",
    "between_compiles",
]


# -- the client's one deadline, on a Store that never answers ------------------------------


class Unanswering(dist.Store):
    """A Store whose requests do not return until released: a host stopped, or cut off
    (c10d's own client then waits for ever, whatever its timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.asked = threading.Event()  # a request reached it
        self.released = threading.Event()

    def add(self, key: str, value: int) -> int:
        self.calls += 1
        self.asked.set()
        self.released.wait(60)
        return 0


# -- the test ----------------------------------------------------------------------------


# The Store's host: serves until the test kills or stops it.
STORE_HOST = """
import time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""

# The markers that say the moment of loss has come, by moment.
MOMENT_MARKERS = {
    "before_the_first_compile": ["ready.0", "ready.1"],
    "waiting_in_a_vote": ["waiting.0"],
    "benchmarking": ["benchmarking.0", "benchmarking.1"],
    "between_compiles": ["ready.0", "ready.1"],
}


@dataclasses.dataclass
class RankOutcome:
    rank: int
    report: dict[str, Any]
    exited: float  # time.time()
    log: str

    def first_request_after(self, lost: float) -> float:
        """When this rank's compiling thread first asked the Store after ``lost`` (a
        request in flight then counts from ``lost``)."""
        return next(
            max(r["start"], lost)
            for r in self.report["requests"]
            if r["main"] and (r["end"] is None or r["end"] > lost)
        )


def lose_the_store(
    moment: str, how: str, folder: Path
) -> tuple[float, list[RankOutcome]]:
    """Run the two ranks, take the Store away (``how``: killed or stopped) at ``moment``;
    when (time.time()), and what each rank reported."""
    host = subprocess.Popen(
        [sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True
    )
    ranks: list[subprocess.Popen] = []
    try:
        port = int(host.stdout.readline())
        env = {**os.environ, "STORE_LOSS_TEST_DIR": str(folder)}
        env["TORCHINDUCTOR_COLLECTIVE_BENCHMARK_TIMEOUT"] = str(TIMEOUT_S)
        for rank in range(2):
            env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / f"cache{rank}")
            with open(folder / f"rank{rank}.log", "w") as log:
                ranks.append(
                    subprocess.Popen(
                        [sys.executable, RANK_SCRIPT, str(rank), str(port), moment],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        give_up = time.monotonic() + PATIENCE_S
        while not all((folder / m).exists() for m in MOMENT_MARKERS[moment]):
            check.assertTrue(all(p.poll() is None for p in ranks), msg=_logs(folder))
            check.assertLess(
                time.monotonic(), give_up, msg=f"{moment} never came\n{_logs(folder)}"
            )
            time.sleep(0.02)
        if how == "killed":
            host.kill()
        else:
            host.send_signal(signal.SIGSTOP)
        lost = time.time()
        (folder / "lost.tmp").write_text(repr(lost))
        (folder / "lost.tmp").rename(folder / "lost")
        exited: dict[int, float] = {}
        while len(exited) < len(ranks) and time.monotonic() < give_up:
            for rank, p in enumerate(ranks):
                if rank not in exited and p.poll() is not None:
                    exited[rank] = time.time()
            time.sleep(0.02)
        check.assertEqual(
            len(exited), len(ranks), msg=f"a rank did not exit\n{_logs(folder)}"
        )
    finally:
        for p in [*ranks, host]:
            if p.poll() is None:
                p.kill()
            p.wait()
    outcomes = []
    for rank, p in enumerate(ranks):
        report = folder / f"report.{rank}.json"
        check.assertEqual(p.returncode, 0, msg=f"rank {rank} failed\n{_logs(folder)}")
        check.assertTrue(report.exists(), msg=f"rank {rank} failed\n{_logs(folder)}")
        outcomes.append(
            RankOutcome(
                rank, json.loads(report.read_text()), exited[rank], _log(folder, rank)
            )
        )
    return lost, outcomes


def _log(folder: Path, rank: int) -> str:
    return (folder / f"rank{rank}.log").read_text()[-6000:]


def _logs(folder: Path) -> str:
    return "\n".join(f"-- rank {rank} --\n{_log(folder, rank)}" for rank in range(2))


CASES = [(moment, "killed") for moment in MOMENTS] + [
    ("before_the_first_compile", "stopped"),
    ("waiting_in_a_vote", "stopped"),
]


# -- the Store hosted by a rank, as the harness hosts it ---------------------------------------


def patched_timeout(seconds: float = TIMEOUT_S):
    return torch._inductor.config.patch(collective_benchmark_timeout=seconds)


def register_two_choices() -> None:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"), ops.reduce_scatter_all_gather
    )


def _until_gone(store: dist.Store) -> None:
    """Wait until the Store's host no longer takes connections (its process exited)."""
    while not isinstance(store, dist.TCPStore):
        store = store.underlying_store
    give_up = time.monotonic() + PATIENCE_S
    while time.monotonic() < give_up:
        try:
            socket.create_connection((store.host, store.port), timeout=1.0).close()
        except OSError:
            return
        time.sleep(0.05)
    raise TimeoutError("the Store's host never went away")


def store_lost_body(r: Rank, autotune: bool) -> dict:
    from torch._inductor.runtime import collective_protocol

    alone = dist.new_group([1])  # every rank takes part in making it
    register_two_choices()
    store = dist.distributed_c10d._get_default_store()
    store.add("store_lost/ready", 1)
    if r.rank == 0:
        while store.add("store_lost/ready", 0) < 2:
            time.sleep(0.05)
        os._exit(0)  # rank 0 hosts the Store: it goes with it
    _until_gone(store)
    begin = time.monotonic()
    try:
        with (
            patched_timeout(),
            torch._inductor.config.patch(collective_autotune=autotune),
        ):
            out = torch.compile(lambda x: ops.all_reduce(x, alone.group_name) + 1)(
                torch.ones(4, 4)
            )
        error = None
        check.assertTrue(torch.equal(out, torch.full((4, 4), 2.0)))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {
        "error": error,
        "s": time.monotonic() - begin,
        "participant": collective_protocol._participant is not None,
    }


# -- the Store hosted by a rank that dies mid-session ----------------------------------------


class TestStoreLoss(CollectiveTestCase):
    @single_process
    def test_the_heartbeat_and_the_session_share_one_deadline_and_a_lost_store_is_not_asked_again(
        self,
    ):
        from torch._inductor.runtime.collective_protocol import (
            StoreClient,
            StoreLostError,
        )

        store = Unanswering()
        client = StoreClient(store, "10.0.0.1:29500", timeout=6.0)
        heartbeat_error: list[BaseException] = []

        def beat() -> None:
            with client.during("a heartbeat"), self.assertRaises(StoreLostError) as e:
                client.add("progress", 1)
            heartbeat_error.append(e.exception)

        try:
            began = time.monotonic()
            heartbeat = threading.Thread(target=beat)
            heartbeat.start()
            # The heartbeat's request is in flight.
            self.assertTrue(store.asked.wait(60))
            # The session asks 5 s into the heartbeat's 6 s deadline: it must fail
            # 1 s later, not 6 s (a deadline of its own), whatever the host's load.
            time.sleep(5.0)
            asked = time.monotonic()
            with (
                client.during("the vote on site/k"),
                self.assertRaises(StoreLostError) as e,
            ):
                client.add("votes", 1)
            failed = time.monotonic()
            heartbeat.join()
            # Queued behind the heartbeat's request, the session's ended at its deadline:
            # 6 s after the heartbeat asked, not 6 s after the session did.
            self.assertGreaterEqual(failed - began, 6.0)
            self.assertLess(failed - asked, 5.0, msg=(failed - began, failed - asked))
            self.assertEqual(
                str(e.exception),
                "the c10d Store (10.0.0.1:29500) stopped answering during the vote on site/k: no answer "
                "within 6 s (collective_benchmark_timeout) (seen during a heartbeat)",
            )
            self.assertIn(
                "stopped answering during a heartbeat: no answer within 6 s",
                str(heartbeat_error[0]),
            )
            with (
                client.during("joining session s"),
                self.assertRaises(StoreLostError) as e,
            ):
                client.add("progress", 1)
            self.assertIn(
                "stopped answering during a heartbeat ",
                str(e.exception),
                msg=e.exception,
            )
            self.assertIn(
                "this process does not try it again (joining session s)",
                str(e.exception),
                msg=e.exception,
            )
            # The heartbeat's request reached the Store; the session's never did, nor any later.
            self.assertEqual(store.calls, 1)
            self.assertEqual(client.requests, 2)
        finally:
            store.released.set()

    @single_process
    def test_connecting_counts_in_the_same_deadline_and_is_not_tried_again(self):
        from torch._inductor.runtime.collective_protocol import (
            StoreClient,
            StoreLostError,
        )

        released = threading.Event()
        opened: list[float] = []

        def open_store(seconds: float) -> dist.Store:
            opened.append(seconds)  # a host that takes the connection and never answers
            released.wait(60)
            raise ConnectionResetError("released")

        client = StoreClient(None, "10.0.0.1:29500", 1.0, open_store)
        try:
            began = time.monotonic()
            with (
                client.during("reading the decision for k"),
                self.assertRaises(StoreLostError) as e,
            ):
                client.get("k")
            waited = time.monotonic() - began
            self.assertGreaterEqual(waited, 1.0)
            self.assertLess(waited, 5.0)  # the connection's own wait is 60 s
            self.assertEqual(
                str(e.exception),
                "the c10d Store (10.0.0.1:29500) stopped answering during reading the decision for "
                "k: no answer within 1 s (collective_benchmark_timeout) (seen during connecting)",
            )
            with self.assertRaisesRegex(
                StoreLostError, "during connecting .* does not try it again"
            ):
                client.add("k", 1)
            self.assertEqual(opened, [1.0], atol=0, rtol=0)
        finally:
            released.set()

    @unittest.skipIf(
        under_torchrun(), "ends the job's Store by design; runs self-spawned only"
    )
    @parametrize("moment,how", CASES, name_fn=lambda moment, how: f"{moment}_{how}")
    def test_a_lost_store_ends_every_rank_within_the_timeout_and_its_exit_waits_for_nothing(
        self, moment, how
    ):
        lost, outcomes = lose_the_store(moment, how, self.tmp_path)
        for rank in outcomes:
            compiled = rank.report["compile"]
            where = f"rank {rank.rank}: {compiled['error']}\n{rank.log}"
            self.assertIsNotNone(compiled["store_lost"], msg=where)
            self.assertTrue(
                compiled["store_lost"].startswith("the c10d Store (127.0.0.1:"),
                msg=where,
            )
            error_s = compiled["ended"] - rank.first_request_after(lost)
            self.assertLess(error_s, ERROR_BOUND_S, msg=(error_s, where))
            exit_s = rank.exited - compiled["ended"]
            if moment == "before_the_first_compile":
                later = rank.report["later"]
                self.assertIsNotNone(later["store_lost"], msg=later)
                self.assertIn(
                    "this process does not try it again", later["store_lost"], msg=later
                )
                self.assertEqual(rank.report["later_sent"], 0, msg=str(rank.report))
                exit_s = rank.exited - later["ended"]
            self.assertLess(exit_s, EXIT_BOUND_S, msg=(exit_s, where))
            print(
                f"{moment}-{how} rank {rank.rank}: error {error_s:.2f} s after its first request after the loss, "
                f"exit {exit_s:.2f} s after the error: {compiled['store_lost'][:160]}"
            )
        if moment == "waiting_in_a_vote":
            self.assertIn(
                "during the vote on site/",
                outcomes[0].report["compile"]["store_lost"],
                msg=outcomes[0].report,
            )

    @parametrize("autotune", [True, False])
    def test_a_lost_store_fails_within_the_timeout_and_off_means_no_store_at_all(
        self, autotune
    ):
        _, survivor = run_ranks(2, store_lost_body, autotune, breaks_the_group=True)
        self.assertTrue(survivor.ok, msg=survivor.error)
        result = survivor.value
        if autotune:
            self.assertIsNotNone(result["error"], msg=result)
            self.assertIn("StoreLostError", result["error"], msg=result)
            self.assertIn("the c10d Store (127.0.0.1:", result["error"])
            self.assertIn("stopped answering during", result["error"])
            self.assertLess(result["s"], TIMEOUT_S + COMPILE_MARGIN_S)
        else:  # switched off: the op's own implementation, nothing of ours touched the Store
            self.assertIsNone(result["error"], msg=result)
            self.assertFalse(result["participant"], msg=result)

    def test_losing_the_store_mid_session_is_reported_as_such(self):
        # Rank 0, which hosts the Store, dies; rank 1 waits for it in the build vote.
        dead, survivor = run_ranks(
            2,
            dies_while_building_body,
            0,
            env={"CAT_TEST_DEATH_FILE": str(self.tmp_path / "died")},
            breaks_the_group=True,
        )
        self.assertIsNone(dead.wall_s, msg=survivor)
        self.assertTrue(survivor.ok, msg=survivor)
        error = survivor.value["error"]
        self.assertIsNotNone(error, msg=error)
        self.assertIn("StoreLostError: the c10d Store (127.0.0.1:", error, msg=error)
        self.assertIn("stopped answering during the vote on site/", error, msg=error)


instantiate_parametrized_tests(TestStoreLoss)


if __name__ == "__main__":
    run_tests()
