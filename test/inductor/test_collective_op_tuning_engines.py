# Owner(s): ["module: inductor"]
"""Serving engines' compile flows: every size runs its range's winner, however the
engine compiles the model.

vLLM compiles its model once, at its largest batch, with every Dynamo guard filtered
out (``guard_filter_fn=torch.compiler.skip_all_guards_unsafe``); splits the graph at its
attention ops and compiles each piece with Inductor (``compile_fx`` or
``standalone_compile``) for the general size, per compile size and per compile range;
and can ``aot_compile`` the model and load it in a later process. Each test compiles a
model whose tuned all-reduce changes winner along the token dimension as an engine
does, and checks by what ran (each implementation marks its calls) that every size ran
its range's winner, that the outputs are right, and that nothing compiled after the
warm-up. The choices' costs are given (``given_timings``), at least 3x apart: no verdict
depends on the host's speed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._guards import detect_fake_mode
from torch._inductor.kernel.collective.api import (
    collective_autotune_size_paths,
    winner_change_points,
)
from torch._inductor.kernel.collective.records import SizePath
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import collective_ops as ops
from collective_harness import (
    assert_all_ok,
    CollectiveTestCase,
    given_timings,
    Rank,
    run_ranks,
)


# The ladder's sizes: 1, 4, 16, 64, 256 and LADDER_MAX, which stands for every size
# above 256; the walk times sizes between two of them where their winners differ.
LADDER_MAX = 1024
LARGEST = 1000  # the engine's largest batch, its first call
# On the ladder, and strictly between its sizes next to each case's crossovers.
SIZES = (2, 6, 7, 8, 16, 17, 31, 32, 40, 64, 65, 200, 255, 256, 257, LARGEST)
HIDDEN = 16


@dataclasses.dataclass(frozen=True)
class Case:
    """Implementations of the all-reduce and their given cost (us per call) by rows."""

    implementations: tuple[str, ...]
    cost: Callable[[str, int], float]

    def winner_at(self, rows: int) -> str:
        """The best choice at ``rows``."""
        return min((*self.implementations, "default"), key=lambda c: self.cost(c, rows))

    def loss(self, ran: list[str], rows: int) -> float:
        """How much slower than the best choice what ran at ``rows`` is (inf where not
        one choice ran)."""
        if len(ran) != 1:
            return math.inf
        return self.cost(ran[0], rows) / self.cost(self.winner_at(rows), rows) - 1


def _crossovers(choice: str, rows: int) -> float:
    # steep wins up to 6 rows, gentle from 7 (they cross at 6.2, between the ladder's 4
    # and 16), flat from 253: at the ladder's 256 gentle is 0.9% behind flat, a near
    # tie that the range of 256 decides for gentle, the choice below it.
    return {
        "steep": 3 + 2 * rows,
        "gentle": 15 + 20 * rows / 252,
        "flat": 35,
    }.get(choice, 1000)


def _sweet_spot(choice: str, rows: int) -> float:
    # constant wins at both ends of the ladder, sweet only from 32 to 256 (at 64 and
    # 256 of the ladder): the ranges between two that agree are screened, not filled,
    # and the steps at 32 and 257 are found between the ladder's sizes.
    return {
        "constant": 20,
        "sweet": 2 if 32 <= rows <= 256 else 60,
        "linear": 30 + rows / 2,
    }.get(choice, 200)


CASES = {
    # Three implementations that cross between the ladder's sizes, and near one.
    "crossovers": Case(("steep", "gentle", "flat"), _crossovers),
    # Three, of which the middle one wins only at middle sizes.
    "sweet_spot": Case(("constant", "sweet", "linear"), _sweet_spot),
}


def register(case: Case) -> None:
    ops.register_all_reduce(*(ops.marked(name) for name in case.implementations))


def make_model(group: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Two layers around a boundary op (an engine's attention), one tuned all-reduce
    each: the all-reduce of a matmul's output, and one of a pointwise producer."""
    gen = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(HIDDEN, HIDDEN, generator=gen) / 8 for _ in range(2))

    def model(x: torch.Tensor) -> torch.Tensor:
        h = ops.boundary(ops.all_reduce(x @ w1, group))
        return ops.all_reduce(torch.relu(h) @ w2, group) + h

    return model


