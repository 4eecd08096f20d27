"""A pytest plugin (``-p collective_lanes``, pyproject's addopts): one run of each test
where one run covers it (``make test``).

``make test`` runs the files with rank tests under torchrun with 2 and with 4 ranks (each
process a rank, the test's body run in it), then the whole suite self-spawning (each
test starts processes of its own). A test that passed on every rank of a torchrun lane
ran its collectives on real process groups already; spawning its ranks again tests the
spawning, at about half of the suite's time. Two variables tie the runs together:

``COLLECTIVE_TESTS_RECORD_PASSED=DIR``
    each process writes the node ids of the tests that passed in it to
    ``DIR/rank<RANK>.txt`` (torchrun's ``RANK``; first line ``WORLD_SIZE``).
``COLLECTIVE_TESTS_SKIP_PASSED=DIR[:DIR...]``
    deselects the tests that passed on every rank recorded in one of the dirs (a dir
    whose ranks did not all write is not read).

Unset, nothing changes: ``pytest test`` alone runs everything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_RECORD = "COLLECTIVE_TESTS_RECORD_PASSED"
_SKIP = "COLLECTIVE_TESTS_SKIP_PASSED"
_passed: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        _passed.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    record = os.environ.get(_RECORD)
    if not record:
        return
    path = Path(record) / f"rank{os.environ.get('RANK', '0')}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([os.environ.get("WORLD_SIZE", "1"), *_passed]) + "\n")


def _passed_on_every_rank(record: Path) -> set[str]:
    """The node ids that every rank recorded in ``record`` passed; empty unless all
    ``WORLD_SIZE`` ranks wrote their file."""
    ranks = [p.read_text().split("\n") for p in sorted(record.glob("rank*.txt"))]
    if not ranks or any(len(ranks) != int(lines[0]) for lines in ranks):
        return set()
    return set.intersection(*({line for line in lines[1:] if line} for lines in ranks))


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    skip = os.environ.get(_SKIP)
    if not skip:
        return
    covered = set().union(
        *(_passed_on_every_rank(Path(d)) for d in skip.split(os.pathsep) if d)
    )
    deselected = [item for item in items if item.nodeid in covered]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.nodeid not in covered]
