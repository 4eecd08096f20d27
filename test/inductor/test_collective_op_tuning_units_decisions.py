# Owner(s): ["module: inductor"]
"""Unit tests of collective decisions: messages, Store sessions and votes, files."""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import torch
import torch.distributed as dist

from torch._inductor.kernel.collective.graph_sessions import (
    SiteReport,
    _decide_graph,
    _differing_settings,
    _failures,
    GroupChoice,
)
from torch._inductor.runtime.collective_decisions import (
    DecisionStore,
    Environment,
    StoredDecision,
)
from torch._inductor.runtime.collective_protocol import (
    CollectiveAutotuneError,
    CollectiveSession,
    Decision,
    DecisionKind,
    Join,
    MalformedMessageError,
    StoreClient,
)
from torch.distributed._store_session import (
    ABORTED,
    Liveness,
    Participant,
    look_interval,
    Silence,
    wait_until,
)
from torch.testing._internal.common_utils import run_tests

from collective_harness import CollectiveTestCase


# -- the protocol on one process's Store -----------------------------------------------


def _participant(store: dist.Store, rank: int, timeout: float) -> Participant:
    client = StoreClient(store, "HashStore", timeout)
    return Participant(client, Liveness(client, "ns", rank, lambda: ["g"]), rank, "ns")


class CountingSilence(Silence):
    """A Silence that counts its looks, and says when it looked ``until`` times."""

    def __init__(self, *args, until: int) -> None:
        super().__init__(*args)
        self.looks = 0
        self._until = until
        self.looked_enough = threading.Event()

    def look(self) -> None:
        super().look()
        self.looks += 1
        if self.looks >= self._until:
            self.looked_enough.set()