def tokens(n: int, marked: bool = True) -> torch.Tensor:
    """``n`` tokens' hidden states, their count ``marked`` dynamic as an engine marks
    it (an aot_compile-d function is compiled with dynamic=True instead: it guards
    that its inputs carry no marks)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, HIDDEN, generator=gen)
    if marked:
        torch._dynamo.mark_dynamic(x, 0)
    return x


def inductor_compiles() -> int:
    """Graphs Inductor compiled or loaded so far (one FX-graph cache lookup each)."""
    return sum(
        counters["inductor"][k]
        for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    )


def run_sizes(compiled: Callable, model: Callable, marked: bool = True) -> dict:
    """Call ``compiled`` at every size twice (a warm-up, then the calls checked): what
    each size ran the second time, checked against eager, and what compiled then."""
    for n in SIZES:
        compiled(tokens(n, marked))
    before = inductor_compiles()
    ran = {}
    for n in SIZES:
        x = tokens(n, marked)
        ops.ran.clear()
        out = compiled(x)
        ran[n] = sorted(set(ops.ran))
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    return {"ran": ran, "compiled_after_warm_up": inductor_compiles() - before}


# -- a serving engine's backend ---------------------------------------------------------


class SplittingBackend:
    """What vLLM's backend does: split Dynamo's graph at every boundary op and compile
    each piece between them with Inductor (``compile_fx``, or ``standalone_compile``)
    for every size; then, at its first call of each, a piece per compile size (static)
    and per compile range (the general piece's fake inputs, the range in
    ``collective_autotune_compile_range``). Each call runs the piece compiled for its
    size."""

    def __init__(
        self,
        compiler: str = "compile_fx",
        sizes: tuple[int, ...] = (),
        ranges: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.compiler = compiler
        self.sizes = sizes
        self.ranges = ranges
        self.frames = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch.fx.passes.split_module import split_module

        self.frames += 1
        piece = 0

        def split_at_boundaries(node: torch.fx.Node) -> int:
            nonlocal piece
            if node.target is torch.ops.cat_test.boundary.default:
                piece += 1
                at = piece
                piece += 1
                return at
            return piece

        split = split_module(gm, None, split_at_boundaries, keep_original_order=True)
        # The inputs faked in the backend's fake mode, as vLLM fakes them (their
        # symbols are Dynamo's).
        fake_mode = detect_fake_mode()
        fake_inputs = [
            fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
            for t in example_inputs
        ]
        with fake_mode:
            _PieceCompiler(split, self).run(*fake_inputs)
        return split

    def compile(
        self, piece: torch.fx.GraphModule, inputs: list, dynamic_shapes: str, **config
    ) -> Callable:
        """``piece`` compiled as vLLM compiles it: the general size in the backend
        (``compile_fx``, or ``standalone_compile`` from the tracing context), a compile
        size from its example inputs, a compile range from the graph's fake tensors."""
        from torch._inductor.compile_fx import compile_fx

        piece = copy.deepcopy(piece)  # Inductor takes the graph it compiles
        with torch._inductor.config.patch(config):
            if (
                dynamic_shapes == "from_tracing_context"
                and self.compiler == "compile_fx"
            ):
                return compile_fx(piece, inputs)
            return torch._inductor.standalone_compile(
                piece, inputs, dynamic_shapes=dynamic_shapes, options={}
            )


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on Dynamo's fake inputs, compiling each piece that holds
    no boundary op on the inputs it meets."""

    def __init__(self, split: torch.fx.GraphModule, backend: SplittingBackend) -> None:
        super().__init__(split)
        self.backend = backend

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        piece = self.fetch_attr(target)
        out = piece(*args, **kwargs)
        if not any(
            n.target is torch.ops.cat_test.boundary.default for n in piece.graph.nodes
        ):
            setattr(self.module, target, _Piece(piece, list(args), self.backend))
        return out


class _Piece(torch.nn.Module):
    """One piece: compiled for every size now, per compile size and range at the
    first call that needs it, as vLLM's PiecewiseBackend does."""

    def __init__(self, piece, fake_inputs: list, backend: SplittingBackend) -> None:
        super().__init__()
        self.piece, self.fake_inputs, self.backend = piece, fake_inputs, backend
        self.general = backend.compile(piece, fake_inputs, "from_tracing_context")
        self.by_size: dict[int, Callable] = {}
        self.by_range: dict[tuple[int, int], Callable] = {}

    def forward(self, *args: Any) -> Any:
        n = next(a for a in args if isinstance(a, torch.Tensor)).shape[0]
        if n in self.backend.sizes:
            if n not in self.by_size:
                self.by_size[n] = self.backend.compile(
                    self.piece, list(args), "from_example_inputs"
                )
            return self.by_size[n](*args)
        covering = next((r for r in self.backend.ranges if r[0] <= n <= r[1]), None)
        if covering is not None:
            if covering not in self.by_range:
                self.by_range[covering] = self.backend.compile(
                    self.piece,
                    self.fake_inputs,
                    "from_graph",
                    collective_autotune_compile_range=covering,
                )
            return self.by_range[covering](*args)
        return self.general(*args)


