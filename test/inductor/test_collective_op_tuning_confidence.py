# Owner(s): ["module: inductor"]
"""A pick made while the host is busy does not outlive the load.

"balanced" does 10 units of CPU work on every rank, "skewed" none on rank 0 and 15 on
rank 1: by the slowest rank balanced is faster, and on a quiet host it wins and its
decision is settled at once. With a busy process beside the job, the ranks that work at
the same time are slowed more than the one that works alone, and skewed can win: then the
decision is provisional, kept on disk as such, and the next job times the two again and
settles it. Self-spawned only (each job is a fresh pair of processes on the same cache
directories).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

import torch
from torch.testing._internal.common_utils import run_tests, TestCase

import collective_ops as ops
from collective_harness import assert_all_ok, compile_and_check, Rank, run_ranks


def balanced_or_skewed_body(r: Rank) -> list:
    ops.register_balanced_and_skewed()
    group = r.group.group_name
    return compile_and_check(
        lambda x: ops.loaded_all_reduce(x, group) + 1, torch.randn(8, 8)
    )


@contextlib.contextmanager
def busy_host() -> Iterator[None]:
    """One process spinning on a CPU for the block, as a data loader or another job
    would."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def stored_decisions(root, rank: int) -> list[dict]:
    folder = root / str(rank) / "collective_autotuning" / "decisions"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def one_job(root) -> object:
    """A fresh job on ``root``'s cache directories; rank 0's record, after checking that
    every rank decided alike and stored the same decision."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "{rank}")}
    per_rank = assert_all_ok(
        run_ranks(2, balanced_or_skewed_body, env=env, restarts=True)
    )
    (record,), (peer,) = per_rank
    assert record == peer, (record, peer)
    return record


def fresh_root():
    import pathlib
    import tempfile

    return pathlib.Path(tempfile.mkdtemp(prefix="collective_confidence_"))


def busy_while_timed(record) -> bool:
    """Whether the benchmark of ``record`` measured a busy host (then a provisional pick
    of either choice is the right outcome)."""
    from torch._inductor.runtime.collective_confidence import CONTENTION_LIMIT

    return record.confidence.contention > CONTENTION_LIMIT


# Attempts of a scenario, each on fresh cache directories, until its quiet job picks
# balanced. This VM is at times slowed in ways no measure of the job's own threads sees
# (the hypervisor's other tenants: two quiet CI runs of 2026-11-27 picked skewed on a
# host whose timing threads never waited for a CPU); a wrong pick of ours would be made
# every time.
QUIET_ATTEMPTS = 3


def picked_quietly_wrong(record) -> bool:
    """Whether ``record``'s benchmark picked skewed on a host it measured quiet."""
    return (
        record.confidence is not None
        and not busy_while_timed(record)
        and record.winner != "balanced"
    )


class TestPicksUnderLoad(TestCase):
    def assert_kept_as_judged(self, root, record) -> dict:
        """Every rank stored the decision as the group judged it; the stored entry."""
        self.assertEqual(stored_decisions(root, 0), stored_decisions(root, 1))
        (entry,) = stored_decisions(root, 0)
        self.assertEqual(entry["winner"], record.winner)
        # Nothing timed (a warm restart): the settled entry stays as it was.
        settled = record.confidence.settled if record.confidence is not None else True
        self.assertEqual(entry["provisional"], not settled)
        self.assertEqual(record.provisional, entry["provisional"])
        return entry

    def test_a_quiet_pick_is_settled_at_once_and_a_warm_restart_times_nothing(
        self,
    ) -> None:
        for _ in range(QUIET_ATTEMPTS):
            root = fresh_root()
            quiet = one_job(root)
            self.assertEqual(quiet.decision, "benchmark")
            self.assertEqual(
                quiet.confidence.runner_up,
                "skewed" if quiet.winner == "balanced" else "balanced",
            )
            entry = self.assert_kept_as_judged(root, quiet)
            if busy_while_timed(quiet):
                # this host was not quiet after all: not kept as settled
                self.assertTrue(entry["provisional"])
                return
            if not picked_quietly_wrong(quiet):
                break
        self.assertEqual((quiet.winner, entry["provisional"]), ("balanced", False))
        warm = one_job(
            root
        )  # the compiled graph and the decision are kept: nothing timed
        self.assertEqual((warm.winner, warm.decision), ("balanced", "use"))
        self.assertIn(warm.source, ("cache", "disk"))

    def test_a_pick_made_under_load_is_provisional_until_a_quiet_job_settles_it(
        self,
    ) -> None:
        for _ in range(QUIET_ATTEMPTS):
            root = fresh_root()
            with busy_host():
                loaded = one_job(root)
            entry = self.assert_kept_as_judged(root, loaded)
            # Either the right pick, or one that is not kept as settled.
            self.assertTrue(
                loaded.winner == "balanced" or entry["provisional"], (loaded, entry)
            )

            after = one_job(root)
            if entry["provisional"]:
                # Timed again: the stored winner against its runner-up only.
                self.assertEqual(after.decision, "benchmark")
                self.assertIn("provisional", after.reason)
                self.assertEqual(
                    sorted(t.name for t in after.timings),
                    sorted({entry["winner"], entry["runner_up"]}),
                )
            settled = self.assert_kept_as_judged(root, after)
            if not picked_quietly_wrong(after):
                break
        if after.confidence is not None and not busy_while_timed(after):
            self.assertEqual(
                (after.winner, settled["provisional"]), ("balanced", False)
            )


if __name__ == "__main__":
    run_tests()
