# Owner(s): ["module: inductor"]
"""A tuned collective op inside vLLM 0.33.0's own compile pipeline, on gloo.

``@support_torch_compile`` -> its guard-free wrapper (AOT compile by default on torch
2.14) -> ``VllmBackend`` -> ``split_graph`` at the splitting op -> ``PiecewiseBackend``
-> ``InductorStandaloneAdaptor`` (``standalone_compile``). The model's two all-reduces
have two implementations that cross at 1000 tokens (20 us a token against a flat 20
ms, given: no verdict depends on the host's speed). What ran is read from the marks the
implementations leave (collective_ops.marked), at sizes on the ladder and strictly
inside its ranges, and every output is checked against eager.

vLLM runs from ``make test-vllm``'s venv (vllm==0.33.0 installed --no-deps beside the
packages its compile path imports). The workarounds, all for the missing GPU, are in
:func:`engine_config` and :func:`_define_missing_vllm_schemas`, each saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import unittest
from collections.abc import Callable
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
    assert_all_ok,
    CollectiveTestCase,
    Rank,
    run_ranks,
)

try:
    from examples.vllm import compile_ranges
except ImportError:
    raise unittest.SkipTest("needs vLLM 0.33.0: make test-vllm") from None


HIDDEN = 16
MAX_TOKENS = 4096  # max_num_batched_tokens; also the ladder's top
# The ladder (ratio 4 up to MAX_TOKENS): 1, 4, 16, 64, 256, 1024, 4096.
ON_LADDER = (16, 256, 1024, 4096)
INSIDE_RANGES = (8, 512, 768, 2048)
SIZES = tuple(sorted(ON_LADDER + INSIDE_RANGES))
# Where the winners change: 992, the roundest size between the ladder's 256 and 1024
# where the two lie within 2% (they cross at 1000).
POINTS = [992]


@dataclasses.dataclass(frozen=True)
class TokenCosts:
    """The implementations' given cost in us per call by tokens: "small" 20 a token,
    "large" a flat 20 ms (they cross at 1000 tokens), the op's own far behind; and the
    host's contention while they are timed (0.4 makes every pick provisional)."""

    host_contention: float = 0.0

    def __call__(self, choice: str, rows: int) -> float:
        return {"small": 20.0 * rows, "large": 20e3}.get(choice, 1e6)

    def contention(self, choice: str, rows: int) -> float:
        return self.host_contention

    def best(self, rows: int) -> str:
        return min(("small", "large"), key=lambda c: self(c, rows))


QUIET, LOADED = TokenCosts(), TokenCosts(host_contention=0.4)


def right_answer(sizes: tuple[int, ...] = SIZES) -> dict[int, list[str]]:
    return {n: [QUIET.best(n)] for n in sizes}


# -- the engine ---------------------------------------------------------------------------


def _define_missing_vllm_schemas() -> None:
    """Workaround (no GPU): vLLM's CUDA wheel cannot load its ``_C`` extension here,
    and its fusion passes name ``torch.ops._C.rotary_embedding`` when imported."""
    if not hasattr(torch.ops._C, "rotary_embedding"):
        lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901
        lib.define(
            "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, "
            "int head_size, Tensor cos_sin_cache, bool is_neox) -> ()"
        )
        _libraries.append(lib)


_libraries: list[Any] = []


@dataclasses.dataclass(frozen=True)
class Job:
    """One engine job's compile settings: vLLM's ``compile_sizes`` and
    ``compile_ranges_endpoints``, and whether the engine passes each range to Inductor
    (``range_hook``: the one-line addition of examples/vllm/compile_ranges.py)."""

    compile_sizes: tuple[int, ...] = ()
    endpoints: tuple[int, ...] | None = None
    range_hook: bool = False