# -- the flows ----------------------------------------------------------------------------


def guard_filtered(backend: Any) -> Callable[[Callable], Callable]:
    """torch.compile as vLLM calls it: every guard filtered out."""
    return lambda model: torch.compile(
        model,
        backend=backend,
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
    )


def aot_compiled(model: Callable) -> Callable:
    """vLLM's AOT path: the model compiled ahead of time at its largest batch."""
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    return compiled.aot_compile(((tokens(LARGEST, marked=False),), {}))


def flow(r: Rank, name: str, compile_model: Callable[[Callable], Callable]) -> dict:
    """One engine flow: the model compiled by ``compile_model``, called first at the
    largest size, then at every size; what ran, what compiled, and how each site ran
    its sizes (its size path records)."""
    torch._dynamo.reset()
    model = make_model(r.group.group_name)
    paths = len(collective_autotune_size_paths())
    compiled = compile_model(model)
    marked = compile_model is not aot_compiled
    compiled(tokens(LARGEST, marked))
    result = run_sizes(compiled, model, marked)
    return {
        "flow": name,
        **result,
        "paths": [(p.path, p.reason) for p in collective_autotune_size_paths()[paths:]],
    }


def engine_flows_body(r: Rank, case_name: str) -> list[dict]:
    """Every flow of a serving engine, one after the other in one job (the group
    tunes the ladder once, in the first): vLLM's guard-filtered compile (after a plain
    one cached a range graph under the same key), its splitting backend with
    compile_fx and with standalone_compile, compile sizes, compile ranges at the
    winner-change points, and aot_compile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = CASES[case_name]
    register(case)
    results = []
    with (
        given_timings(case.cost),
        torch._inductor.config.patch(collective_autotune_dynamic_max=LADDER_MAX),
        torch._dynamo.config.patch(enable_aot_compile=True),
    ):
        plain = CompileCounterWithBackend("inductor")
        results.append(flow(r, "plain", lambda m: torch.compile(m, backend=plain)))
        filtered = CompileCounterWithBackend("inductor")
        results.append(flow(r, "guard_filter", guard_filtered(filtered)))
        results[-1]["frames"] = filtered.frame_count
        points = winner_change_points()
        results[-1]["points"] = points
        bounds = [1, *points, LARGEST]
        for name, backend in (
            ("split_compile_fx", SplittingBackend("compile_fx")),
            ("split_standalone", SplittingBackend("standalone_compile")),
            ("compile_sizes", SplittingBackend(sizes=(8, 200))),
            (
                "compile_ranges",
                SplittingBackend(
                    ranges=tuple((a + 1, b) for a, b in zip(bounds, bounds[1:]))
                ),
            ),
        ):
            results.append(flow(r, name, guard_filtered(backend)))
            results[-1]["frames"] = backend.frames
        results.append(flow(r, "aot_compile", aot_compiled))
    return results


def restart_body(r: Rank, case_name: str, saved: str, restarted: bool) -> dict:
    """A serving engine's job, first (``restarted`` False) or restarted on the first's
    caches: the model compiled with its guards filtered out, and aot_compile-d and
    saved (first) or loaded (restarted: nothing compiled); what each size ran, where
    the guard-filtered compile's decisions came from, and the winner-change points."""
    from torch._inductor.kernel.collective.api import collective_autotune_records

    case = CASES[case_name]
    register(case)
    # What an engine reads before it compiles anything, to set its compile ranges.
    before = winner_change_points(ops.all_reduce)
    path = Path(saved) / f"rank{r.rank}.pt2"
    with (
        given_timings(case.cost),
        torch._inductor.config.patch(collective_autotune_dynamic_max=LADDER_MAX),
        torch._dynamo.config.patch(enable_aot_compile=True),
    ):
        filtered = flow(r, "guard_filter", guard_filtered("inductor"))
        result = {
            "filtered": filtered["ran"],
            "sources": sorted(
                {rec.source.value for rec in collective_autotune_records()}
            ),
            "points": winner_change_points(),
            "points_before_compiling": before,
        }
        model = make_model(r.group.group_name)
        if restarted:
            with open(path, "rb") as f:
                compiled = torch.compiler.load_compiled_function(f)
        else:
            compiled = aot_compiled(model)
            compiled.save_compiled_function(str(path))
        result["aot"] = run_sizes(compiled, model, marked=False)
        return result


