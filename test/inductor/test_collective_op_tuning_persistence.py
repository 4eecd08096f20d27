# Owner(s): ["module: inductor"]
"""Kept decisions are checked: an edited decision file is screened again, a changed
choice is a new key, and a fallback holds for its job attempt only (neither the next
job nor a restarted attempt inherits it).
"""

from __future__ import annotations

import json

import torch
from torch._inductor.runtime import collective_protocol
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import collective_ops as ops
from collective_harness import (
    CollectiveTestCase,
    assert_all_ok,
    compile_and_check,
    Costs,
    environment,
    Rank,
    run_ranks,
)
from collective_scenarios import (
    arriving_after_the_decision,
    decision_files,
    NO_GRAPH_CACHES,
    patched_timeout,
    register_two_choices,
)


# one_all_reduce costs 20 ms, the op's own 12 (zeroes is wrong, whatever it costs).
ZEROES_COSTS = Costs({"one_all_reduce": 20e3, "zeroes": 1.0}, own_us=12e3)
# "candidate" wins by 11 ms.
CHANGED_COSTS = Costs({"candidate": 1e3, "slow": 20e3}, own_us=12e3)


def zeroes_body(r: Rank) -> list:
    ops.register_all_reduce(ops.all_reduce_then("one_all_reduce"), ops.zeroes)
    with patched_timeout(30.0):
        return compile_and_check(
            lambda x: ops.all_reduce(x, r.group.group_name),
            torch.randn(8, 8, device=r.device),
        )


def changed_choice_body(r: Rank, variant: str) -> list:
    # Between the two runs "candidate"'s code changes under the same name (a bug that
    # halves the sum).
    halve = (lambda x: x * 0.5) if variant == "buggy" else None
    ops.register_all_reduce(
        ops.all_reduce_then("candidate", before=halve), ops.all_reduce_then("slow")
    )
    return compile_and_check(
        lambda x: ops.all_reduce(x, r.group.group_name) + 1,
        torch.randn(8, 8, device=r.device),
    )


# -- a fallback holds for its job attempt only -----------------------------------------------------


def late_then_on_time_body(r: Rank, late: bool) -> list:
    register_two_choices()
    late_rank = 1 if late else None
    with (
        arriving_after_the_decision(
            r, late_rank, f"late_then_on_time/{collective_protocol.attempt_namespace()}"
        ),
        patched_timeout(),
    ):
        return compile_and_check(
            lambda x: ops.all_reduce(x, r.group.group_name),
            torch.randn(8, 8, device=r.device),
        )


def elastic_attempt(restart_count: int):
    """The environment torchrun gives one attempt of an elastic job (whose attempts
    share one Store)."""
    return environment(
        {
            "TORCHELASTIC_RUN_ID": "test_attempts",
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        }
    )


def restarted_attempt_body(r: Rank) -> dict:
    with elastic_attempt(0):
        first = late_then_on_time_body(r, True)
    torch._dynamo.reset()
    with elastic_attempt(1):
        return {"first": first, "second": late_then_on_time_body(r, False)}


class TestKeptDecisions(CollectiveTestCase):
    def test_an_edited_decision_file_is_screened_and_never_runs_a_wrong_choice(self):

        env = {
            "TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}"),
            **NO_GRAPH_CACHES,
        }
        (first,), _ = assert_all_ok(
            run_ranks(2, zeroes_body, env=env, restarts=True, timing=ZEROES_COSTS)
        )
        self.assertEqual(first.winner, "default")
        self.assertEqual(first.source, "benchmark")
        for rank in (0, 1):  # every rank's file now names the rejected choice
            (entry,) = decision_files(self.tmp_path, rank)
            data = json.loads(entry.read_text())
            data["winner"] = "zeroes"
            entry.write_text(json.dumps(data))
        (again,), (peer,) = assert_all_ok(
            run_ranks(2, zeroes_body, env=env, restarts=True, timing=ZEROES_COSTS)
        )
        # compile_and_check compared the outputs with eager: nothing wrong ran.
        self.assertEqual(again, peer)
        self.assertEqual(again.source, "benchmark")
        self.assertEqual(again.winner, "default")
        self.assertIn(
            "the stored winner failed its screen", again.reason, msg=again.reason
        )

    @parametrize("graph_caches", [False, True])
    def test_a_choice_whose_code_changed_is_tuned_afresh(self, graph_caches):
        env = {
            "TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}"),
            **({} if graph_caches else NO_GRAPH_CACHES),
        }
        (first,), _ = assert_all_ok(
            run_ranks(
                2,
                changed_choice_body,
                "right",
                env=env,
                restarts=True,
                timing=CHANGED_COSTS,
            )
        )
        self.assertEqual(first.winner, "candidate")
        (again,), (peer,) = assert_all_ok(
            run_ranks(
                2,
                changed_choice_body,
                "buggy",
                env=env,
                restarts=True,
                timing=CHANGED_COSTS,
            )
        )
        # A new key (neither the stored decision nor the cached graph is used), tuned afresh:
        # the buggy candidate fails its screen. compile_and_check found the outputs right.
        self.assertEqual(again, peer)
        self.assertEqual(again.source, "benchmark")
        self.assertNotEqual(again.key, first.key)
        self.assertNotEqual(again.winner, "candidate")
        status = {t.name: t.reason for t in again.timings}
        self.assertIn(
            "output differs from the reference", status["candidate"], msg=status
        )

    def test_a_graph_inlining_a_fallback_is_not_loaded_by_the_next_job_but_the_settled_one_is(
        self,
    ):
        env = {
            "TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}")
        }  # the FX-graph cache on
        (fallback,), _ = assert_all_ok(
            run_ranks(2, late_then_on_time_body, True, env=env, restarts=True)
        )
        self.assertEqual(fallback.winner, "default")
        self.assertTrue(fallback.provisional)
        self.assertIn("did not arrive", fallback.reason)
        (next_job,), (peer,) = assert_all_ok(
            run_ranks(2, late_then_on_time_body, False, env=env, restarts=True)
        )
        self.assertEqual(next_job, peer)
        self.assertEqual(next_job.source, "benchmark")
        third = assert_all_ok(
            run_ranks(2, late_then_on_time_body, False, env=env, restarts=True)
        )
        self.assertFalse(next_job.provisional, msg=next_job)
        # The FX-graph cache now holds two entries for the graph's key: the fallback's
        # and the settled one. The lookup passes over the first, so the third job loads
        # the settled graph and times nothing.
        for (record,) in third:
            self.assertEqual(record.source, "cache", msg=str(record))
            self.assertEqual(record.winner, next_job.winner, msg=str(record))

    def test_a_restarted_attempt_does_not_inherit_the_fallback_of_the_first(self):
        a, b = assert_all_ok(run_ranks(2, restarted_attempt_body, env=NO_GRAPH_CACHES))
        (first,), (second,) = a["first"], a["second"]
        self.assertEqual(first.winner, "default")
        self.assertTrue(first.provisional)
        self.assertEqual(a["second"], b["second"])
        self.assertEqual(second.source, "benchmark")


instantiate_parametrized_tests(TestKeptDecisions)


if __name__ == "__main__":
    run_tests()
