# Owner(s): ["module: inductor"]
"""A pick made while the host is busy does not outlive the load.

"balanced" costs 10 ms a call on every rank, "skewed" nothing on rank 0 and 15 ms on the
others: by the slowest rank balanced is faster, and on a quiet host its decision is
settled at once. Beside a busy process the ranks that work at once are slowed more than
the one that works alone, and skewed can win (benchmarks/picks_under_load.py measures it
for real); here the loaded job's readings are given: its timing threads waited for a CPU
400 ms a second, balanced read 20 ms and skewed 18. Then the decision is provisional,
kept on disk as such, and the next, quiet job times the two again and settles balanced.
Self-spawned only (each job is a fresh pair of processes on the same cache directories).
"""

from __future__ import annotations

import json

import torch
from torch.testing._internal.common_utils import run_tests

import collective_ops as ops
from collective_harness import (
    assert_all_ok,
    CollectiveTestCase,
    compile_and_check,
    Costs,
    Rank,
    run_ranks,
)

QUIET = Costs({"balanced": 10e3, "skewed": (0.0, 15e3)}, own_us=25e3)
LOADED = Costs(
    {"balanced": 20e3, "skewed": (0.0, 18e3)}, own_us=50e3, host_contention=0.4
)


def balanced_or_skewed_body(r: Rank) -> list:
    ops.register_all_reduce(
        ops.all_reduce_then("balanced"), ops.all_reduce_then("skewed")
    )
    group = r.group.group_name
    return compile_and_check(lambda x: ops.all_reduce(x, group) + 1, torch.randn(8, 8))


def stored_decisions(root, rank: int) -> list[dict]:
    folder = root / str(rank) / "collective_autotuning" / "decisions"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


class TestPicksUnderLoad(CollectiveTestCase):
    def one_job(self, timing: Costs) -> object:
        """A fresh job on this test's cache directories; rank 0's record, after
        checking that every rank decided alike and stored the same decision."""
        env = {"TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}")}
        (record,), (peer,) = assert_all_ok(
            run_ranks(2, balanced_or_skewed_body, env=env, restarts=True, timing=timing)
        )
        self.assertEqual(record, peer)
        return record

    def assert_kept_as_judged(self, record) -> dict:
        """Every rank stored the decision as the group judged it; the stored entry."""
        self.assertEqual(
            stored_decisions(self.tmp_path, 0), stored_decisions(self.tmp_path, 1)
        )
        (entry,) = stored_decisions(self.tmp_path, 0)
        self.assertEqual(entry["winner"], record.winner)
        self.assertEqual(entry["provisional"], record.provisional)
        return entry

    def test_a_quiet_pick_is_settled_at_once_and_a_warm_restart_times_nothing(self):
        quiet = self.one_job(QUIET)
        self.assertEqual((quiet.decision, quiet.winner), ("benchmark", "balanced"))
        self.assertEqual(quiet.confidence.runner_up, "skewed")
        self.assertFalse(self.assert_kept_as_judged(quiet)["provisional"])
        # The compiled graph and the decision are kept: nothing timed.
        warm = self.one_job(QUIET)
        self.assertEqual((warm.winner, warm.decision), ("balanced", "use"))
        self.assertIn(warm.source, ("cache", "disk"))

    def test_a_pick_made_under_load_is_provisional_until_a_quiet_job_settles_it(self):
        loaded = self.one_job(LOADED)
        self.assertEqual((loaded.winner, loaded.provisional), ("skewed", True))
        self.assertIn("host was busy", loaded.confidence.reason)
        entry = self.assert_kept_as_judged(loaded)
        self.assertEqual((entry["winner"], entry["runner_up"]), ("skewed", "balanced"))
        # Timed again, the stored winner against its runner-up only, and settled.
        after = self.one_job(QUIET)
        self.assertEqual(after.decision, "benchmark")
        self.assertIn("provisional", after.reason)
        self.assertEqual(sorted(t.name for t in after.timings), ["balanced", "skewed"])
        self.assertEqual((after.winner, after.provisional), ("balanced", False))
        self.assertFalse(self.assert_kept_as_judged(after)["provisional"])


if __name__ == "__main__":
    run_tests()
