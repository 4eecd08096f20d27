"""One rank of test_collective_op_tuning_store_loss.py's job, run as a script:
``python store_loss_rank.py RANK PORT MOMENT``.

A module of its own, so that a rank imports only what it runs (what its exit waits for
is measured), not the test's classes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import collective_ops as ops


# Compiling on a loaded 2-core machine, before the moment of loss.
PATIENCE_S = 180.0


@torch.library.custom_op("store_loss_test::held_when_lowered", mutates_args=())
def held_when_lowered(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@held_when_lowered.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("store_loss_test::held_when_run", mutates_args=())
def held_when_run(x: torch.Tensor) -> torch.Tensor:
    """On its first call in the process (in the benchmark's screen), says so and waits
    until the Store is gone."""
    if not _held:
        _held.append("run")
        _say(f"benchmarking.{dist.get_rank()}")
        _until_lost()
    return x.clone()


@held_when_run.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_held: list[str] = []


def _register_held_lowering() -> None:
    """Lowering held_when_lowered on rank 1 (building its choices, before the key's vote)
    waits until the Store is gone, the first time: its peer waits in the vote meanwhile."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    op = torch.ops.store_loss_test.held_when_lowered.default

    @register_lowering(op)
    def _lower(x):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1 and not _held:
            _held.append("lowered")
            _until_lost()
        return fallback_handler(op, add_to_fallback_set=False)(x)


_register_held_lowering()


def _folder() -> Path:
    return Path(os.environ["STORE_LOSS_TEST_DIR"])


def _say(marker: str) -> None:
    """Tell the test that this rank reached ``marker``."""
    (_folder() / marker).touch()


def _until_lost() -> float:
    """Wait until the test has taken the Store away; when it did (time.time())."""
    lost = _folder() / "lost"
    give_up = time.monotonic() + PATIENCE_S
    while not lost.exists():
        if time.monotonic() > give_up:
            raise TimeoutError("the test never took the Store away")
        time.sleep(0.02)
    return float(lost.read_text())


def _record_requests(rank: int) -> list[dict[str, Any]]:
    """Every request of the protocol's client from now on: thread, operation, phase,
    start and end (time.time()). Rank 0 says when it waits in a vote."""
    from torch._inductor.runtime.collective_protocol import StoreClient

    log: list[dict[str, Any]] = []
    request = StoreClient._request

    def recorded(self: StoreClient, fn: Any, *args: Any) -> Any:
        phase = getattr(self._phase, "value", None) or ""
        entry = {
            "main": threading.current_thread() is threading.main_thread(),
            "op": fn.__name__,
        }
        entry.update(phase=phase, start=time.time(), end=None)
        log.append(entry)
        if (
            rank == 0
            and fn.__name__ == "wait"
            and phase.startswith("the vote on site/")
        ):
            _say("waiting.0")
        try:
            return request(self, fn, *args)
        finally:
            entry["end"] = time.time()

    StoreClient._request = recorded  # type: ignore[method-assign]
    return log


def _store_lost(error: BaseException) -> BaseException | None:
    """The StoreLostError in ``error``'s chain (Inductor and Dynamo wrap what lowering
    raised), if any."""
    from torch._inductor.runtime.collective_protocol import StoreLostError

    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StoreLostError):
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return None


def _compile(size: int) -> dict[str, Any]:
    """Compile and run the op on a size x size input: when it began and ended, and what
    it raised (None where it did not)."""
    group = dist.group.WORLD.group_name
    began = time.time()
    try:
        torch.compile(lambda x: ops.all_reduce(x, group), dynamic=False)(
            torch.ones(size, size)
        )
        error = None
    except Exception as e:
        error = e
    ended = time.time()
    lost = _store_lost(error) if error is not None else None
    return {
        "began": began,
        "ended": ended,
        "error": None if error is None else f"{type(error).__name__}: {error}"[:2000],
        "store_lost": None if lost is None else str(lost),
    }


def rank_main(rank: int, port: int, moment: str) -> None:
    from torch._inductor.runtime import collective_protocol

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    requests = _record_requests(rank)
    held = {
        "waiting_in_a_vote": ops.all_reduce_then(
            "held_when_lowered",
            before=lambda x: torch.ops.store_loss_test.held_when_lowered(x),
        ),
        "benchmarking": ops.all_reduce_then(
            "held_when_run", before=lambda x: torch.ops.store_loss_test.held_when_run(x)
        ),
    }
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        held.get(moment, ops.reduce_scatter_all_gather),
    )
    report: dict[str, Any] = {}
    if moment == "between_compiles":
        report["first"] = _compile(8)
    if moment in ("before_the_first_compile", "between_compiles"):
        _say(f"ready.{rank}")
        _until_lost()
    report["compile"] = _compile(16)
    if moment == "before_the_first_compile":
        # A later compile neither connects nor sends anything: it says the Store is lost.
        sent = collective_protocol._participant.client.requests
        report["later"] = _compile(32)
        report["later_sent"] = collective_protocol._participant.client.requests - sent
    report["lost"] = _until_lost()
    report["requests"] = requests
    (_folder() / f"report.{rank}.json").write_text(json.dumps(report))
    # The process ends as a script does: what its exit waits for is measured.


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