def assert_every_size_ran_its_winner(
    test: CollectiveTestCase, case: Case, flows: list[dict]
) -> None:
    """Every size, on the ladder and between its sizes, ran one choice within 2% of
    the best there."""
    for f in flows:
        losses = {n: case.loss(ran, n) for n, ran in f["ran"].items()}
        test.assertEqual(sorted(losses), sorted(SIZES), msg=str(f["flow"]))
        test.assertLessEqual(max(losses.values()), 0.02, msg=str((f["flow"], f["ran"])))
        test.assertEqual(f["compiled_after_warm_up"], 0, msg=str(f))
        test.assertEqual(f.get("frames", 1), 1, msg=str(f))


class TestServingEngines(CollectiveTestCase):
    @parametrize("world_size", [2, 4])
    @parametrize("case_name", list(CASES))
    def test_every_engine_flow_runs_each_sizes_winner(self, world_size, case_name):
        case = CASES[case_name]
        results = assert_all_ok(
            run_ranks(world_size, engine_flows_body, case_name, timeout_s=600)
        )
        flows = {f["flow"]: f for f in results[0]}
        for other in results[1:]:
            self.assertEqual([f["ran"] for f in other], [f["ran"] for f in results[0]])
        assert_every_size_ran_its_winner(self, case, results[0])
        # The winners change where the costs cross, between the ladder's sizes too.
        expected_points = {"crossovers": [6, 256], "sweet_spot": [31, 256]}[case_name]
        self.assertEqual(flows["guard_filter"]["points"], expected_points)
        # Plain torch.compile guards its graph on a range; where the guards are
        # filtered out, the cached range graph is passed over and the graph dispatches
        # by size inside, saying why.
        # (A later site of a range graph knows its range from the first site's guard.)
        plain = [p for p, _ in flows["plain"]["paths"]]
        self.assertIn(SizePath.RANGE_GRAPH, plain)
        self.assertNotIn(SizePath.SIZE_DISPATCH, plain)
        for name in ("guard_filter", "split_compile_fx", "aot_compile"):
            paths = flows[name]["paths"]
            self.assertTrue(paths, msg=paths)
            self.assertEqual(
                {p for p, _ in paths}, {SizePath.SIZE_DISPATCH}, msg=str(paths)
            )
        self.assertTrue(
            all(
                "guard_filter_fn (skip_all_guards_unsafe) drops its shape guards" in why
                for _, why in flows["guard_filter"]["paths"]
            ),
            msg=flows["guard_filter"]["paths"],
        )
        self.assertTrue(
            all(
                "not compiled by a Dynamo frame's guarded compile" in why
                for _, why in flows["aot_compile"]["paths"]
            ),
            msg=flows["aot_compile"]["paths"],
        )
        # Each compile range inlines one winner per site: no dispatch, no guard.
        ranged = [p for p, _ in flows["compile_ranges"]["paths"]]
        self.assertIn(SizePath.KNOWN_RANGE, ranged)
        self.assertNotIn(SizePath.RANGE_GRAPH, ranged)

    def test_a_restarted_engine_loads_its_graphs_and_runs_each_sizes_winner(self):
        """Warm caches: the guard-filtered compile loads its graph (nothing timed) and
        the winner-change points come back; an aot_compile-d model saved by the first
        job runs every size's winner in the second, compiling nothing."""
        case = CASES["sweet_spot"]
        expected = {n: [case.winner_at(n)] for n in SIZES}  # no near tie in this case
        env = {"TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "cache{rank}")}
        jobs = [
            assert_all_ok(
                run_ranks(
                    2,
                    restart_body,
                    "sweet_spot",
                    str(self.tmp_path),
                    restarted,
                    env=env,
                    restarts=True,
                )
            )
            for restarted in (False, True)
        ]
        for job in jobs:
            for rank in job:
                self.assertEqual(rank["filtered"], expected, msg=str(rank))
                self.assertEqual(rank["points"], [31, 256], msg=str(rank))
        # The restarted job read the first job's points before it compiled anything.
        self.assertEqual([r["points_before_compiling"] for r in jobs[0]], [[], []])
        self.assertEqual(
            [r["points_before_compiling"] for r in jobs[1]], [[31, 256], [31, 256]]
        )
        for job in jobs:
            for rank in job:
                self.assertEqual(rank["aot"]["ran"], expected, msg=str(rank))
                self.assertEqual(
                    rank["aot"]["compiled_after_warm_up"], 0, msg=str(rank)
                )
        self.assertTrue(all("benchmark" in rank["sources"] for rank in jobs[0]))
        self.assertTrue(
            all(rank["sources"] == ["cache"] for rank in jobs[1]), msg=jobs[1]
        )


instantiate_parametrized_tests(TestServingEngines)


if __name__ == "__main__":
    run_tests()