class TestCollectiveOpTuningUnitsDecisions(CollectiveTestCase):
    # -- agreeing ----------------------------------------------------------------------

    def test_failures_read_the_same_on_every_rank(self):
        per_rank = [{"a": "boom"}, {"a": "boom", "b": "no symmetric memory"}, {}]
        self.assertEqual(
            _failures(per_rank),
            {
                "a": "group ranks [0, 1]: boom",
                "b": "group rank 1: no symmetric memory",
            },
        )

    def test_settings_that_differ_are_named_by_variable(self):
        same = {"collective_benchmark_warmup": 5, "collective_benchmark_mode": "auto"}
        self.assertEqual(_differing_settings([same, same]), "")
        other = {**same, "collective_benchmark_warmup": 6}
        why = _differing_settings([same, other, same])
        self.assertIn("TORCHINDUCTOR_COLLECTIVE_BENCHMARK_WARMUP", why)
        self.assertIn("5 on group ranks [0, 2], 6 on group ranks [1]", why)
        decision = _decide_graph([Join("", same), Join("", other)])
        self.assertEqual(decision.kind, DecisionKind.MISMATCH)

    def test_a_cached_graph_is_loaded_only_where_every_rank_loaded_the_same(self):
        settings = {"collective_benchmark_warmup": 5}
        self.assertEqual(
            _decide_graph([Join("g", settings)] * 2).kind, DecisionKind.LOAD
        )
        mixed = _decide_graph(
            [
                Join("g", settings),
                Join("", settings),
            ]
        )
        self.assertEqual(mixed.kind, DecisionKind.COMPILE)
        self.assertIn("group ranks [0] hit their caches", mixed.reason)

    def test_messages_round_trip_through_their_encodings(self):
        report = SiteReport(
            "k", ("a", "b"), GroupChoice("a", True), None, "a", {"b": "boom"}, True
        )
        for message in [
            Decision(DecisionKind.FALLBACK, "late"),
            GroupChoice("x", provisional=True, unsure=True),
            Join("", {"collective_benchmark_warmup": 5}),
            report,
        ]:
            self.assertEqual(type(message).decode(message.encode().encode()), message)
        self.assertEqual(SiteReport.decode(report.encode()).decided.unsure, False)

    def test_a_malformed_message_names_its_field(self):
        for cls, raw, says in [
            (Decision, '{"kind": "guess", "reason": ""}', "kind is not"),
            (Decision, '{"kind": "load"}', "not a Decision"),
            (GroupChoice, '["x", true]', "not a GroupChoice"),
            (
                GroupChoice,
                '{"winner": 1, "provisional": false, "unsure": false}',
                "winner",
            ),
            (Join, "{not json", "not JSON"),
        ]:
            with self.assertRaisesRegex(MalformedMessageError, says):
                cls.decode(raw)
        wire = json.loads(SiteReport("k", ("a",), None, None, None, {}).encode())
        for field, value in [("choices", "a"), ("failed", {"a": 1}), ("built", 1)]:
            with self.assertRaisesRegex(CollectiveAutotuneError, field):
                SiteReport.from_wire({**wire, field: value})

    # -- decisions on disk -------------------------------------------------------------

    def test_a_stored_decision_is_read_back_and_anything_else_is_a_miss(self):
        store = DecisionStore(self.tmp_path)
        env = Environment(2, torch.__version__, "gloo", "cpu")
        decision = StoredDecision("key", env, "winner", {"winner": 5.0})
        store.save(decision)
        self.assertEqual(store.load("key", env), decision)
        other = dataclasses.replace(env, group_size=4)
        self.assertIsNone(store.load("key", other))  # another environment
        self.assertIsNone(store.load("other", env))
        (path,) = self.tmp_path.glob("*.json")
        written = json.loads(path.read_text())
        for text in [
            "{not json",
            json.dumps({**written, "format": 0}),  # an older format
            json.dumps({**written, "winner": 3}),
            json.dumps({**written, "environment": other.to_wire()}),  # edited
        ]:
            path.write_text(text)
            self.assertIsNone(store.load("key", env))

    # -- sessions and votes on one process's Store -------------------------------------

    def test_a_vote_costs_each_rank_four_requests_and_returns_every_outcome(self):
        store = dist.HashStore()
        members = [_participant(store, r, 5.0) for r in range(3)]
        sessions = [
            CollectiveSession(m, "g", "s", r, [0, 1, 2], 5.0)
            for r, m in enumerate(members)
        ]
        results: dict[int, list[str]] = {}
        threads = [
            threading.Thread(
                target=lambda r=r: results.__setitem__(
                    r, sessions[r].vote("t", f"o{r}")
                )
            )
            for r in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        self.assertTrue(all(results[r] == ["o0", "o1", "o2"] for r in range(3)))
        self.assertEqual([m.client.requests for m in members], [4, 4, 4])

    def test_silence_ends_a_wait_unless_the_group_progresses_and_an_abort_ends_it_at_once(
        self,
    ):
        store = dist.HashStore()
        waiter, worker = _participant(store, 0, 0.4), _participant(store, 1, 0.4)
        silence = Silence(waiter, "g", [0, 1], 0.4)
        self.assertFalse(wait_until(waiter, ["never"], silence))
        # It ended because its deadline passed, not before: silence counts from its first look.
        self.assertTrue(silence.expired())
        self.assertGreaterEqual(waiter.waited_s, silence.seconds)

        # A working peer keeps the wait alive for as long as it works: here until the waiter
        # looked more often than a silent group lets it (after its first look, one per look
        # interval until the silence ends).
        silent_looks = 1 + math.ceil(silence.seconds / look_interval(silence.seconds))
        kept_alive = CountingSilence(waiter, "g", [0, 1], 0.4, until=2 * silent_looks)

        def work() -> None:
            with worker.liveness.working("working on purpose"):
                kept_alive.looked_enough.wait(60)
            worker.client.set("done", "1")

        thread = threading.Thread(target=work)
        thread.start()
        self.assertTrue(wait_until(waiter, ["done"], kept_alive))
        thread.join()
        self.assertTrue(kept_alive.looked_enough.is_set())
        worker.client.add("ns/g/progress", ABORTED)
        worker.client.set("ns/g/abort", "group rank 1: gone")
        with self.assertRaisesRegex(
            CollectiveAutotuneError,
            "stopped on every rank of the group: group rank 1: gone",
        ):
            wait_until(waiter, ["never"], Silence(waiter, "g", [0, 1], 0.4))

    def test_a_session_is_joined_once_per_group_and_a_second_graph_reads_its_decision(
        self,
    ):
        store = dist.HashStore()
        member = _participant(store, 0, 0.4)
        decide = lambda joins: Decision(DecisionKind.COMPILE, "tune")  # noqa: E731
        fallback = lambda why: Decision(DecisionKind.FALLBACK, why)  # noqa: E731
        first = CollectiveSession(member, "g", "plan", 0, [0], 0.4).agree(
            Join("", {}), decide, fallback
        )
        requests = member.client.requests
        again = CollectiveSession(member, "g", "plan", 0, [0], 0.4).agree(
            Join("", {}), decide, fallback
        )
        self.assertEqual(again, first)
        self.assertEqual(member.client.requests, requests)  # read from what it knows
        # The same plan on another group is another session: joined, decided there.
        other = CollectiveSession(member, "h", "plan", 0, [0], 0.4).agree(
            Join("", {}), decide, fallback
        )
        self.assertEqual(other, first)
        self.assertGreater(member.client.requests, requests)
        # A session that ended in an error has no decision: a later graph says so at once
        # instead of waiting on the Store for one.
        member.client.add("ns/a/progress", ABORTED)
        member.client.set("ns/a/abort", "group rank 1: gone")
        with self.assertRaisesRegex(CollectiveAutotuneError, "group rank 1: gone"):
            CollectiveSession(member, "a", "plan", 0, [0, 1], 0.4).agree(
                Join("", {}), decide, fallback
            )
        requests = member.client.requests
        with self.assertRaisesRegex(
            CollectiveAutotuneError, "ended without a decision"
        ):
            CollectiveSession(member, "a", "plan", 0, [0, 1], 0.4).agree(
                Join("", {}), decide, fallback
            )
        self.assertLessEqual(
            member.client.requests - requests,
            1,
            msg="it waited on the Store for a decision",
        )


if __name__ == "__main__":
    run_tests()
