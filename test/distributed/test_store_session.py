# Owner(s): ["oncall: distributed"]
"""The generic Store session protocol (torch.distributed._store_session) on a HashStore:
its wire format, its typed errors, and the vocabulary its user names them with.

One process, real Store semantics; no process group, no Inductor.
"""

from __future__ import annotations

import json
import threading

import torch.distributed as dist
from torch.distributed._store_session import (
    Liveness,
    MalformedMessageError,
    Message,
    Participant,
    StoreClient,
    StoreLostError,
    StoreSession,
    StoreSessionError,
    Vocabulary,
)
from torch.testing._internal.common_utils import run_tests, TestCase


def _participant(
    store: dist.Store, rank: int, client: type[StoreClient]
) -> Participant:
    c = client(store, "HashStore", 0.4)
    return Participant(c, Liveness(c, "ns", rank, lambda: ["g"]), rank, "ns")


def _in_threads(fns: list) -> list:
    results: list = [None] * len(fns)

    def run(i: int) -> None:
        results[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


class TestStoreSession(TestCase):
    def test_a_message_is_one_json_object_and_none_travels_as_null(self):
        message = Message(1, {"stored": None, "choices": ["a", "b"]})
        wire = message.encode()
        self.assertEqual(
            json.loads(wire),
            {"rank": 1, "value": {"stored": None, "choices": ["a", "b"]}},
        )
        self.assertNotIn("\n", Message(0, "two\nlines").encode())
        self.assertEqual(Message.decode(wire), message)

    def test_a_malformed_message_fails_clearly(self):
        for line, says in [
            ("{not json", "not JSON"),
            ('["rank", 0]', "not a Message"),
            ('{"rank": 0}', "not a Message"),
            ('{"rank": "0", "value": 1}', "rank is not a <class 'int'>"),
            ('{"rank": true, "value": 1}', "rank is not a <class 'int'>"),
            ('{"rank": -1, "value": 1}', "no group rank"),
        ]:
            with self.assertRaisesRegex(MalformedMessageError, says):
                Message.decode(line)

    def test_votes_are_json_values_by_group_rank(self):
        store = dist.HashStore()
        members = [_participant(store, r, StoreClient) for r in range(2)]
        sessions = [
            StoreSession(m, "g", "s", r, [0, 1], 5.0) for r, m in enumerate(members)
        ]
        values = [{"failed": {}}, None]
        votes = _in_threads(
            [lambda r=r: sessions[r].vote("t", values[r]) for r in range(2)]
        )
        self.assertEqual(votes, [values, values])

    def test_a_malformed_vote_fails_the_session_with_the_users_error(self):
        class Error(StoreSessionError):
            pass

        class Client(StoreClient):
            vocabulary = Vocabulary(user="tuning", session_error=Error)

        store = dist.HashStore()
        member = _participant(store, 0, Client)
        store.append("ns/g/session/s/vote/t/votes", '{"rank": 1, "value": "x"}\n[1]\n')
        with self.assertRaisesRegex(Error, "^t: not a Message"):
            StoreSession(member, "g", "s", 0, [0, 1], 0.4).vote("t", "mine")

    def test_a_decision_is_any_json_value_and_the_first_proposal_holds(self):
        store = dist.HashStore()
        members = [_participant(store, r, StoreClient) for r in range(2)]

        def agree(r: int):
            session = StoreSession(members[r], "g", "plan", r, [0, 1], 5.0)
            return session.agree(
                {"rank": r}, lambda joins: {"joins": joins}, lambda why: None
            )

        decided = _in_threads([lambda r=r: agree(r) for r in range(2)])
        self.assertEqual(decided[0], decided[1])
        self.assertEqual(decided[0], {"joins": [{"rank": 0}, {"rank": 1}]})

    def test_errors_are_c10d_errors_and_a_lost_store_a_network_error(self):
        self.assertTrue(issubclass(StoreSessionError, dist.DistError))
        self.assertTrue(issubclass(StoreLostError, StoreSessionError))
        self.assertTrue(issubclass(StoreLostError, dist.DistNetworkError))
        self.assertTrue(issubclass(MalformedMessageError, StoreSessionError))

    def test_the_users_vocabulary_names_the_errors_and_the_timeout(self):
        class Lost(StoreLostError):
            pass

        class Client(StoreClient):
            vocabulary = Vocabulary(timeout_name="my_timeout", lost_error=Lost)

        class Silent(dist.Store):
            def __init__(self) -> None:
                super().__init__()
                self.released = threading.Event()

            def get(self, key):  # a Store that never answers
                self.released.wait(10)
                raise RuntimeError("released")

        store = Silent()
        try:
            client = Client(store, "10.0.0.1:1", 0.2)
            with client.during("a test"), self.assertRaises(Lost) as e:
                client.get("k")
            self.assertIn("no answer within 0.2 s (my_timeout)", str(e.exception))
        finally:
            store.released.set()


if __name__ == "__main__":
    run_tests()