def engine_config(job: Job) -> Any:
    from vllm.config import (
        CompilationConfig,
        CompilationMode,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.config.compilation import CUDAGraphMode, PassConfig

    config = VllmConfig(
        compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE,
            splitting_ops=["cat_test::boundary"],  # the engine's attention
            cudagraph_mode=CUDAGraphMode.NONE,  # no GPU
            # Workaround (no GPU): vLLM leaves compile_sizes None off CUDA, and
            # PiecewiseBackend then finds no range for any size.
            compile_sizes=list(job.compile_sizes),
            compile_ranges_endpoints=(
                None if job.endpoints is None else list(job.endpoints)
            ),
            # Workaround (no platform): vLLM turns this fusion on by default, and
            # imports its pass on CUDA and ROCm only (NameError in its pass manager).
            pass_config=PassConfig(fuse_rope_kvcache_cat_mla=False),
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_TOKENS,
            max_model_len=MAX_TOKENS,
            is_encoder_decoder=False,
        ),
        # Workaround (no GPU): the device vLLM would detect. vLLM's own CPU platform
        # (VLLM_TARGET_DEVICE=cpu) is not used: it replaces VllmBackend by plain
        # Inductor (CompilationMode.DYNAMO_TRACE_ONCE), so nothing here would run.
        device_config=DeviceConfig(device="cpu"),
    )
    # What vLLM's worker does for its rank: the rank names its compile cache folders.
    config.parallel_config.rank = dist.get_rank()
    return config


def make_model_class() -> type:
    from vllm.compilation.decorators import support_torch_compile

    # The token dimension of x (this module's postponed annotations hide its type).
    @support_torch_compile(dynamic_arg_dims={"x": 0})
    class TwoLayers(torch.nn.Module):
        """Two layers around the engine's attention, one tuned all-reduce each."""

        def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.w1, self.w2 = (
                torch.nn.Parameter(
                    torch.randn(HIDDEN, HIDDEN, generator=gen) / 8, requires_grad=False
                )
                for _ in range(2)
            )
            self.group_name = dist.group.WORLD.group_name

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = ops.boundary(ops.all_reduce(x @ self.w1, self.group_name))
            return ops.all_reduce(torch.relu(h) @ self.w2, self.group_name) + h

    return TwoLayers


def eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = ops.boundary(ops.all_reduce(x @ model.w1, model.group_name))
    return ops.all_reduce(torch.relu(h) @ model.w2, model.group_name) + h


def tokens(n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n))


@functools.cache
def _compile_counters() -> Callable[[], dict[str, int]]:
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    def read() -> dict[str, int]:
        return {
            "inductor_compiles": compilation_counter.num_inductor_compiles,
            "aot_compiles": compilation_counter.num_aot_compiles,
            "fx_graph_lookups": sum(
                counters["inductor"][k]
                for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")
            ),
        }

    return read


def engine_job(r: Rank, job: Job) -> dict[str, Any]:
    """A vLLM engine job on this rank: the model built and called at its largest
    batch first (vLLM's profile run compiles it), then at every size twice; what each
    size ran the second time, what the first call compiled, the winner-change points
    and where each decision came from."""
    from torch._inductor.kernel.collective.api import collective_autotune_records
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    _define_missing_vllm_schemas()
    ops.register_all_reduce(ops.marked("small"), ops.marked("large"))
    config = engine_config(job)
    counters = _compile_counters()
    with (
        torch._inductor.config.patch(collective_autotune_dynamic_max=MAX_TOKENS),
        engine_range_hook(job.range_hook),
        set_current_vllm_config(config),
    ):
        # What an engine reads to set its compile ranges before it compiles.
        points_before_compiling = compile_ranges.split_points()
        model = make_model_class()(vllm_config=config)
        start = counters()
        with set_forward_context(None, config):
            model(tokens(MAX_TOKENS))
        compiled = {k: v - start[k] for k, v in counters().items()}
        points = compile_ranges.split_points()
        with set_forward_context(None, config):
            for n in SIZES:
                model(tokens(n))
        warm = counters()
        ran = {}
        for n in SIZES:
            x = tokens(n)
            ops.ran.clear()
            with set_forward_context(None, config):
                out = model(x)
            ran[n] = sorted(set(ops.ran))
            torch.testing.assert_close(out, eager(model, x), rtol=1e-4, atol=1e-4)
        after_warm_up = {k: v - warm[k] for k, v in counters().items()}
    return {
        "ran": ran,
        "compiled": compiled,
        "compiled_after_warm_up": after_warm_up,
        "points": points,
        "points_before_compiling": points_before_compiling,
        "sources": sorted({rec.source.value for rec in collective_autotune_records()}),
        # The ladder's decisions (one per size it was timed at) and where each came
        # from.
        "ladder_sources": sorted(
            {
                rec.source.value
                for rec in collective_autotune_records()
                if rec.size is not None
            }
        ),
        "provisional": any(rec.provisional for rec in collective_autotune_records()),
    }


