# Owner(s): ["module: inductor"]
"""One session per graph; decisions kept for the job and across restarts; caches on.

Each case runs on real process groups (gloo on CPU, NCCL on GPUs) and asserts what
every rank decided, where the decision came from, and that ranks agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any


import torch
from torch._dynamo.utils import counters
from torch._inductor.kernel.collective.ladder import (
    assign,
    branches,
    Incumbent,
    TOLERANCE,
)
from torch._inductor.kernel.collective.graph_sessions import SETTLED_IN_GRAPH
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import collective_ops as ops
from collective_harness import (
    single_process,
    CollectiveTestCase,
    assert_all_ok,
    check,
    compile_and_check,
    DEVICE_CASES,
    given_timings,
    Rank,
    run_ranks,
)


LAYERS = 6
# Decisions on disk, but compiled graphs not: a restart must tune or reuse them alone.
NO_GRAPH_CACHES = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
}


def register_two_choices() -> None:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"), ops.reduce_scatter_all_gather
    )


def stack(group: str, layers: int, device: torch.device):
    """x + all_reduce(x @ w) per layer: one all-reduce op, one key, ``layers`` sites."""
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(16, 16, generator=gen) / 8).to(device) for _ in range(layers)
    ]

    def f(x):
        for w in weights:
            x = x + ops.all_reduce(x @ w, group)
        return x

    return f


# -- one session per graph, one winner per key ---------------------------------------------


def layers_body(r: Rank) -> list:
    register_two_choices()
    return compile_and_check(
        stack(r.group.group_name, LAYERS, r.device), torch.randn(8, 16, device=r.device)
    )


def two_graphs_body(r: Rank) -> dict:
    register_two_choices()
    group = r.group.group_name
    x = torch.randn(8, 16, device=r.device)
    first = compile_and_check(stack(group, 2, r.device), x)
    torch._dynamo.reset()
    # Another graph with a site like the first's: a matmul's output, a pointwise user.
    w = torch.randn(16, 16, device=r.device) / 8
    second = compile_and_check(lambda t, w: ops.all_reduce(t @ w, group) * 3, x, w)
    return {"first": first, "second": second}


def neighbours_body(r: Rank) -> list:
    register_two_choices()
    group = r.group.group_name

    def f(x, w):
        fused = (
            ops.all_reduce(torch.relu(x), group) * 2
        )  # a pointwise producer and user
        alone = ops.all_reduce(x, group)  # a graph input, returned
        owned = ops.all_reduce(x @ w, group)  # a matmul's output, read by it alone
        y = x @ (w * 2)
        shared = ops.all_reduce(y, group) + y  # read after it: not reduced in place
        return fused, alone, owned, shared

    return compile_and_check(
        f, torch.randn(8, 16, device=r.device), torch.randn(16, 16, device=r.device)
    )


def inlined_in_place_body(r: Rank, dynamic: bool) -> dict:
    """The inlined all-reduce of a matmul's output and of a graph input, compiled
    (``dynamic``: with a dynamic size, one graph per range) with their pick's code."""
    from torch._inductor.kernel.collective.api import collective_autotune_records
    from torch._inductor.utils import run_and_get_code

    # The op's own sleeps 10 ms: the functional all-reduce wins at every size (on
    # gloo too) and is inlined.
    ops.register_all_reduce(ops.all_reduce_then("one_all_reduce"))
    group = r.group.group_name
    x = torch.randn(8, 16, device=r.device)
    w = torch.randn(16, 16, device=r.device)
    start = len(collective_autotune_records())  # a torchrun rank ran other tests first
    codes = {}
    for site, fn in (
        ("owned", lambda x, w: ops.all_reduce(x @ w, group, "10") + x),
        ("graph_input", lambda x, w: ops.all_reduce(x, group, "10") + x),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        out, (code, *_) = run_and_get_code(compiled, x, w)
        torch.testing.assert_close(out, fn(x, w), rtol=1e-4, atol=1e-4)
        codes[site] = code
    return {"records": collective_autotune_records()[start:], "codes": codes}


# -- decisions kept on disk across restarts ---------------------------------------------------


def one_site_body(r: Rank) -> list:
    register_two_choices()
    return compile_and_check(
        lambda t: ops.all_reduce(t, r.group.group_name) + 1,
        torch.randn(8, 16, device=r.device),
    )


def decision_files(root: Path, rank: int) -> list[Path]:
    return sorted(
        (root / str(rank) / "collective_autotuning" / "decisions").glob("*.json")
    )


def restart(root: Path, **env: str) -> list:
    """One run of ``one_site_body`` on 2 ranks whose cache dirs live under ``root``."""
    full = {"TORCHINDUCTOR_CACHE_DIR": str(root / "{rank}"), **NO_GRAPH_CACHES, **env}
    (a,), (b,) = assert_all_ok(run_ranks(2, one_site_body, env=full, restarts=True))
    check.assertEqual(a, b)
    return a


def assert_stored_decision_reused(tuned, again) -> None:
    """``again``, the restart after ``tuned``, used the decision ``tuned`` stored."""
    check.assertEqual(again.key, tuned.key, msg=str((tuned, again)))
    check.assertFalse(tuned.provisional, msg=tuned)
    check.assertEqual(again.source, "disk", msg=str(again))
    check.assertEqual(again.decision, "use", msg=str(again))
    check.assertEqual(again.winner, tuned.winner, msg=str(again))
    check.assertEqual(again.timings, (), msg=str(again))


# -- compile caches stay on ----------------------------------------------------------------


def cached_body(r: Rank, bundled: bool = False) -> dict:
    from torch._functorch import config as functorch_config

    register_two_choices()
    counters.clear()
    # bundled: AOTAutograd's cache keeps the compiled graphs in its own entries.
    with functorch_config.patch(bundled_autograd_cache=bundled):
        records = compile_and_check(
            stack(r.group.group_name, 3, r.device), torch.randn(8, 16, device=r.device)
        )
    return {
        "records": records,
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
    }


# -- dynamic sizes: one compile, the right implementation at every size ---------------------------


def sized_calls_body(
    r: Rank,
    rows: tuple[int, ...],
    layers: int = 0,
    own_ms: str = "12",
    range_graphs: bool = False,
) -> dict:
    """One dynamic compile of the all-reduce (its own implementation costs ``own_ms``),
    alone or in a stack of ``layers`` layers ``x + all_reduce(relu(x @ w))``, then a call
    at each of ``rows``: which registered choices ran, compiles, the records, and how
    many benchmark modules the ranges compiled. Range graphs off unless
    ``range_graphs``: one graph, which dispatches by size inside (their fallback; range
    graphs are tested below)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from torch._inductor.kernel.collective.api import collective_autotune_records

    group = r.group.group_name
    weights = [torch.eye(4, device=r.device) / 2 for _ in range(layers)]

    def model(x):
        for w in weights:
            x = x + ops.all_reduce(torch.relu(x @ w), group)
        return x if weights else ops.all_reduce(x, group)

    start = len(collective_autotune_records())
    builds = counters["inductor"]["collective_autotune_range_builds"]
    dispatch_traces = counters["inductor"]["collective_autotune_dispatch_traces"]
    choice_traces = counters["inductor"]["collective_autotune_choice_traces"]
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    ran = {}
    with (
        given_timings(ops.DesignedCosts(float(own_ms))),
        torch._inductor.config.patch(collective_autotune_range_graphs=range_graphs),
    ):
        compiled(torch.randn(8, 4, device=r.device))  # compiles (and benchmarks) once
        for n in rows:
            x = torch.randn(n, 4, device=r.device)
            ops.ran.clear()
            out = compiled(x)
            ran[n] = sorted({t for t in ops.ran if t != "default"})
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    return {
        "ran": ran,
        "frames": counter.frame_count,
        "records": collective_autotune_records()[start:],
        "builds": counters["inductor"]["collective_autotune_range_builds"] - builds,
        "dispatch_traces": counters["inductor"]["collective_autotune_dispatch_traces"]
        - dispatch_traces,
        "choice_traces": counters["inductor"]["collective_autotune_choice_traces"]
        - choice_traces,
        # How many of this compile's decisions were recorded at each trace of per_row_cost.
        "per_row_cost_traced_at": [
            n - start for n in ops.traced_at.get("per_row_cost", ()) if n >= start
        ],
    }


def dynamic_body(r: Rank) -> dict:
    # The op's own 10 ms wins above 10 rows, where per_row_cost (1 ms a row) gets
    # slower (by 1.6x at the ladder's 16); flat_cost (20 ms) never wins.
    ops.register_all_reduce(ops.flat_cost, ops.per_row_cost)
    with torch._inductor.config.patch(collective_autotune_dynamic_max=256):
        return sized_calls_body(r, (8, 2, 100), own_ms="10")


def size_reading_body(r: Rank) -> dict:
    # per_row_cost_up_to_16 wins up to 4 rows (1 ms a row), the op's own (10 ms) above.
    ops.register_all_reduce(ops.flat_cost, ops.per_row_cost_up_to_16)
    with torch._inductor.config.patch(collective_autotune_dynamic_max=256):
        return sized_calls_body(r, (8, 2, 100), own_ms="10", range_graphs=True)


def mixed_winners_body(r: Rank) -> dict:
    # per_row_cost (inlined) up to 4 rows, the opaque op to 64, the op's own from 65.
    ops.register_all_reduce(ops.flat_cost, ops.per_row_cost, ops.opaque)
    with torch._inductor.config.patch(collective_autotune_dynamic_max=256):
        return sized_calls_body(r, (2, 30, 100), layers=4)


def one_winner_body(r: Rank) -> dict:
    # per_row_cost (1 ms a row, 16 at most in the ladder) wins every range against the
    # op's own 40 ms: each of the three layers inlines it, no dispatch.
    ops.register_all_reduce(ops.per_row_cost)
    with (
        torch._inductor.config.patch(collective_autotune_dynamic_max=16),
        logged_messages("torch._inductor.kernel.custom_op", logging.WARNING) as warned,
    ):
        result = sized_calls_body(r, (2, 9), layers=3, own_ms="40")
    return {**result, "custom_op_warnings": list(warned)}


# The ladder's sizes (256 standing for every size above 64), their winners among
# flat_cost, per_row_cost, the opaque op and the op's own (12 ms) by DesignedCosts, and
# the ranges each runs once the crossovers between them are found.
LADDER_SIZES = (1, 4, 16, 64, 256)
DESIGNED_WINNERS = ["per_row_cost", "per_row_cost", "opaque", "opaque", "default"]
DESIGNED_CELLS = [(6, "per_row_cost"), (120, "opaque"), (math.inf, "default")]


def mixed_winner_layers(
    r: Rank, layers: int, trainable: bool = False
) -> tuple[Any, list[torch.Tensor]]:
    """``layers`` layers ``x + all_reduce(relu(x @ w))`` whose all-reduce's winner changes
    twice with the token count: an inlined one (per_row_cost) up to a few rows, an opaque
    op next, the op's own (12 ms) for the largest; the model and its weights."""
    ops.register_all_reduce(ops.flat_cost, ops.per_row_cost, ops.opaque)
    group = r.group.group_name
    weights = [
        (torch.eye(4, device=r.device) / 2).requires_grad_(trainable)
        for _ in range(layers)
    ]

    def model(x):
        for w in weights:
            x = x + ops.all_reduce(torch.relu(x @ w), group)
        return x

    return model, weights


def forward_and_backward_body(r: Rank, range_graphs: bool) -> dict:
    """Three layers with trainable weights, compiled dynamically: the weights' gradients at
    sizes where each kind of winner runs, against eager."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.kernel.collective.api import collective_autotune_records

    model, weights = mixed_winner_layers(r, 3, trainable=True)

    def gradients(fn, x):
        for w in weights:
            w.grad = None
        fn(x).sum().backward()
        return [w.grad for w in weights]

    start = len(collective_autotune_records())
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    sites = counters["inductor"]["collective_autotune_range_graph_sites"]
    dispatches = counters["inductor"]["collective_autotune_size_dispatches"]
    with torch._inductor.config.patch(
        collective_autotune_dynamic_max=256,
        collective_autotune_range_graphs=range_graphs,
    ):
        for n in (8, 2, 30, 100):
            x = torch.randn(n, 4, device=r.device)
            torch.testing.assert_close(
                gradients(compiled, x), gradients(model, x), rtol=1e-4, atol=1e-4
            )
    return {
        "frames": counter.frame_count,
        "records": collective_autotune_records()[start:],
        "range_graph_sites": counters["inductor"][
            "collective_autotune_range_graph_sites"
        ]
        - sites,
        "dispatching_sites": counters["inductor"]["collective_autotune_size_dispatches"]
        - dispatches,
    }


def assert_each_size_ran_its_winner(a: dict, b: dict, device: str) -> None:
    check.assertEqual(a["records"], b["records"])
    by_size = {r.size: r for r in a["records"]}
    check.assertEqual(by_size[1].winner, "per_row_cost")
    check.assertEqual(by_size[16].winner, by_size[256].winner)
    check.assertEqual(by_size[256].winner, "default")
    # The crossover at 10 rows, found between the ladder's 4 and 16: a probe at 10,
    # where the two tie and per_row_cost, the winner below, is kept.
    check.assertEqual(
        cells_of(a["records"]), [(10, "per_row_cost"), (math.inf, "default")]
    )
    # Each size runs its best choice, and only it (the op's own marks nothing).
    check.assertEqual(a["ran"], b["ran"])
    check.assertEqual(b["ran"], {8: ["per_row_cost"], 2: ["per_row_cost"], 100: []})
    check.assertEqual(a["frames"], 1)  # no recompile
    # Each implementation compiled once for the benchmark, for every range's size.
    check.assertEqual(a["builds"], b["builds"])
    check.assertEqual(b["builds"], 2)


def split_points_body(r: Rank) -> dict:
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    # The user's own ranges: [1, 4], [5, 32], [33, inf) timed at 64 rows.
    register_custom_op_autotuning(
        ops.all_reduce,
        configs=[CustomOpConfig(ops.flat_cost), CustomOpConfig(ops.per_row_cost)],
        # (upstream's docstring calls it unbounded_size; the code reads range_upper_bound)
        dispatch_on={"tensor_name": "x", "dim": 0, "range_upper_bound": 64},
        split_points=[4, 32],
    )
    return sized_calls_body(r, (3, 8, 50))


def switched_off_split_points_body(r: Rank) -> dict:
    from torch._inductor import config

    with config.patch(collective_autotune=False):
        return split_points_body(r)


# -- range graphs: one graph per size range, chosen by Dynamo's guards ------------------------


class _Messages(logging.Handler):
    """Keeps the messages of the logger it is added to."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def recompile_reasons() -> Any:
    """The reasons Dynamo gives for each recompile in the block (``TORCH_LOGS=recompiles``),
    as a user reads them."""
    handler = _Messages()
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


@contextlib.contextmanager
def logged_messages(name: str, level: int = logging.INFO) -> Any:
    """The messages logged at ``level`` and above by logger ``name`` in the block."""
    handler = _Messages()
    handler.setLevel(level)
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


# How a test forbids range graphs, besides the knob: Dynamo's options.
FORBIDDEN = {
    "error_on_recompile": {"error_on_recompile": True},
    # Three ranges: more than half of a limit of four.
    "recompile_limit": {"recompile_limit": 4},
}


def range_graphs_body(
    r: Rank, range_graphs: bool, forbid: str = "", warm_up: bool = False
) -> dict:
    """Four layers whose all-reduce's winner changes twice along the token dimension,
    compiled dynamically once, then called at sizes that visit every range twice (with
    ``warm_up``: at 8, then at ``warm_up_sizes()`` as the docs tell a serving engine,
    then at sizes of every range under ``set_stance("fail_on_recompile")``, which a
    serving engine may set once warmed up): per call, what compiled, what ran, and the
    records it made."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.kernel.collective.ladder import warm_up_sizes
    from torch._inductor.kernel.collective.api import collective_autotune_records
    from torch.fx.experimental import _config as fx_config

    model, _ = mixed_winner_layers(r, 4)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    dynamo = FORBIDDEN.get(forbid, {})
    calls = []
    with (
        torch._inductor.config.patch(
            collective_autotune_dynamic_max=256,
            collective_autotune_range_graphs=range_graphs,
        ),
        torch._dynamo.config.patch(dynamo),
        # A size of 1 is one of the ranges' (else Dynamo compiles a graph of its own
        # for it, as the docs say): with the warm-up only, which visits 1.
        fx_config.patch(backed_size_oblivious=warm_up),
        recompile_reasons() as reasons,
        logged_messages("torch._inductor.kernel.collective.dispatch") as dispatch_log,
    ):
        sizes = [8] if warm_up else [8, 2, 30, 200, 3, 20, 8, 2, 30, 200]
        warmed_up = len(sizes)
        for i, n in enumerate(sizes):
            stance = "fail_on_recompile" if i >= warmed_up else "default"
            start, frames = len(collective_autotune_records()), counter.frame_count
            guards = counters["inductor"]["collective_autotune_range_graph_sites"]
            dispatches = counters["inductor"]["collective_autotune_size_dispatches"]
            hits = counters["inductor"]["fxgraph_cache_hit"]
            outside = counters["inductor"]["collective_autotune_ranges_outside"]
            traces = counters["inductor"]["collective_autotune_choice_traces"]
            recompiles = len(reasons)
            x = torch.randn(n, 4, device=r.device)
            with torch.compiler.set_stance(stance):
                # Compiles where its range has no graph yet (and benchmarks, the first).
                compiled(x)
                compiles = counter.frame_count - frames
                ops.ran.clear()
                out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
            calls.append(
                {
                    "n": n,
                    "ran": sorted({t for t in ops.ran if t != "default"}),
                    "compiled": compiles,
                    "records": collective_autotune_records()[start:],
                    "guarded_sites": counters["inductor"][
                        "collective_autotune_range_graph_sites"
                    ]
                    - guards,
                    "dispatching_sites": counters["inductor"][
                        "collective_autotune_size_dispatches"
                    ]
                    - dispatches,
                    "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"] - hits,
                    "ranges_outside": counters["inductor"][
                        "collective_autotune_ranges_outside"
                    ]
                    - outside,
                    "choice_traces": counters["inductor"][
                        "collective_autotune_choice_traces"
                    ]
                    - traces,
                    "recompile_reasons": reasons[recompiles:],
                }
            )
            if warm_up and i == 0:
                # After the first compile, as the docs tell an engine.
                warm = warm_up_sizes()
                sizes += [*warm, 2, 3, 20, 30, 100, 200, 1]
                warmed_up = 1 + len(warm)
                calls[0]["warm_up_sizes"] = warm
    calls[0]["dispatch_log"] = list(dispatch_log)
    return calls


def probes_of(records) -> list:
    """The measurements of a compile's probes, ascending (its first site's: later sites
    of the key take the same)."""
    by_size = {}
    for rec in records:
        if rec.measurement is not None:
            by_size.setdefault(rec.size, rec.measurement)
    return [by_size[size] for size in sorted(by_size)]


def cells_of(records) -> list[tuple[float, str]]:
    """(top, winner) of each range where the winner changes, in size order: the cells a
    range graph is compiled for."""
    probes = probes_of(records)
    return branches(probes, assign(probes, TOLERANCE))


def data_dependent_size_body(r: Rank) -> dict:
    """The mixed-winner layers on a token count read from a tensor (an unbacked size),
    compiled once and called at sizes of every range of the ladder: what compiled, what
    ran, and what was logged."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.kernel.collective.api import collective_autotune_records

    layers, _ = mixed_winner_layers(r, 3)

    def model(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        rows = n.item()
        torch._check_is_size(rows)
        torch._check(rows <= x.size(0))
        return layers(x[:rows])

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(300, 4, device=r.device)
    calls = []
    start = len(collective_autotune_records())
    with (
        torch._inductor.config.patch(collective_autotune_dynamic_max=256),
        torch._dynamo.config.patch(capture_scalar_outputs=True),
        logged_messages("torch._inductor.kernel.collective.dispatch") as logged,
    ):
        for n in (8, 2, 30, 100, 200):
            ops.ran.clear()
            out = compiled(x, torch.tensor(n))
            torch.testing.assert_close(
                out, model(x, torch.tensor(n)), rtol=1e-4, atol=1e-4
            )
            calls.append({"n": n, "ran": sorted(set(ops.ran))})
    return {
        "calls": calls,
        "frames": counter.frame_count,
        "records": [
            (rec.winner, rec.source) for rec in collective_autotune_records()[start:]
        ],
        "logged": list(logged),
    }


class TestGraphSessions(CollectiveTestCase):
    @parametrize("device", DEVICE_CASES)
    def test_every_site_of_a_key_in_a_graph_inlines_one_benchmarked_winner(
        self, device
    ):
        per_rank = assert_all_ok(run_ranks(2, layers_body, device=device))
        self.assertEqual(per_rank[0], per_rank[1])
        records = per_rank[0]
        self.assertEqual(len(records), LAYERS)
        self.assertEqual(
            [r.source for r in records], ["benchmark"] + ["job"] * (LAYERS - 1)
        )
        self.assertEqual(len({r.winner for r in records}), 1)
        self.assertEqual(len({r.session for r in records}), 1)
        self.assertEqual(len({r.key for r in records}), 1)

    @parametrize("device", DEVICE_CASES)
    def test_a_later_graph_reuses_the_group_decision_without_benchmarking(self, device):
        a, b = assert_all_ok(run_ranks(2, two_graphs_body, device=device))
        self.assertEqual(a, b)
        (second,) = a["second"]
        self.assertEqual(a["first"][0].source, "benchmark")
        self.assertEqual(second.source, "job")
        self.assertEqual(second.decision, "use")
        self.assertEqual(second.timings, ())
        self.assertEqual(second.winner, a["first"][0].winner)
        self.assertEqual(second.key, a["first"][0].key)
        # Another graph, its own session.
        self.assertNotEqual(second.session, a["first"][0].session)

    @parametrize("device", DEVICE_CASES)
    def test_a_site_is_timed_with_the_pointwise_work_it_fuses_with(self, device):
        # The same op and shapes between pointwise neighbours, alone on a graph input,
        # on a matmul's output (which an inlined all-reduce reduces in place, where it
        # copies a graph input) and on one read after it (which it must not): four
        # keys, each benchmarked as it runs in the model, and the compiled graph is
        # right on every rank.
        a, b = assert_all_ok(run_ranks(2, neighbours_body, device=device))
        self.assertEqual(a, b)
        self.assertEqual(
            sorted(r.timed_with for r in a),
            [
                "consumer",
                "none",
                "owned-input",
                "producer+consumer",
            ],
        )
        self.assertEqual([r.source for r in a], ["benchmark"] * 4)
        self.assertEqual(len({r.key for r in a}), 4)
        self.assertEqual(len({r.session for r in a}), 1)

    @parametrize("device", DEVICE_CASES)
    @parametrize("dynamic", [False, True])
    def test_an_inlined_all_reduce_reduces_an_input_only_it_reads_in_place(
        self, device, dynamic
    ):
        # As Inductor's reinplace pass makes of the all-reduce written in the model:
        # no copy of the matmul's output (a kernel named after the all-reduce), where
        # a graph input is copied.
        a, _ = assert_all_ok(
            run_ranks(2, inlined_in_place_body, dynamic, device=device)
        )
        self.assertTrue(a["records"], msg=[r.winner for r in a["records"]])
        self.assertTrue(
            all(r.winner.endswith("one_all_reduce") for r in a["records"]),
            msg=[r.winner for r in a["records"]],
        )
        self.assertIn("all_reduce_.default", a["codes"]["owned"])
        self.assertNotIn("fused_all_reduce", a["codes"]["owned"])
        self.assertIn("fused_all_reduce", a["codes"]["graph_input"])

    def test_a_restart_reuses_the_decision_every_rank_stored(self):
        first = restart(self.tmp_path)
        self.assertEqual(first.source, "benchmark")
        self.assertEqual(
            len(decision_files(self.tmp_path, 0)), len(decision_files(self.tmp_path, 1))
        )
        self.assertEqual(len(decision_files(self.tmp_path, 1)), 1)
        assert_stored_decision_reused(first, restart(self.tmp_path))

    def test_a_corrupt_or_foreign_entry_is_a_miss_and_the_group_tunes_afresh(self):
        restart(self.tmp_path)
        (entry,) = decision_files(self.tmp_path, 1)
        entry.write_text("{not json")
        self.assertEqual(restart(self.tmp_path).source, "benchmark")
        (entry,) = decision_files(self.tmp_path, 1)
        data = json.loads(entry.read_text())
        data["environment"]["group_size"] = 8  # measured on another group size
        entry.write_text(json.dumps(data))
        fresh = restart(self.tmp_path)
        self.assertEqual(fresh.source, "benchmark")
        # The fresh tuning rewrote the entry, which the next restart uses.
        assert_stored_decision_reused(fresh, restart(self.tmp_path))

    def test_retune_and_persist_knobs(self):
        restart(self.tmp_path)
        self.assertEqual(
            restart(self.tmp_path, TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_RETUNE="1").source,
            "benchmark",
        )
        fresh = self.tmp_path / "fresh"
        self.assertEqual(
            restart(fresh, TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_PERSIST="0").source,
            "benchmark",
        )
        self.assertEqual(decision_files(fresh, 0), [])
        self.assertEqual(decision_files(fresh, 1), [])
        self.assertEqual(restart(fresh).source, "benchmark")

    @parametrize("device", DEVICE_CASES)
    def test_warm_restart_loads_every_graph_from_the_caches(self, device):
        def job(root: Path) -> list:
            env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "{rank}")}
            return assert_all_ok(
                run_ranks(2, cached_body, device=device, env=env, restarts=True)
            )

        root = self.tmp_path
        cold = job(root)
        warm = job(root)
        winner = cold[0]["records"][0].winner
        self.assertEqual(cold[0]["records"], cold[1]["records"])
        for rank in warm:
            self.assertGreater(rank["fx_hits"] + rank["aot_hits"], 0)
            self.assertTrue(
                all(r.source == "cache" and r.winner == winner for r in rank["records"])
            )
            self.assertFalse(any(r.decision == "benchmark" for r in rank["records"]))

    @parametrize("device", DEVICE_CASES)
    def test_one_rank_warm_one_cold_both_compile_and_agree(self, device):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}")}
        assert_all_ok(run_ranks(2, cached_body, device=device, env=env, restarts=True))
        shutil.rmtree(self.tmp_path / "1")  # rank 1 cold: graphs and decisions gone
        warm, cold = assert_all_ok(
            run_ranks(2, cached_body, device=device, env=env, restarts=True)
        )
        # The warm rank's hit became a miss: both compiled and tuned together.
        self.assertEqual(warm["fx_hits"], 0)
        self.assertEqual(warm["records"], cold["records"])
        self.assertEqual(warm["records"][0].source, "benchmark")

    def test_aot_autograd_bundled_graphs_are_the_groups_too(self):
        # AOTAutograd's bundled cache holds the compiled graph in its own entry, found
        # without the FX-graph cache's lookup: a warm rank's hit is still the group's.
        def job(root: Path) -> list:
            env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "{rank}")}
            return assert_all_ok(
                run_ranks(2, cached_body, True, env=env, restarts=True)
            )

        root = self.tmp_path
        job(root)
        both = job(root)
        for rank in both:
            self.assertGreater(rank["aot_hits"], 0)
            self.assertEqual(rank["records"][0].source, "cache")
        shutil.rmtree(root / "1")
        warm, cold = job(root)
        self.assertEqual(warm["aot_hits"], 0)
        self.assertEqual(warm["records"], cold["records"])
        self.assertEqual(warm["records"][0].source, "benchmark")

    def test_a_cached_graph_is_used_only_in_the_environment_its_decisions_were_made_in(
        self,
    ):
        # One cache dir for every rank and run, as on one host: tuned on 4 ranks, then
        # started on 2 (another tensor-parallel size), then on 2 again.
        env = {"TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path)}
        four = assert_all_ok(run_ranks(4, cached_body, env=env, restarts=True))
        two = assert_all_ok(run_ranks(2, cached_body, env=env, restarts=True))
        again = assert_all_ok(run_ranks(2, cached_body, env=env, restarts=True))
        self.assertTrue(all(rank["records"][0].source == "benchmark" for rank in four))
        # The graph compiled for 4 ranks is a miss on 2: both ranks tune for 2.
        self.assertEqual(two[0]["records"], two[1]["records"])
        self.assertEqual(two[0]["fx_hits"], two[1]["fx_hits"])
        self.assertEqual(two[1]["fx_hits"], 0)
        self.assertEqual(two[0]["records"][0].source, "benchmark")
        self.assertEqual(two[0]["records"][0].group_ranks, (0, 1))
        # The next 2-rank run uses what the first kept (its graph, or its stored
        # decision where the cache offers the 4-rank graph first), without tuning.
        self.assertEqual(again[0]["records"], again[1]["records"])
        self.assertLessEqual(
            {r.source for r in again[0]["records"]}, {"cache", "disk", "job"}
        )
        self.assertTrue(
            all(r.winner == two[0]["records"][0].winner for r in again[0]["records"])
        )

    @parametrize("device", DEVICE_CASES)
    def test_dynamic_size_dispatches_to_each_sizes_winner_from_one_compile(
        self, device
    ):
        a, b = assert_all_ok(run_ranks(2, dynamic_body, device=device, timeout_s=150))
        assert_each_size_ran_its_winner(a, b, device)
        # The range between two ranges that agree was screened against every choice,
        # and kept their winner.
        by_size = {r.size: r for r in a["records"]}
        self.assertEqual(by_size[64].source, "ladder")
        self.assertTrue(by_size[64].timings)
        self.assertIn("screened against default", by_size[64].reason)

    def test_layers_whose_op_has_one_winner_trace_it_once(self):
        # One implementation wins every range: each layer inlines it without a dispatch,
        # from the trace the first site's choices made (each site traced it again).
        a, b = assert_all_ok(run_ranks(2, one_winner_body, timeout_s=150))
        self.assertEqual(a["records"], b["records"])
        self.assertEqual(
            {r.winner for r in a["records"]}, {"per_row_cost"}, msg=str(a["records"])
        )
        self.assertEqual(a["ran"], b["ran"])
        self.assertEqual(b["ran"], {2: ["per_row_cost"], 9: ["per_row_cost"]})
        self.assertEqual(a["frames"], 1)
        self.assertEqual(a["dispatch_traces"], 0)
        ranges = len({r.size for r in a["records"]})
        for rank in (a, b):
            traced = rank["per_row_cost_traced_at"]
            self.assertTrue(traced, msg=(ranges, traced))
            self.assertLess(max(traced), ranges, msg=(ranges, traced))
            # Inlining the winner with the arguments it was tuned with is no conflict
            # between its settings and the call's (torch 2.11 warned at every site).
            self.assertEqual(
                rank["custom_op_warnings"], [], msg=str(rank["custom_op_warnings"])
            )

    @parametrize("device", DEVICE_CASES)
    def test_layers_whose_ranges_mix_inlined_opaque_and_own_winners_run_from_one_compile(
        self, device
    ):
        # Four call sites, each dispatching to an inlined functional collective, an opaque
        # custom op and the op's own implementation by size (it crashed with two sites).
        a, b = assert_all_ok(
            run_ranks(2, mixed_winners_body, device=device, timeout_s=150)
        )
        self.assertEqual(a["records"], b["records"])
        ladder = {m.size: m.winner for m in probes_of(a["records"])}
        # By size, each kind of winner in turn, as DesignedCosts gives them.
        self.assertEqual([ladder[n] for n in LADDER_SIZES], DESIGNED_WINNERS)
        # Between the ladder's sizes, the crossovers: per_row_cost (1 ms a row) against
        # the opaque op (6 + 0.05 ms a row) at 6.3 rows, the opaque op against the op's
        # own 12 ms at 120.
        self.assertEqual(cells_of(a["records"]), DESIGNED_CELLS)
        # Timed as the site runs where one implementation wins every range: between relu and
        # the residual add.
        self.assertEqual(
            {r.timed_with for r in a["records"] if r.source == "benchmark"},
            {"producer+consumer"},
        )
        # Each size ran its best choice, and only it (the op's own marks nothing): 100
        # rows the opaque op (11 ms), which the range timed at 256 alone gave the op's
        # own (12 ms).
        self.assertEqual(a["ran"], b["ran"])
        self.assertEqual(
            b["ran"], {2: ["per_row_cost"], 30: ["opaque"], 100: ["opaque"]}
        )
        self.assertEqual(a["frames"], b["frames"])
        self.assertEqual(b["frames"], 1)
        # The later sites take the probes the first settled without tracing a choice
        # again: per_row_cost is traced while the first site decides its probes, and
        # once more by the size dispatch that every site shares.
        probes = len(probes_of(a["records"]))
        self.assertEqual(
            [r.reason for r in a["records"][probes:]], [SETTLED_IN_GRAPH] * 3 * probes
        )
        traced_at = a["per_row_cost_traced_at"]
        self.assertTrue(traced_at, msg=traced_at)
        self.assertEqual(
            [n for n in traced_at if n >= probes], [probes], msg=str(traced_at)
        )
        # Their dispatch, alike at every site, is traced once and copied.
        self.assertEqual(a["dispatch_traces"], b["dispatch_traces"])
        self.assertEqual(b["dispatch_traces"], 1)
        # So is each of the three implementations, which the first site's five ranges
        # trace on the same symbolic inputs (torch 2.13 on) or each at its range's size
        # (torch 2.11, traced on the site's symbolic sizes instead): the ranges after the
        # first take a copy.
        self.assertEqual(a["choice_traces"], b["choice_traces"])
        self.assertEqual(b["choice_traces"], 3)

    def test_an_implementation_that_reads_its_size_is_traced_at_each_ranges_size(self):
        # per_row_cost_up_to_16 branches on its rows in Python: traced on the site's
        # symbolic sizes it would guard the model on them. torch 2.11 traces it at each
        # range's size (the trace on the symbolic sizes refused, adding no guard), and it
        # wins the ranges where its per-row cost does, in a range graph of their own;
        # torch 2.13 on skips it (upstream).
        a, b = assert_all_ok(run_ranks(2, size_reading_body, timeout_s=150))
        self.assertEqual(a["records"], b["records"])
        winners = {r.size: r.winner for r in a["records"]}
        if torch.__version__ >= (2, 13):
            self.assertEqual(set(winners.values()), {"default"}, msg=str(winners))
            self.assertEqual(a["ran"], b["ran"])
            self.assertEqual(b["ran"], {8: [], 2: [], 100: []})
            self.assertEqual(a["frames"], 1)
        else:
            self.assertEqual(winners[1], winners[4], msg=str(winners))
            self.assertEqual(winners[4], "per_row_cost_up_to_16", msg=str(winners))
            self.assertEqual(winners[16], winners[256], msg=str(winners))
            self.assertEqual(winners[256], "default", msg=str(winners))
            # per_row_cost_up_to_16 (1 ms a row) up to the op's own 10 ms: the
            # crossover found at 10 rows.
            self.assertEqual(
                cells_of(a["records"]),
                [(10, "per_row_cost_up_to_16"), (math.inf, "default")],
            )
            self.assertEqual(a["ran"], b["ran"])
            self.assertEqual(
                b["ran"], {8: ["per_row_cost"], 2: ["per_row_cost"], 100: []}
            )
            # A graph for (10, inf) and one for [1, 10] (first called at 8, then 2).
            self.assertEqual(a["frames"], 2)

    @parametrize("device", DEVICE_CASES)
    def test_forward_and_backward_dispatch_by_size_from_one_compile(self, device):
        # The backward's all-reduce of the gradient is a collective-tuned site too: both
        # graphs dispatch by size, and the gradients match eager at every kind of winner.
        a, b = assert_all_ok(
            run_ranks(
                2,
                forward_and_backward_body,
                False,
                device=device,
                timeout_s=200,
                timing=ops.DesignedCosts(),
            )
        )
        self.assertEqual(a["frames"], b["frames"])
        self.assertEqual(b["frames"], 1)
        self.assertEqual(
            [(r.op, r.winner) for r in a["records"]],
            [(r.op, r.winner) for r in b["records"]],
        )
        # 3 sites in the forward graph and 3 in the backward, the same probes each (the
        # costs are alike). Each graph's first site decides the probes, timed with what
        # it fuses with there (the forward's relu and residual add; the backward's relu
        # gradient), and its later sites of the same key take them untraced. The
        # backward's sites look like the forward's (the plan's session was held): its
        # keys are agreed in sessions of their own, settled in the graph all the same.
        # The backward's last site all-reduces a matmul's output that only it reads (an
        # owned input): a key of its own, timed so.
        p = len({r.size for r in a["records"]})
        self.assertEqual(len(a["records"]), 6 * p)
        forward, backward = a["records"][: 3 * p], a["records"][3 * p :]
        self.assertEqual(
            {r.timed_with for r in forward[:p] if r.source == "benchmark"},
            {"producer+consumer"},
        )
        self.assertEqual(
            {r.timed_with for r in backward[:p] if r.source == "benchmark"},
            {"consumer"},
        )
        self.assertEqual(
            [r.reason for r in forward[p:] + backward[p : 2 * p]],
            [SETTLED_IN_GRAPH] * 3 * p,
        )
        self.assertEqual(
            {(r.timed_with, r.source) for r in backward[2 * p :]},
            {("owned-input+consumer", "benchmark")},
        )
        self.assertFalse({r.key for r in forward} & {r.key for r in backward})
        self.assertGreaterEqual(
            {r.winner for r in a["records"]}, {"per_row_cost", "opaque", "default"}
        )

    @parametrize("device", DEVICE_CASES)
    def test_forward_and_backward_range_graphs(self, device):
        # Range graphs in training: a forward graph per range of the sizes called (8, 2, 30,
        # 100: three ranges of the usual winners), each guarded by its first site; the
        # backward (compiled at the first backward call, when no guard can be added) inlines
        # its range's winner where the forward's guards fix it, and dispatches inside where
        # they do not. The gradients match eager at every size either way.
        a, b = assert_all_ok(
            run_ranks(
                2,
                forward_and_backward_body,
                True,
                device=device,
                timeout_s=300,
                timing=ops.DesignedCosts(),
            )
        )
        self.assertEqual(
            [(r.op, r.winner) for r in a["records"]],
            [(r.op, r.winner) for r in b["records"]],
        )
        forward_ladder = cells_of(a["records"])
        self.assertEqual(a["frames"], b["frames"])
        self.assertEqual(
            b["frames"],
            len(
                {
                    next(i for i, (top, _) in enumerate(forward_ladder) if n <= top)
                    for n in (8, 2, 30, 100)
                }
            ),
        )
        # Every forward site of every range graph.
        self.assertGreaterEqual(a["range_graph_sites"], 3 * a["frames"])
        # Nothing was benchmarked after the first forward and backward graphs.
        first = 6 * len({r.size for r in a["records"]})
        self.assertTrue(
            all(r.source != "benchmark" for r in a["records"][first:]),
            msg=a["records"][first:],
        )

    @single_process
    def test_a_probe_keeps_the_nearest_winner_unless_another_is_clearly_faster(self):
        # The pick itself: a pure function of the group's timings (identical on every rank).
        from torch._inductor.kernel.collective.timing import pick
        from torch._inductor.runtime.collective_benchmarking import ChoiceTiming

        names = ["one_shot", "two_shot", "default"]
        timings = [
            ChoiceTiming(n, us, us, 1, "ok") for n, us in zip(names, (12.0, 10.1, 10.0))
        ]
        # two_shot, 1% slower at the probe's size, won the size below: it keeps this
        # one, as within the ladder's tolerance.
        winner, reason = pick(names, timings, 1.0, Incumbent("two_shot", "16", False))
        self.assertEqual(winner, "two_shot")
        self.assertIn("within 2% of two_shot", reason)
        self.assertIn("won at 16", reason)
        self.assertEqual(pick(names, timings, 1.0, None)[0], "default")
        # Clearly faster.
        self.assertEqual(
            pick(names, timings, 1.0, Incumbent("one_shot", "16", False))[0], "default"
        )
        # 10% apart by medians, but the samples overlap (eager launches at one token): noise
        # does not buy a size dispatch.
        noisy = [
            ChoiceTiming("one_shot", 86.0, 86.0, 1, "ok", low_us=70.0, high_us=95.0),
            ChoiceTiming("default", 78.0, 78.0, 1, "ok", low_us=60.0, high_us=90.0),
        ]
        self.assertEqual(
            pick(
                ["one_shot", "default"], noisy, 1.0, Incumbent("one_shot", "inf", False)
            )[0],
            "one_shot",
        )
        apart = [
            dataclasses.replace(noisy[0], low_us=84.0, high_us=88.0),
            dataclasses.replace(noisy[1], low_us=76.0, high_us=80.0),
        ]
        self.assertEqual(
            pick(
                ["one_shot", "default"], apart, 1.0, Incumbent("one_shot", "inf", False)
            )[0],
            "default",
        )
        # A user's min_speedup_threshold still favours the op's own implementation.
        self.assertEqual(
            pick(names, timings, 1.2, Incumbent("two_shot", "16", False))[0], "default"
        )

    @parametrize("device", DEVICE_CASES)
    def test_user_split_points_are_tuned_by_the_group_per_range(self, device):
        a, b = assert_all_ok(
            run_ranks(2, split_points_body, device=device, timeout_s=150)
        )
        self.assertEqual(a["records"], b["records"])
        by_size = {r.size: r for r in a["records"]}
        # The user's ranges, kept as given: each timed by the group at its last size
        # (64 for the unbounded one), nothing between them.
        self.assertEqual(sorted(by_size), [4, 32, 64])
        self.assertEqual({r.source for r in by_size.values()}, {"benchmark"})
        # 1 ms a row wins at 4 rows; the op's own 12 ms wins at 32 and 64.
        self.assertEqual(by_size[4].winner, "per_row_cost")
        self.assertEqual(by_size[32].winner, by_size[64].winner)
        self.assertEqual(by_size[64].winner, "default")
        self.assertEqual(a["ran"], b["ran"])
        self.assertEqual(b["ran"], {3: ["per_row_cost"], 8: [], 50: []})
        self.assertEqual(a["frames"], 1)
        self.assertEqual(a["builds"], b["builds"])
        self.assertEqual(b["builds"], 2)  # once each, for the three ranges

    @parametrize("device", DEVICE_CASES)
    def test_user_split_points_switched_off_run_the_ops_own(self, device):
        # Collective autotuning off: the op's own implementation at every size, in one
        # graph (torch 2.11 lowers the op as its own call; 2.13 on as the stand-in of
        # every range), untimed and unbuilt.
        a, b = assert_all_ok(
            run_ranks(2, switched_off_split_points_body, device=device, timeout_s=150)
        )
        self.assertEqual(a["ran"], b["ran"])
        self.assertEqual(b["ran"], {3: [], 8: [], 50: []})
        self.assertEqual(a["frames"], b["frames"])
        self.assertEqual(b["frames"], 1)
        self.assertEqual(a["builds"], b["builds"])
        self.assertEqual(b["builds"], 0)
        self.assertTrue(a["records"], msg=a["records"])
        self.assertTrue(
            all(
                r.winner == "default" and r.decision == "use" and r.session == ""
                for r in a["records"] + b["records"]
            ),
            msg=a["records"],
        )

    @parametrize("device", DEVICE_CASES)
    def test_each_size_range_compiles_a_graph_of_its_own_that_benchmarks_nothing(
        self, device
    ):
        a, b = assert_all_ok(
            run_ranks(
                2,
                range_graphs_body,
                True,
                device=device,
                timeout_s=240,
                timing=ops.DesignedCosts(),
            )
        )
        # Every rank compiled the same graphs, and took the same decisions in each.
        self.assertEqual([c["compiled"] for c in a], [c["compiled"] for c in b])
        self.assertEqual([c["records"] for c in a], [c["records"] for c in b])
        # The first compile tunes the ladder and the sizes between at its first site,
        # as a group.
        first = a[0]
        cells = cells_of(first["records"])
        probes = len(probes_of(first["records"]))
        # By size, each kind of winner in turn, as DesignedCosts gives them.
        self.assertEqual(cells, DESIGNED_CELLS)
        self.assertTrue(any(rec.source == "benchmark" for rec in first["records"]))

        def cell(n: int) -> int:
            return next(i for i, (top, _) in enumerate(cells) if n <= top)

        seen: set[int] = set()
        for call in a:
            new = cell(call["n"]) not in seen
            seen.add(cell(call["n"]))
            # One compile per range, at its first size; none after: Dynamo's guards choose.
            self.assertEqual(
                call["compiled"], int(new), msg=str((call["n"], call["compiled"]))
            )
            # Each size runs its range's winner, and only it.
            winner = cells[cell(call["n"])][1]
            self.assertEqual(
                call["ran"], [] if winner == "default" else [winner], msg=str(call)
            )
            if new:
                # The first site guards the range, the later ones find it fixed: every site
                # inlines its range's winner, no size dispatch inside the graph.
                self.assertEqual(call["guarded_sites"], 4, msg=str(call))
                self.assertEqual(call["dispatching_sites"], 0, msg=str(call))
            if new and call is not first:
                # Dynamo's reason for the recompile, as TORCH_LOGS=recompiles shows it,
                # is the range's guard, placed in collective autotuning's range graphs.
                self.assertEqual(
                    len(call["recompile_reasons"]),
                    1,
                    msg=str(call["recompile_reasons"]),
                )
                self.assertIn(
                    "kernel/collective/range_graphs.py",
                    call["recompile_reasons"][0],
                    msg=call["recompile_reasons"],
                )
                # A later range reads the ladder's decisions: nothing benchmarked, no session round.
                self.assertLessEqual(
                    {rec.source for rec in call["records"]},
                    {"job", "ladder"},
                    msg=call["records"],
                )
                self.assertEqual(
                    sum(rec.store_requests for rec in call["records"]),
                    0,
                    msg=str(call["records"]),
                )
                # It lowers only the probes inside its own range, at every site: the
                # others are neither traced nor recorded.
                low = max((top for top, _ in cells if top < call["n"]), default=0)
                high = cells[cell(call["n"])][0]
                lowered = [rec.size for rec in call["records"]]
                self.assertTrue(lowered, msg=(call["n"], cells, lowered))
                self.assertTrue(
                    all(low < size <= high for size in lowered),
                    msg=(call["n"], cells, lowered),
                )
                self.assertEqual(
                    call["ranges_outside"],
                    4 * (probes - len(set(lowered))),
                    msg=str(call),
                )
                # Nor are the ranges inside traced, at the first site either: this rank
                # holds their decisions, and the graph inlines its range's winner alone.
                self.assertEqual(call["choice_traces"], 0, msg=str(call))
        # One compile per range visited.
        self.assertEqual(sum(c["compiled"] for c in a), len(seen))
        self.assertEqual(len(seen), 3)

    def test_the_warm_up_compiles_every_range_at_its_largest_size_and_none_after(
        self,
    ):
        a, b = assert_all_ok(
            run_ranks(
                2,
                range_graphs_body,
                True,
                "",
                True,
                timeout_s=240,
                timing=ops.DesignedCosts(),
            )
        )
        self.assertEqual([c["compiled"] for c in a], [c["compiled"] for c in b])
        self.assertEqual([c["records"] for c in a], [c["records"] for c in b])
        cells = cells_of(a[0]["records"])
        tops = [top for top, _ in cells]

        def cell(n: int) -> int:
            return next(i for i, top in enumerate(tops) if n <= top)

        warm = a[0]["warm_up_sizes"]
        first, warm_up, after = a[0], a[1 : 1 + len(warm)], a[1 + len(warm) :]
        # The ladder's sizes and the tops of the ranges found between them.
        self.assertEqual(warm, [256, 120, 64, 16, 6, 4, 1])
        self.assertEqual([c["n"] for c in warm_up], warm)
        # The warm-up compiles every range the first compile did not, each at the first
        # warm-up size it holds: its largest (Inductor tunes its kernels there).
        compiled_at = [c["n"] for c in warm_up if c["compiled"]]
        self.assertEqual(
            sorted(map(cell, [first["n"], *compiled_at])),
            list(range(len(cells))),
            msg=str((cells, compiled_at)),
        )
        for n in compiled_at:
            self.assertEqual(
                n,
                max(c["n"] for c in warm_up if cell(c["n"]) == cell(n)),
                msg=str((cells, compiled_at)),
            )
        self.assertEqual(sum(c["compiled"] for c in warm_up), len(compiled_at))
        # Then every size runs its range's graph, compiling nothing: under
        # set_stance("fail_on_recompile") a compile would have raised.
        self.assertEqual(
            [c["compiled"] for c in after], [0] * len(after), msg=str(after)
        )
        for call in a:
            winner = cells[cell(call["n"])][1]
            self.assertEqual(
                call["ran"], [] if winner == "default" else [winner], msg=str(call)
            )

    def test_a_warm_restart_loads_every_range_graph_from_the_caches(self):
        def job(root: Path) -> list:
            env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "{rank}")}
            return assert_all_ok(
                run_ranks(
                    2,
                    range_graphs_body,
                    True,
                    env=env,
                    restarts=True,
                    timeout_s=240,
                    timing=ops.DesignedCosts(),
                )
            )

        root = self.tmp_path
        cold, _ = job(root)
        warm, peer = job(root)
        # The same range graphs, each loaded from the FX-graph cache (found by the range
        # guards it recorded), nothing benchmarked or traced: the decisions they inline are
        # the group's.
        self.assertEqual([c["compiled"] for c in warm], [c["compiled"] for c in cold])
        self.assertEqual([c["compiled"] for c in cold], [c["compiled"] for c in peer])
        self.assertEqual(
            [c["fx_cache_hits"] for c in warm], [c["compiled"] for c in warm]
        )
        # Each loaded graph says what it inlines.
        self.assertTrue(all(c["records"] for c in warm if c["compiled"]))
        self.assertTrue(
            all(rec.source == "cache" for c in warm for rec in c["records"]),
            msg=[c["records"] for c in warm],
        )
        self.assertEqual([c["ran"] for c in warm], [c["ran"] for c in cold])

    def test_a_data_dependent_size_runs_the_ops_own_implementation_untuned(self):
        # No choice can be traced or timed at an unbacked size (upstream's subgraph
        # choices refuse one, and failed the compile): the op's own implementation
        # (which notes nothing in ops.ran) runs at every size, from one compile, with a
        # warning that says why, and no decision to agree on: the size is the program's.
        a, b = assert_all_ok(
            run_ranks(
                2, data_dependent_size_body, timeout_s=240, timing=ops.DesignedCosts()
            )
        )
        for result in (a, b):
            self.assertEqual(result["frames"], 1, msg=str(result))
            self.assertEqual(result["records"], [], msg=str(result))
            self.assertTrue(
                all(call["ran"] == [] for call in result["calls"]), msg=result
            )
            warned = [m for m in result["logged"] if "data-dependent" in m]
            self.assertTrue(warned, msg=result["logged"])
            self.assertIn("own implementation runs", warned[0], msg=result["logged"])

    @parametrize("forbid", ["knob", "error_on_recompile", "recompile_limit"])
    def test_where_a_range_cannot_be_guarded_the_graph_dispatches_by_size_inside(
        self, forbid
    ):
        a, b = assert_all_ok(
            run_ranks(
                2,
                range_graphs_body,
                forbid != "knob",
                forbid,
                timeout_s=240,
                timing=ops.DesignedCosts(),
            )
        )
        self.assertEqual([c["records"] for c in a], [c["records"] for c in b])
        cells = cells_of(a[0]["records"])
        # One compile, whose four sites dispatch by size; every size runs its winner.
        self.assertEqual([c["compiled"] for c in a], [1] + [0] * (len(a) - 1))
        self.assertEqual(a[0]["dispatching_sites"], 4)
        self.assertEqual(a[0]["guarded_sites"], 0)
        for call in a:
            winner = next(w for top, w in cells if call["n"] <= top)
            self.assertEqual(
                call["ran"], [] if winner == "default" else [winner], msg=str(call)
            )
        # Each site logs that it dispatches inside, and why.
        reason = {
            "knob": "collective_autotune_range_graphs is off",
            "error_on_recompile": "error_on_recompile forbids",
            "recompile_limit": "more than half of Dynamo's recompile limit (4",
        }[forbid]
        dispatching = [m for m in a[0]["dispatch_log"] if "dispatches by size" in m]
        self.assertEqual(len(dispatching), 4, msg=str(a[0]["dispatch_log"]))
        self.assertTrue(all(reason in m for m in dispatching), msg=a[0]["dispatch_log"])


instantiate_parametrized_tests(TestGraphSessions)


if __name__ == "__main__":
    run_tests()