def engine_range_hook(on: bool) -> Any:
    """The engine's per-range Inductor config (examples/vllm/compile_ranges.py)."""
    import contextlib

    if not on:
        return contextlib.nullcontext()
    from unittest import mock

    import vllm.compilation.compiler_interface as compiler_interface

    return mock.patch.object(
        compiler_interface,
        "set_inductor_config",
        compile_ranges.set_inductor_config_with_range,
    )


# -- the jobs ------------------------------------------------------------------------------


class EngineJobs:
    """Jobs of one engine on one host: their caches (vLLM's root, each rank's Inductor
    cache dir, and so the decisions kept in it) outlive each job."""

    def __init__(self, root: Path, world_size: int, **env: str) -> None:
        self.root, self.world_size = root, world_size
        self.env = {
            "VLLM_CACHE_ROOT": str(root / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor{rank}"),
            **env,
        }

    def run(self, job: Job = Job(), costs: TokenCosts = QUIET) -> list[dict]:
        return assert_all_ok(
            run_ranks(
                self.world_size,
                engine_job,
                job,
                env=self.env,
                timing=costs,
                restarts=True,
                timeout_s=600,
            )
        )

    def forget_engine_artifacts(self) -> None:
        """vLLM's own cache (its saved artifacts and their handles) removed: the next
        job compiles again, and meets Inductor's caches and the kept decisions."""
        shutil.rmtree(self.root / "vllm", ignore_errors=True)

    def forget_inductor_cache(self, rank: int) -> None:
        shutil.rmtree(self.root / f"inductor{rank}", ignore_errors=True)


def assert_ran(test: CollectiveTestCase, results: list[dict], sizes=SIZES) -> None:
    """Every rank ran each size's best choice under the given costs."""
    for rank in results:
        ran = {n: rank["ran"][n] for n in sizes}
        test.assertEqual(ran, right_answer(sizes), msg=str(rank["ran"]))


class TestVllmPipeline(CollectiveTestCase):
    def test_default_aot_flow_warm_restart_and_a_config_change(self):
        """vLLM's default flow on torch 2.14 (AOT compile, the mega artifact): a cold
        job tunes and saves; a restart loads the saved model and compiles nothing; a
        new config (compile sizes, and compile ranges at the split points with the
        range hook: a new config hash, so a new Inductor cache folder) compiles again
        and keeps the ladder's decisions (a compile size is timed at its size)."""
        jobs = EngineJobs(self.tmp_path, 2)
        cold = jobs.run()
        assert_ran(self, cold)
        for rank in cold:
            self.assertIn("benchmark", rank["sources"])
            self.assertEqual(rank["points"], POINTS)
            # Nothing was kept yet: the engine compiles one range.
            self.assertEqual(rank["points_before_compiling"], [])
        warm = jobs.run()
        assert_ran(self, warm)
        for rank in warm:
            self.assertEqual(rank["compiled"]["inductor_compiles"], 0, msg=str(rank))
            self.assertEqual(rank["compiled"]["aot_compiles"], 0, msg=str(rank))
            # The cold job's split points, read before anything compiled (vLLM loaded
            # its artifact: nothing of ours ran), for compile_ranges_endpoints.
            self.assertEqual(rank["points_before_compiling"], POINTS, msg=str(rank))
        # The config changed: compile sizes, and compile ranges split where the
        # winners change, each range handed to Inductor (examples/vllm).
        changed = jobs.run(
            Job(
                compile_sizes=(8, 512),
                endpoints=tuple(cold[0]["points"]),
                range_hook=True,
            )
        )
        assert_ran(self, changed)
        for rank in changed:
            self.assertGreater(rank["compiled"]["inductor_compiles"], 0)
            # The ladder's decisions were kept (a compile size is a key of its own,
            # timed at its size).
            self.assertTrue(rank["ladder_sources"], msg=str(rank))
            self.assertNotIn("benchmark", rank["ladder_sources"], msg=str(rank))
        for result in (cold, warm, changed):
            for rank in result:
                self.assertEqual(rank["compiled_after_warm_up"]["inductor_compiles"], 0)

    @parametrize("world_size", [2, 4])
    def test_standalone_path_repeated_jobs_never_lose_the_artifact(self, world_size):
        """VLLM_USE_AOT_COMPILE=0 with vLLM's compile cache on (also the path on torch
        before 2.12): standalone_compile's artifact must hold exactly one AOTAutograd
        entry, or vLLM raises "The compiled artifact is not serializable". Jobs on one
        cache root, among them a job whose picks are provisional (a loaded host, then
        timed again), and jobs where one rank's Inductor cache is gone, so that its
        peers' cache hits are refused by the group (the hit they recorded must not stay
        beside the entry compiled instead). Every job runs, every size its winner."""
        # A rank of four on 2 cores, beside make test's other lanes, can reach a
        # benchmark's first collective more than the default 30 s after its peers
        # (seen once: every rank then stops, as it should); no job here waits on an
        # absent rank, so a longer bound changes nothing else.
        jobs = EngineJobs(
            self.tmp_path,
            world_size,
            VLLM_USE_AOT_COMPILE="0",
            TORCHINDUCTOR_COLLECTIVE_BENCHMARK_TIMEOUT="120",
        )
        last = world_size - 1
        # (costs, forget vLLM's artifacts, the rank whose Inductor cache is removed)
        plan = [
            (LOADED, False, None),  # provisional picks, saved
            (QUIET, False, None),  # vLLM loads what it saved, provisional picks too
            (QUIET, True, None),  # compiled again: the provisional ones timed again
            (QUIET, True, last),  # the other ranks' cache hits refused
            (QUIET, False, None),
            (LOADED, True, None),  # the kept decisions, screened: settled
            (QUIET, True, None),  # every rank hits its caches: loaded
            (QUIET, False, None),
            (QUIET, True, 0),  # refused on the ranks after rank 0
            (QUIET, False, None),
        ]
        if world_size == 4:  # four ranks on 2 cores: the jobs that matter
            plan = plan[:4]
        for i, (costs, forget_artifacts, wiped_rank) in enumerate(plan):
            if forget_artifacts:
                jobs.forget_engine_artifacts()
            if wiped_rank is not None:
                jobs.forget_inductor_cache(wiped_rank)
            results = jobs.run(costs=costs)
            assert_ran(self, results)
            for rank in results:
                self.assertEqual(rank["compiled_after_warm_up"]["inductor_compiles"], 0)
            if i == 0:
                self.assertTrue(all(rank["provisional"] for rank in results))
            if i == 1:  # loaded: nothing compiled, nothing timed
                for rank in results:
                    self.assertEqual(rank["compiled"]["inductor_compiles"], 0)
            if i == 2:
                self.assertTrue(all("benchmark" in r["sources"] for r in results))
                self.assertFalse(any(rank["provisional"] for rank in results))


instantiate_parametrized_tests(TestVllmPipeline)


if __name__ == "__main__":
    run_tests()
