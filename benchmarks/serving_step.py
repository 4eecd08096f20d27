"""Step time of a serving-shaped model compiled once for every batch size.

One rank per GPU, under torchrun (the overlay applied):

    torchrun --nproc_per_node=N benchmarks/serving_step.py --out benchmarks/results/serving_h200xN.json

CPU smoke test (gloo, fp32, hidden 256, the functional all-reduce and the op's own, eager):

    torchrun --nproc_per_node=2 benchmarks/serving_step.py --device cpu --out /tmp/serving.json

The model is a stack of ``--layers`` tensor-parallel layers ``x = x + all_reduce(relu(x @ w))``
(``x + all_reduce(x @ w)`` with ``--no-producer``: no pointwise work for an inlined
all-reduce to fuse into its input's copy; hidden 4096, bf16 on GPUs), its all-reduce
examples/tp_allreduce's ``tp_demo::all_reduce``
registered with NCCL (``one_all_reduce``, inlined functional collectives) and the
symmetric-memory one-shot and two-shot kernels (opaque custom ops); the op's own
implementation (clone + ``dist.all_reduce``) is always a choice. What a user gets is the
model's step: µs per call of the whole compiled model, back to back, slowest rank, at
every size, in each mode ("graph": ``mode="reduce-overhead"``, CUDA graphs; "eager": the
default mode). Per mode:

  * dynamic: compiled with a dynamic token dimension (``maybe_mark_dynamic``,
    ``backed_size_oblivious``; the hidden size stays static, as in a served model),
    tuned at a ladder of sizes at the first compile; where the winners change along it,
    one graph per merged range (kernel/collective/range_graphs.py), compiled during the
    warm-up that the docs give a serving engine (``warm_up_sizes()``, from the top down:
    each range at its largest size; per size: the range that runs it, what its first
    call compiled and cost), and no compile after; with
    TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_RANGE_GRAPHS=0, one graph dispatching by size;
  * engine: the dynamic model compiled as a serving engine compiles it (vLLM): first
    called at the largest size, every Dynamo guard filtered out
    (``guard_filter_fn=torch.compiler.skip_all_guards_unsafe``), so that no range guard
    is checked and the graph dispatches by size inside; set against ``dynamic`` paired
    by round, and its host µs per call beside;
  * static: the model compiled at each size alone, tuned by us (one compile per size);
  * alone: the model compiled once (dynamic) with each implementation written in
    (``one_all_reduce`` is the plain NCCL all-reduce a user would write; ``default``,
    the op's own, is the model with ``collective_autotune=False``);
  * table: the model compiled once (dynamic) with ``tp_demo::table_all_reduce`` written
    in, which picks at run time by message size from vLLM's hand-set thresholds (the
    symmetric-memory one-shot kernel standing for vLLM's custom all-reduce, two-shot up
    to the table's limit for the world size, the op's own NCCL above; NCCL where the
    table lists neither world size nor device), as serving engines pick their all-reduce.
    Per size: its pick, and whether the tuned dynamic model is no slower than it (and
    faster where its pick is not the best single implementation).

Every variant is compiled and warmed up first (the host's µs per call are taken too: the
guard check and the launches, device not waited for); then each size's step is sampled
in rounds, every variant once a round in an order of the round's own, each sample after
as many untimed calls of its own variant (``ROUNDS`` samples of ``calls`` back-to-back
calls each, median, slowest rank, Python's garbage collector off; every sample is kept),
so that a drift of the machine, or a power-capped GPU's clocks set by what ran before,
hits every variant alike; the goals are judged on the median of
each round's pair of samples (``paired_pct``). Each
variant counts its compiles (recompiles: compiles - 1 for a dynamic variant) and
Inductor's cudagraph skips (``counters["inductor"]["cudagraph_skips"]``). The dynamic
compile's seconds are also taken with ``collective_autotune=False`` (the op's own, no
ladder), after one such compile that builds the model's own kernels for both: the
difference is what tuning the ladder adds to the compile. That first tuned compile also
compiles the kernels of the modules it benchmarks, unless the machine's kernel cache
holds them from an earlier job; tuned compiles again (a group of their own, so their
decisions are made afresh), each followed by an untuned compile again, paired with it
(taken first, untuned compiles read up to 0.4 s slower on one H200), show what tuning
adds once they are cached; and both, tuned
and untuned, compiled on fresh caches (``fresh_cache``), each building its kernels, what
tuning adds to a job on an empty cache. A further range graph's compile (its first call
in the warm-up) is set against its untuned compile: that of the model with the range's
winner written in, compiled afresh and first called at the same size (Inductor autotunes
its kernels at their first launch's size), on fresh caches, and on the process's caches
against the range graph compiled again by the tuned compiles again (its kernels cached
too: like with like). Each compared compile but the first tuned one is repeated
``COMPILE_REPEATS`` times and read as the median (the fresh pairs: the median of each
pair's difference); every first call records Dynamo's and Inductor's timed phases. With
``--kernels`` each variant's device time per kernel at each size is recorded too, on
every rank (torch.profiler), to tell what the collective costs in a step from what the
rest of the model's kernels cost, and a rank's wait for its peer from its own work.
``--pointwise-autotune off`` gives every Triton kernel the first configuration of its
heuristics on every rank (Inductor otherwise times them on each rank alone, and ranks can
keep configurations 50% apart); ``--profile-compiles`` runs the warm-up's first calls
under cProfile. ``--pin-cores`` keeps each rank's thread on cores no other rank's may use
(eager steps on 2 H200s otherwise flipped between host states 1.5x apart from round to
round).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import faulthandler
import gc
import math
import os
import statistics
import time
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import common  # benchmarks/, the script's own directory


# Every tuning starts from fresh state; compile times are those of a cold compile.
common.fresh_state()

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.utils import fresh_cache
from torch._inductor.kernel.collective.api import warm_up_sizes
from torch._inductor.kernel.collective.api import collective_autotune_records

from common import (
    assert_close_sum,
    barrier,
    compile_phases,
    CountedInductor,
    first_call_s,
    group_max,
    header,
    init_process_group,
    pct,
    rounded,
    sampling_order,
    size_label,
    token_input,
    verdict,
    write_json,
)
from examples.tp_allreduce import ops


# Goals, in both modes: the dynamic model's step within LOSS_GOAL_PCT of the
# best single-implementation dynamic compile at its size; never more than TABLE_SLOWER_PCT
# slower than vLLM's table, and TABLE_BEAT_PCT faster where the table's pick loses to the
# best single implementation by more than that; no cudagraph skips, no compile after the
# warm-up; the ladder's extra compile; each further range's compile within RANGE_COMPILE_S
# of the untuned compile.
LOSS_GOAL_PCT = 2.0
TABLE_SLOWER_PCT = 1.0
TABLE_BEAT_PCT = 3.0
LADDER_GOAL_S = 0.5
RANGE_COMPILE_S = 0.2
# Goal: the engine's flow (guards filtered) within this of plain torch.compile.
ENGINE_GOAL_PCT = 1.0
EXIT_S = 30.0
COMPILE_TOKENS = 100  # not 1 (Dynamo's specialisation) and no size of the sweep
# Samples per size and variant, taken round-robin over the variants. With 5, two variants
# running the same code read up to 13% apart in eager mode on 1 H200 (host-bound steps);
# with 11, up to 43% at 1 token on 4 H200s (faf3ee5): eager mode takes more.
ROUNDS = {"graph": 11, "eager": 21}
# Repetitions of each compile that the compile goals compare (untuned, tuned again, both
# on fresh caches, a further range's untuned compile): single compiles spread by ±0.3 s
# between runs, more than the goals' margins; the goals read medians.
COMPILE_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Bench:
    implementations: tuple[str, ...]
    dtype: torch.dtype
    hidden: int
    tokens: tuple[int, ...]
    dynamic_max: int
    modes: tuple[str, ...]
    calls: int  # back-to-back calls per sample
    # Whether a pointwise producer (relu) computes each all-reduce's input, which an
    # inlined functional all-reduce fuses into its input's copy and an opaque op cannot.
    producer: bool = True


BENCHES = {
    "cuda": Bench(
        implementations=("one_all_reduce", "symm_mem_one_shot", "symm_mem_two_shot"),
        dtype=torch.bfloat16,
        hidden=4096,
        tokens=(1, 8, 64, 512, 4096, 16384),
        dynamic_max=16384,
        modes=("graph", "eager"),
        calls=20,
    ),
    "cpu": Bench(
        implementations=("one_all_reduce",),
        dtype=torch.float32,
        hidden=256,
        tokens=(1, 8, 64, 512),
        dynamic_max=512,
        modes=("eager",),
        calls=3,
    ),
}
# The implementations as functions of (x, group_name), to write into a model alone.
WRITTEN_IN: dict[str, Callable[[torch.Tensor, str], torch.Tensor]] = {
    "one_all_reduce": ops.one_all_reduce,
    "symm_mem_one_shot": ops.symm_mem_one_shot,
    "symm_mem_two_shot": ops.symm_mem_two_shot,
    "default": ops.all_reduce,  # compiled with collective_autotune=False: the op's own
}


class Stack(torch.nn.Module):
    """``layers`` tensor-parallel layers ``x = x + all_reduce(relu(x @ w))`` (without
    the relu where ``bench`` has no producer)."""

    def __init__(
        self,
        bench: Bench,
        layers: int,
        all_reduce: Callable,
        group_name: str,
        device: torch.device,
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        # Scaled so that the residual stream stays of order one over the layers.
        scale = bench.hidden**0.5 * dist.get_world_size()
        self.weights = [
            (torch.randn(bench.hidden, bench.hidden, generator=gen) / scale).to(
                device, bench.dtype
            )
            for _ in range(layers)
        ]
        self.all_reduce, self.group_name = all_reduce, group_name
        self.producer = torch.relu if bench.producer else (lambda y: y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = x + self.all_reduce(self.producer(x @ w), self.group_name)
        return x


def model_input(
    bench: Bench, tokens: int, device: torch.device, dynamic: bool
) -> torch.Tensor:
    return token_input(tokens, bench.hidden, bench.dtype, device, dynamic)


def sample_us(fn: Callable, x: torch.Tensor, calls: int) -> float:
    """µs per call of ``calls`` back-to-back calls, this rank."""
    barrier(x.device)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


@dataclasses.dataclass(frozen=True)
class FirstCall:
    tokens: int
    compiles: int
    seconds: float
    # Where a compile's seconds went: Dynamo's and Inductor's timed phases (this rank's;
    # nested phases overlap).
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    # With --profile-compiles: the functions of collective autotuning by cumulative
    # seconds, and every function by its own seconds (cProfile, this rank's).
    profile: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Variant:
    """One way of compiling the model: the compiled model that runs each size."""

    models: dict[int, Callable] = dataclasses.field(default_factory=dict)
    step_us: dict[int, float] = dataclasses.field(default_factory=dict)
    # Per size: every sample (µs per call, the slowest rank's in that round), in the order
    # taken, to tell a bimodal or drifting step from a slower one.
    samples_us: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    # When each sample ended (Unix seconds, rank 0's clock), to read a sample against the
    # GPU's clocks and power logged beside the run (a power-capped GPU's clocks follow
    # what ran just before).
    samples_ended_at: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    compiles: int = 0
    cudagraph_skips: int = 0
    compile_s: float = 0.0
    compile_phases: dict[str, float] = dataclasses.field(default_factory=dict)
    # Where its decisions' seconds went on this rank (see decision_costs).
    decision_costs: dict[str, dict[str, float]] = dataclasses.field(
        default_factory=dict
    )
    # With --profile-compiles: the first compile under cProfile (see profiled).
    compile_profile: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Dynamic variants, each call of the warm-up in order: its size, the graphs it
    # compiled (a range graph of its own) and what it took (seconds, slowest rank).
    first_calls: list[FirstCall] = dataclasses.field(default_factory=list)
    # Per size: µs the host spends in one call (until it returns, device not waited for).
    host_us: dict[int, float] = dataclasses.field(default_factory=dict)
    # Compiles while the steps were measured, after the warm-up (0 when every range was warm).
    compiles_after_warm_up: int = 0
    backends: list[CountedInductor] = dataclasses.field(
        default_factory=list, repr=False
    )


def written_in_variant(
    bench: Bench,
    mode: str,
    layers: int,
    name: str,
    group: dist.ProcessGroup,
    device: torch.device,
    sizes: Sequence[int],
    compile_tokens: int = COMPILE_TOKENS,
) -> Variant:
    """The model compiled once (dynamic) with implementation ``name`` of WRITTEN_IN
    written in (``default``, the op's own: untuned), first called at
    ``compile_tokens``."""
    with inductor_config.patch(collective_autotune=name != "default"):
        return compile_variant(
            bench,
            mode,
            layers,
            WRITTEN_IN[name],
            group,
            device,
            sizes,
            True,
            False,
            compile_tokens,
        )


def paired_pct(samples: Sequence[float], reference: Sequence[float]) -> float:
    """How much slower ``samples`` are than ``reference`` (a variant's samples of the
    same rounds), in %: the median over rounds of the two samples' difference. The
    round-robin pairs them: a drift of the machine moves both samples of a round alike
    (eager steps on 4 H200s drifted by 25% between rounds) and cancels here, where it
    moves each variant's median by its own luck."""
    return statistics.median(pct(a, b) for a, b in zip(samples, reference))


def compile_variant(
    bench: Bench,
    mode: str,
    layers: int,
    all_reduce: Callable,
    group: dist.ProcessGroup,
    device: torch.device,
    sizes: Sequence[int],
    dynamic: bool,
    check: bool,
    compile_tokens: int = COMPILE_TOKENS,
    warm_up: Sequence[int] = (),
    guard_filter_fn: Callable | None = None,
) -> Variant:
    """A fresh compile of the model (one per size unless ``dynamic``, first called at
    ``compile_tokens`` then), called at ``warm_up`` (dynamic) and warmed up at
    ``sizes``; ``guard_filter_fn`` as torch.compile's option (a serving engine's)."""
    variant = Variant()
    skips = counters["inductor"]["cudagraph_skips"]
    backends: list[CountedInductor] = []
    for tokens in (*warm_up, *sizes):
        if not backends or not dynamic:
            # A module of its own: its own entry in Dynamo's cache (no reset, which
            # would drop the variants compiled before it).
            eager = Stack(bench, layers, all_reduce, group.group_name, device)
            backends.append(CountedInductor(mode))
            model = torch.compile(
                eager,
                backend=backends[-1],
                fullgraph=True,
                dynamic=None if dynamic else False,
                options={"guard_filter_fn": guard_filter_fn} if guard_filter_fn else {},
            )
            first = model_input(
                bench, compile_tokens if dynamic else tokens, device, dynamic
            )
            with (
                compile_phases(variant.compile_phases),
                profiled(PROFILE_COMPILES) as profile,
            ):
                variant.compile_s += first_call_s(model, first)
            variant.compile_profile = variant.compile_profile or profile
        x = model_input(bench, tokens, device, dynamic)
        if dynamic:
            # The warm-up visits every size: a size of a range not compiled yet compiles
            # its range graph (kernel/collective/range_graphs.py) here, never while measured.
            before = backends[-1].compiles
            phases: dict[str, float] = {}
            with compile_phases(phases), profiled(PROFILE_COMPILES) as profile:
                seconds = first_call_s(model, x)
            variant.first_calls.append(
                FirstCall(
                    tokens, backends[-1].compiles - before, seconds, phases, profile
                )
            )
        for _ in range(3):  # in graph mode: warm-up, record, replay
            model(x)
        if check:
            assert_close_sum(model(x), eager(x))
        if tokens in sizes:
            variant.models[tokens] = model
    variant.compiles = sum(b.compiles for b in backends)
    variant.cudagraph_skips = counters["inductor"]["cudagraph_skips"] - skips
    variant.backends = backends
    return variant


# --profile-compiles: each variant's first compile and each first call of the dynamic
# model's warm-up run under cProfile.
PROFILE_COMPILES = False


@contextlib.contextmanager
def profiled(enabled: bool) -> Iterator[dict[str, Any]]:
    """cProfile around the block, where ``enabled``: collective autotuning's functions by
    cumulative seconds, the 60 functions of most cumulative seconds (to place ours among
    Inductor's phases) and the 15 of most own seconds, into the dict yielded."""
    import cProfile
    import pstats

    result: dict[str, Any] = {}
    if not enabled:
        yield result
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield result
    finally:
        profiler.disable()
        stats = pstats.Stats(
            profiler
        ).stats  # (file, line, name) -> (cc, nc, tt, ct, _)
        rows = [
            (f"{file.split('site-packages/')[-1]}:{line}:{name}", nc, tt, ct)
            for (file, line, name), (_, nc, tt, ct, _) in stats.items()
        ]
        ours = [r for r in rows if "collective" in r[0] and r[3] >= 0.005]
        result["collective_cumulative_s"] = {
            r[0]: [r[1], round(r[3], 3)] for r in sorted(ours, key=lambda r: -r[3])[:40]
        }
        result["cumulative_s"] = {
            r[0]: [r[1], round(r[3], 3)] for r in sorted(rows, key=lambda r: -r[3])[:60]
        }
        result["own_s"] = {
            r[0]: [r[1], round(r[2], 3)] for r in sorted(rows, key=lambda r: -r[2])[:15]
        }


def decision_costs(records: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Seconds this rank spent on the decisions of ``records`` (decision records), per
    range, summed over the model's call sites: tracing the choices (upstream), waiting
    for its peers, compiling the choices for the benchmark, the rest of the decision
    (``tuning_s``: its votes and the benchmark), and the benchmark's own steps (every
    choice's first call, sizing batches, rounds, the reduction); with the number of
    sites and Store requests. What a tuned compile adds, by where it goes."""
    costs: dict[str, collections.Counter[str]] = {}
    for r in records:
        cost = costs.setdefault(r.op.rsplit("_range_", 1)[-1], collections.Counter())
        cost.update(
            sites=1,
            store_requests=r.store_requests,
            trace_s=r.trace_s,
            waited_s=r.waited_s,
            build_s=r.build_s,
            tuning_s=r.tuning_s,
            **{f"benchmark_{step}_s": s for step, s in r.phases},
        )
    return {
        name: {k: round(v, 3) for k, v in cost.items()} for name, cost in costs.items()
    }


def host_us(fn: Callable, x: torch.Tensor) -> float:
    """µs the host spends in one call of ``fn`` (until it returns; the device's work
    not waited for), median of 5, this rank: the guard check and launches per call."""
    samples = []
    for _ in range(5):
        barrier(x.device)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(x)
        samples.append((time.perf_counter() - start) * 1e6)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(samples)


def measure_steps(
    bench: Bench, variants: dict[str, Variant], device: torch.device, rounds: int
) -> None:
    """Each variant's step at each size: the median of ``rounds`` samples, one per
    variant a round in ``sampling_order``, slowest rank; each sample follows as many
    calls of its own variant, untimed (a power-capped GPU's clocks follow what ran
    before). Python's garbage collector is off while sampling (as in timeit): a
    collection in one sample of a host-bound step would be charged to whichever variant
    it fell on."""
    gc.collect()
    gc.disable()
    try:
        for tokens in bench.tokens:
            x = model_input(bench, tokens, device, dynamic=False)
            samples: dict[str, list[float]] = {name: [] for name in variants}
            ended: dict[str, list[float]] = {name: [] for name in variants}
            for name in sampling_order(list(variants), rounds):
                model = variants[name].models[tokens]
                for _ in range(bench.calls):  # the GPU settles on this variant
                    model(x)
                samples[name].append(sample_us(model, x, bench.calls))
                ended[name].append(round(time.time(), 3))
            medians = group_max(
                [statistics.median(samples[name]) for name in variants], device
            )
            for name, us in zip(variants, medians):
                variants[name].step_us[tokens] = us
                variants[name].samples_us[tokens] = group_max(samples[name], device)
                variants[name].samples_ended_at[tokens] = ended[name]
            hosts = group_max(
                [host_us(v.models[tokens], x) for v in variants.values()], device
            )
            for name, us in zip(variants, hosts):
                variants[name].host_us[tokens] = us
    finally:
        gc.enable()


def kernel_breakdown(
    bench: Bench, variants: dict[str, Variant], device: torch.device
) -> dict[str, Any]:
    """Each variant's device µs per step at each size, by kernel and rank
    (torch.profiler; the steps being collective, every rank runs it): where a step's
    time goes, to tell the collective's share from the rest of the model's. A
    collective kernel's time includes its wait for the peers, so a rank's long
    collective is read beside its peers' kernels before it."""
    from dynamic_kernels import kernel_us

    breakdown: dict[str, Any] = {}
    for t in bench.tokens:
        x = model_input(bench, t, device, dynamic=False)
        for name, v in variants.items():
            per_rank: list[dict[str, float]] = [
                {} for _ in range(dist.get_world_size())
            ]
            dist.all_gather_object(per_rank, kernel_us(v.models[t], x))
            breakdown.setdefault(name, {})[t] = {
                "device_us": [round(sum(k.values()), 1) for k in per_rank],
                "kernels_us": per_rank,
            }
    return breakdown


def run_mode(
    bench: Bench,
    mode: str,
    layers: int,
    device: torch.device,
    rank0: bool,
    kernels: bool,
) -> dict[str, Any]:
    world = list(range(dist.get_world_size()))

    def log(what: str, v: Variant) -> None:
        if rank0:
            steps = ", ".join(f"{t}: {us:.1f}" for t, us in v.step_us.items())
            print(
                f"[{mode}] {what}: compile {v.compile_s:.2f} s, {v.compiles} compiles, "
                f"{v.cudagraph_skips} cudagraph skips; step us {steps}",
                flush=True,
            )

    def fresh_group() -> dist.ProcessGroup:  # its decisions are its own
        group = dist.new_group(world)
        # The example's symmetric-memory ops allocate their group's buffer at first use:
        # at the largest size, outside any CUDA graph (a rendezvous is collective, and
        # CUDA-graph trees refuse allocations that outlive a call).
        largest = torch.zeros(
            max(bench.tokens), bench.hidden, dtype=bench.dtype, device=device
        )
        for name in bench.implementations:
            WRITTEN_IN[name](largest, group.group_name)
        return group

    def compile_once(warm_up: Sequence[int] = ()) -> Variant:
        """The dynamic model compiled and called once, on a group of its own (its
        decisions made afresh), as the knobs stand: for its compile seconds; then
        called at ``warm_up`` (each further range's compile in its first_calls)."""
        before = len(collective_autotune_records())
        variant = compile_variant(
            bench,
            mode,
            layers,
            ops.all_reduce,
            fresh_group(),
            device,
            bench.tokens[:1],
            True,
            False,
            warm_up=warm_up,
        )
        variant.decision_costs = decision_costs(collective_autotune_records()[before:])
        return variant

    def untuned_once() -> Variant:
        with inductor_config.patch(collective_autotune=False):
            return compile_once()

    variants: dict[str, Variant] = {}
    # The first compile also builds the model's own kernels (relu, add), which every later
    # compile loads: a warm-up; the untuned seconds are taken after the tuned compile.
    untuned_once()
    group = fresh_group()
    first_record = len(collective_autotune_records())
    variants["dynamic"] = compile_variant(
        bench,
        mode,
        layers,
        ops.all_reduce,
        group,
        device,
        bench.tokens,
        True,
        True,
        warm_up=warm_up_sizes(bench.dynamic_max),
    )
    variants["dynamic"].decision_costs = decision_costs(
        collective_autotune_records()[first_record:]
    )
    # A serving engine's flow (vLLM's): one compile, first called at the largest size,
    # every Dynamo guard filtered out. No range guard would be checked, so the graph
    # dispatches by size inside (the group's decisions above, reused).
    variants["engine"] = compile_variant(
        bench,
        mode,
        layers,
        ops.all_reduce,
        group,
        device,
        bench.tokens,
        True,
        True,
        compile_tokens=max(bench.tokens),
        guard_filter_fn=torch.compiler.skip_all_guards_unsafe,
    )
    # Each range's decision where it was made (later layers reuse it).
    ladder = list(
        {
            r.op.rsplit("_range_", 1)[1]: (
                r.op.rsplit("_range_", 1)[1],
                r.winner,
                r.source,
            )
            for r in reversed(collective_autotune_records()[first_record:])
            if r.group_name == group.group_name
        }.values()
    )
    # What each timed range read (µs per call on the slowest rank: lower quartile,
    # median, upper quartile) and why its winner won: the op timed alone, to set
    # against what the model's step shows at the same size.
    ladder_timings = {
        r.op.rsplit("_range_", 1)[1]: {
            "reason": r.reason,
            "timings_us": {
                t.name: [t.low_us, t.max_us, t.high_us]
                for t in r.timings
                if math.isfinite(t.max_us)
            },
        }
        for r in collective_autotune_records()[first_record:]
        if r.group_name == group.group_name and r.timings
    }
    if rank0:
        print(f"[{mode}] ladder: {ladder}", flush=True)
    # The same compile again, with a group of its own (its decisions made afresh): what
    # a tuned compile costs once the machine's kernel cache holds the benchmark's kernels;
    # then each further range's compile with its kernels cached (the warm-up built them),
    # as its untuned compile on the process's caches finds its own.
    # Each alternates with the untuned compile: the same knob-off compile read 0.68-0.96 s
    # in the process's first compiles and 0.50-0.60 s after a tuned one on one H200
    # (Inductor's own warm-up: pointwise launch configurations timed again), so untuned
    # compiles taken first understated what tuning adds; alternated, both sides of each
    # pair stand at the same point of the process.
    further = [c.tokens for c in variants["dynamic"].first_calls if c.compiles]
    again: list[Variant] = []
    untuned: list[Variant] = []
    for _ in range(COMPILE_REPEATS):
        again.append(compile_once(further))
        untuned.append(untuned_once())
    # Both again on fresh caches (``fresh_cache``): the untuned compile above found its
    # kernels built by its warm-up, while the tuned one builds whatever kernels of its
    # model the warm-up did not (one H200: 0.76 s waiting for kernels, the untuned
    # none). Here both build theirs, as a job on an empty cache would, in a process
    # that has compiled before (Inductor's compile workers running). fresh_cache does
    # not empty every cache of compiled kernels (on one H200 a second compile of the
    # same kernels under it waited for none), so the tuned compile goes first: where
    # the untuned one finds kernels the tuned one built, the extra reads high, not low.
    fresh: dict[bool, list[Variant]] = {True: [], False: []}
    for _ in range(COMPILE_REPEATS):
        for tuned in (True, False):
            with inductor_config.patch(collective_autotune=tuned), fresh_cache():
                fresh[tuned].append(compile_once())
    variants["static"] = compile_variant(
        bench,
        mode,
        layers,
        ops.all_reduce,
        fresh_group(),
        device,
        bench.tokens,
        False,
        False,
    )
    for name in (*bench.implementations, "default"):
        variants[name] = written_in_variant(
            bench, mode, layers, name, fresh_group(), device, bench.tokens
        )
    table_group = fresh_group()
    variants["table"] = compile_variant(
        bench,
        mode,
        layers,
        ops.table_all_reduce,
        table_group,
        device,
        bench.tokens,
        True,
        False,
    )
    table = ops.table_limits(table_group.size(), ops.device_capability(device))
    warm = {name: sum(b.compiles for b in v.backends) for name, v in variants.items()}
    measure_steps(bench, variants, device, ROUNDS[mode])
    for name, v in variants.items():
        v.compiles_after_warm_up = sum(b.compiles for b in v.backends) - warm[name]
    breakdown = kernel_breakdown(bench, variants, device) if kernels else None
    written_in = further_ranges_untuned(
        bench, mode, layers, variants, ladder, fresh_group, device
    )
    for name, variant in variants.items():
        log(name, variant)

    # The further ranges' compiles of the tuned compiles again, their kernels cached: by
    # size, each repetition's that compiled a range there.
    cached: dict[int, list[FirstCall]] = collections.defaultdict(list)
    for repetition in again:
        for c in repetition.first_calls:
            if c.compiles:
                cached[c.tokens].append(c)
    rows = []
    singles = (*bench.implementations, "default")
    for tokens in bench.tokens:
        # The table is no single-implementation compile: it is compared on its own below.
        others = {
            k: v.step_us[tokens]
            for k, v in variants.items()
            if k not in ("dynamic", "engine", "table")
        }
        best = min(others, key=others.get)
        fastest = min(others.values())
        nccl = variants["one_all_reduce"].step_us[tokens]
        dynamic = variants["dynamic"].step_us[tokens]
        nbytes = tokens * bench.hidden * torch.finfo(bench.dtype).bits // 8
        table_pick = table.pick(nbytes)
        single_us = {k: variants[k].step_us[tokens] for k in singles}
        best_single = min(single_us, key=single_us.get)
        table_pick_loss = pct(single_us[table_pick], single_us[best_single])
        dynamic_samples = variants["dynamic"].samples_us[tokens]
        paired = {
            k: paired_pct(dynamic_samples, v.samples_us[tokens])
            for k, v in variants.items()
            if k != "dynamic"
        }
        rows.append(
            {
                "tokens": tokens,
                "bytes": nbytes,
                # The range graph of the dynamic model that runs this size (its ladder's merged
                # range holding it); its compile is in first_calls.
                "range": range_of(ladder, tokens),
                "step_us": {k: v.step_us[tokens] for k, v in variants.items()},
                "host_us": {k: v.host_us[tokens] for k, v in variants.items()},
                "samples_us": {k: v.samples_us[tokens] for k, v in variants.items()},
                "samples_ended_at": {
                    k: v.samples_ended_at[tokens] for k, v in variants.items()
                },
                "best": best,
                "loss_pct": pct(dynamic, fastest),
                # The yardstick: the best model compiled once, dynamically, with one
                # implementation written in.
                "vs_best_single_pct": pct(dynamic, single_us[best_single]),
                # The same, paired by round (paired_pct), against every variant: the
                # goals are judged on these. Against a variant that runs the range's
                # implementation, what two compiles of the same code read apart.
                "paired_pct": paired,
                "vs_best_single_paired_pct": max(paired[k] for k in singles),
                "vs_table_paired_pct": paired["table"],
                # The engine's flow (guards filtered, an in-graph size dispatch) against
                # the same model under plain torch.compile (range graphs), paired.
                "engine_vs_dynamic_paired_pct": paired_pct(
                    variants["engine"].samples_us[tokens], dynamic_samples
                ),
                "vs_nccl_pct": pct(dynamic, nccl),
                # Where another implementation beats plain NCCL by more than the noise of a step.
                "nccl_beaten": fastest < nccl * (1 - LOSS_GOAL_PCT / 100),
                "table_pick": table_pick,
                "best_single": best_single,
                # The pick's model against the best single-implementation model at this size.
                "table_pick_loss_pct": table_pick_loss,
                # Where the table's pick loses to another implementation by more than the goal.
                "table_beaten": table_pick_loss > TABLE_BEAT_PCT,
                "vs_table_pct": pct(dynamic, variants["table"].step_us[tokens]),
            }
        )
    return rounded(
        {
            "rows": rows,
            "ladder": ladder,
            "ladder_timings": ladder_timings,
            # The dynamic model's calls in the warm-up, in order (warm_up_sizes(), then
            # the sweep's sizes): the range graph that runs each, what its first call
            # compiled and cost, and where that compiled a further range, the compile of
            # the range's untuned model first called at the same size.
            "first_calls": [
                {
                    **dataclasses.asdict(call),
                    "range": range_of(ladder, call.tokens),
                    **(
                        {
                            "untuned_compile_s": median_s(written_in[call.tokens].warm),
                            "untuned_compile_s_repeats": [
                                v.compile_s for v in written_in[call.tokens].warm
                            ],
                            "untuned_phases": written_in[call.tokens]
                            .warm[0]
                            .compile_phases,
                            "untuned_cold_compile_s": written_in[
                                call.tokens
                            ].cold.compile_s,
                            "untuned_cold_phases": written_in[
                                call.tokens
                            ].cold.compile_phases,
                        }
                        if call.compiles and call.tokens in written_in
                        else {}
                    ),
                    **(
                        {
                            "cached_compile_s": statistics.median(
                                c.seconds for c in cached[call.tokens]
                            ),
                            "cached_compile_s_repeats": [
                                c.seconds for c in cached[call.tokens]
                            ],
                            "cached_phases": cached[call.tokens][0].phases,
                        }
                        if call.compiles and call.tokens in cached
                        else {}
                    ),
                }
                for call in variants["dynamic"].first_calls
            ],
            "table": {
                "world_size": table_group.size(),
                "capability": ops.device_capability(device),
                **dataclasses.asdict(table),
            },
            "compiles": {k: v.compiles for k, v in variants.items()},
            "cudagraph_skips": {k: v.cudagraph_skips for k, v in variants.items()},
            "recompiles": variants["dynamic"].compiles - 1,
            # Range graphs compile one graph per merged range of the ladder: recompiles by
            # design, all during the warm-up; none may happen while the steps are measured.
            # (Counted over every size the warm-up visited: a sweep of a few sizes may
            # lie in fewer ranges than the graphs compiled.)
            "ranges": len(
                {range_of(ladder, c.tokens) for c in variants["dynamic"].first_calls}
            ),
            "compiles_after_warm_up": {
                k: v.compiles_after_warm_up for k, v in variants.items()
            },
            "compile_s": {
                "dynamic_tuned": variants["dynamic"].compile_s,
                "dynamic_tuned_again": median_s(again),
                "dynamic_untuned": median_s(untuned),
                "dynamic_tuned_fresh": median_s(fresh[True]),
                "dynamic_untuned_fresh": median_s(fresh[False]),
                # Each variant's compile (the first call at its first size).
                **{f"variant_{k}": v.compile_s for k, v in variants.items()},
            },
            # Where those seconds went (rank 0's timed phases; nested ones overlap).
            "compile_phases": {
                "dynamic_tuned": variants["dynamic"].compile_phases,
                "dynamic_tuned_again": again[0].compile_phases,
                "dynamic_untuned": untuned[0].compile_phases,
                "dynamic_tuned_fresh": fresh[True][0].compile_phases,
                "dynamic_untuned_fresh": fresh[False][0].compile_phases,
            },
            # Where the decisions' seconds went (rank 0's, per range; see
            # decision_costs).
            "decision_costs": {
                "dynamic_tuned": variants["dynamic"].decision_costs,
                "dynamic_tuned_again": again[0].decision_costs,
                "dynamic_tuned_fresh": fresh[True][0].decision_costs,
            },
            **(
                {
                    "compile_profiles": {
                        "dynamic_tuned": variants["dynamic"].compile_profile,
                        "dynamic_tuned_again": again[0].compile_profile,
                        "dynamic_untuned": untuned[0].compile_profile,
                    }
                }
                if PROFILE_COMPILES
                else {}
            ),
            # Each repetition's seconds (the medians above are the goals').
            "compile_s_repeats": {
                "dynamic_tuned_again": [v.compile_s for v in again],
                "dynamic_untuned": [v.compile_s for v in untuned],
                "dynamic_tuned_fresh": [v.compile_s for v in fresh[True]],
                "dynamic_untuned_fresh": [v.compile_s for v in fresh[False]],
            },
            "extra_compile_s": variants["dynamic"].compile_s - median_s(untuned),
            # Paired by repetition (tuned again, then untuned).
            "extra_compile_again_s": statistics.median(
                t.compile_s - u.compile_s for t, u in zip(again, untuned)
            ),
            # Paired by repetition (tuned, then untuned, each on fresh caches).
            "extra_compile_fresh_s": statistics.median(
                t.compile_s - u.compile_s for t, u in zip(fresh[True], fresh[False])
            ),
            **({"kernels": breakdown} if breakdown else {}),
        }
    )


def further_ranges_untuned(
    bench: Bench,
    mode: str,
    layers: int,
    variants: dict[str, Variant],
    ladder: list[tuple[str, str, str]],
    fresh_group: Callable[[], dist.ProcessGroup],
    device: torch.device,
) -> dict[int, UntunedRange]:
    """Per size of the warm-up whose first call compiled a further range graph: the
    compile of that range's untuned model (its winner written in; the op's own,
    untuned), fresh, first called at that size, as the range graph was. Inductor
    autotunes each pointwise kernel at its first launch, at that launch's size (0.5 s
    at 100 tokens, 1.0 s at 16384 on 2 H200s): a compile first called at another size
    is no yardstick of the range's.

    Each is compiled as the process's caches stand (by now they hold the kernels of
    every variant, so its Triton compiles and launch-configuration timings are mostly
    hits; COMPILE_REPEATS times), set against the range graph compiled again with its
    kernels cached; and once on fresh caches (``fresh_cache``), set against the range
    graph's first compile, whose kernels were cold. That one is no like with like: the
    compile workers' caches outlive ``fresh_cache``, and the written-in variants built
    the same kernels before it (on 2 H200s it waited 0.00-0.08 s for kernels, the range
    graph 0.16-0.38 s).
    """
    untuned = {}
    for call in variants["dynamic"].first_calls:
        if not call.compiles:
            continue
        winner = range_of(ladder, call.tokens).split(" ", 1)[-1]
        name = winner if winner in WRITTEN_IN else "default"

        def compile_range() -> Variant:
            return written_in_variant(
                bench,
                mode,
                layers,
                name,
                fresh_group(),
                device,
                [call.tokens],
                call.tokens,
            )

        warm = [compile_range() for _ in range(COMPILE_REPEATS)]
        with fresh_cache():
            cold = compile_range()
        untuned[call.tokens] = UntunedRange(warm, cold)
    return untuned


@dataclasses.dataclass(frozen=True)
class UntunedRange:
    """A range's untuned model compiled as the process's caches stand (each
    repetition's), and cold."""

    warm: list[Variant]
    cold: Variant


def median_s(variants: Sequence[Variant]) -> float:
    """The median of the variants' compile seconds."""
    return statistics.median(v.compile_s for v in variants)


def range_of(ladder: list[tuple[str, str, str]], tokens: int) -> str:
    """The merged range of the ladder (range label, winner, source) holding ``tokens``:
    neighbouring ranges of one winner are one range graph."""
    ranges = sorted(
        (
            int(label.split("_")[0]),
            math.inf if label.endswith("inf") else int(label.split("_")[1]),
            winner,
        )
        for label, winner, _ in ladder
    )
    merged: list[list[Any]] = []
    for low, high, winner in ranges:
        if merged and merged[-1][2] == winner:
            merged[-1][1] = high
        else:
            merged.append([low, high, winner])
    for low, high, winner in merged:
        if low <= tokens <= high:
            return f"{low}-{'inf' if high == math.inf else int(high)} {winner}"
    return "?"


def physical_cores() -> list[list[int]]:
    """The host's logical CPUs grouped by physical core (SMT siblings together), in
    order of each core's first CPU; this process's allowed CPUs only."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                siblings = f.read().strip()
        except OSError:  # no topology: every CPU a core of its own
            siblings = str(cpu)
        cores.setdefault(siblings, []).append(cpu)
    return list(cores.values())


def pin_to_own_cores(rank: int, world: int) -> list[int]:
    """Keep this rank's Python thread (and the threads it starts) on physical cores no
    other rank's is allowed on. An eager step is host-bound at small sizes and runs at
    its slowest rank's pace: on 2 H200s, unpinned, it flipped between host states 1.5x
    apart from round to round; pinned, it held within a few percent (why the OS's
    placement costs that is not known). Returns the CPUs kept."""
    cores = physical_cores()
    if len(cores) < world:
        return sorted(os.sched_getaffinity(0))
    cpus = sorted(cpu for core in cores[rank::world] for cpu in core)
    os.sched_setaffinity(0, cpus)
    return cpus


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    device = init_process_group(args.device)
    pinned = (
        pin_to_own_cores(dist.get_rank(), dist.get_world_size())
        if args.pin_cores
        else []
    )
    bench = BENCHES[args.device]
    if args.tokens:
        bench = dataclasses.replace(
            bench, tokens=tuple(int(t) for t in args.tokens.split(","))
        )
    if args.modes:
        bench = dataclasses.replace(bench, modes=tuple(args.modes.split(",")))
    if args.no_producer:
        bench = dataclasses.replace(bench, producer=False)
    ops.register(bench.implementations)
    torch.fx.experimental._config.backed_size_oblivious = True  # one graph for 1 .. max
    # Every variant's compiles stay in Dynamo's cache until they are measured.
    torch._dynamo.config.recompile_limit = (
        torch._dynamo.config.accumulated_recompile_limit
    ) = 1024
    inductor_config.collective_autotune_dynamic_max = bench.dynamic_max
    # Inductor times a pointwise kernel's launch configurations at its first launch, on
    # each rank alone: ranks (and compiles) of one model can keep different ones, and a
    # collective step runs at its slowest rank's pace. Off, every kernel keeps the first
    # configuration of its heuristics, the same on every rank and in every variant.
    inductor_config.triton.autotune_pointwise = args.pointwise_autotune == "on"
    global PROFILE_COMPILES
    PROFILE_COMPILES = args.profile_compiles
    rank0 = dist.get_rank() == 0
    result = {
        **header(device),
        "dtype": str(bench.dtype).removeprefix("torch."),
        "hidden": bench.hidden,
        "layers": args.layers,
        "producer": "relu" if bench.producer else "none",
        "implementations": [*bench.implementations, "default"],
        "compile_tokens": COMPILE_TOKENS,
        "collective_autotune_dynamic_max": bench.dynamic_max,
        "pointwise_autotune": args.pointwise_autotune,
        # Rank 0's CPUs where --pin-cores kept each rank on cores of its own.
        "pinned_cpus": pinned,
        "modes": {
            mode: run_mode(bench, mode, args.layers, device, rank0, args.kernels)
            for mode in bench.modes
        },
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if rank0:
        write_json(args.out, result)
        print(summary(result), flush=True)
    # A rank still here EXIT_S after its results (a shutdown waiting on something) prints
    # every thread's stack and exits: a finished run is never held up, and says where.
    faulthandler.dump_traceback_later(EXIT_S, exit=True)
    dist.destroy_process_group()


def summary(result: dict[str, Any]) -> str:
    """The goals, checked on the result."""
    lines = [
        f"goals: {result['world_size']}x {result['device']}, torch {result['torch']}, {result['layers']} "
        f"layers x + all_reduce({'relu(x @ w)' if result['producer'] == 'relu' else 'x @ w'}),"
        f" hidden {result['hidden']}, {result['dtype']}",
    ]
    for mode, m in result["modes"].items():
        lines.append(
            f"[{mode}] ladder: {', '.join(f'{r} {w} ({s})' for r, w, s in m['ladder'])}"
        )
        t = m["table"]
        if t["two_shot_below"] or t["symm_mem_up_to"]:
            picks = (
                f"one-shot below {size_label(t['one_shot_below'])}, two-shot below "
                f"{size_label(t['two_shot_below'])} and up to "
                f"{size_label(t['symm_mem_up_to'])}, NCCL (the op's own) above"
            )
        else:
            picks = "not listed, NCCL (the op's own) at every size"
        lines.append(
            f"[{mode}] table (vLLM's) on {t['world_size']} ranks of capability "
            f"{t['capability'] or 'none (CPU)'}: {picks}"
        )
        for row in m["rows"]:
            steps = ", ".join(f"{k} {v:.1f}" for k, v in row["step_us"].items())
            lines.append(
                f"  {row['tokens']:>6} tokens: dynamic {row['step_us']['dynamic']:.1f} us, best {row['best']} "
                f"-> {row['loss_pct']:+.1f}%, vs NCCL {row['vs_nccl_pct']:+.1f}%, vs table "
                f"{row['vs_table_pct']:+.1f}%, paired: vs best single {row['vs_best_single_paired_pct']:+.1f}%, "
                f"vs table {row['vs_table_paired_pct']:+.1f}% (picks {row['table_pick']}, "
                f"{row['table_pick_loss_pct']:+.1f}% vs {row['best_single']})  [{steps}]"
            )
        worst = max(m["rows"], key=lambda r: r["vs_best_single_paired_pct"])
        worst_static = max(m["rows"], key=lambda r: r["loss_pct"])
        slower = [
            r["tokens"]
            for r in m["rows"]
            if r["nccl_beaten"] and r["paired_pct"]["one_all_reduce"] >= 0
        ]
        worst_table = max(m["rows"], key=lambda r: r["vs_table_paired_pct"])
        beaten = [r["tokens"] for r in m["rows"] if r["table_beaten"]]
        table_wins = [
            r["tokens"]
            for r in m["rows"]
            if r["table_beaten"] and r["vs_table_paired_pct"] > -TABLE_BEAT_PCT
        ]
        worst_engine = max(m["rows"], key=lambda r: r["engine_vs_dynamic_paired_pct"])
        skips = sum(m["cudagraph_skips"].values())
        untuned = m["compile_s"]["dynamic_untuned"]
        # A range's first call that compiled its graph, past the first range.
        range_compiles = [c for c in m["first_calls"] if "untuned_compile_s" in c]
        worst_range = max(
            range_compiles,
            key=lambda c: c["seconds"] - c["untuned_cold_compile_s"],
            default=None,
        )
        cached_ranges = [c for c in range_compiles if "cached_compile_s" in c]
        worst_cached = max(
            cached_ranges,
            key=lambda c: c["cached_compile_s"] - c["untuned_compile_s"],
            default=None,
        )
        lines += [
            f"  step within {LOSS_GOAL_PCT:g}% of the best single-implementation dynamic compile "
            f"(paired by round): worst {worst['vs_best_single_paired_pct']:+.1f}% at {worst['tokens']} "
            f"tokens -> {verdict(worst['vs_best_single_paired_pct'] <= LOSS_GOAL_PCT)} (medians: "
            f"{worst['vs_best_single_pct']:+.1f}%; against the best static "
            f"compile too: worst {worst_static['loss_pct']:+.1f}% at {worst_static['tokens']} tokens)",
            f"  faster than plain NCCL wherever another implementation is: "
            f"{'yes' if not slower else 'not at ' + str(slower)} -> {verdict(not slower)}",
            f"  no more than {TABLE_SLOWER_PCT:g}% slower than the table (paired by round): worst "
            f"{worst_table['vs_table_paired_pct']:+.1f}% at {worst_table['tokens']} tokens "
            f"-> {verdict(worst_table['vs_table_paired_pct'] <= TABLE_SLOWER_PCT)} (medians: "
            f"{worst_table['vs_table_pct']:+.1f}%)",
            f"  {TABLE_BEAT_PCT:g}% faster than the table where its pick loses by more (at "
            f"{beaten or 'no size'}): {'yes' if not table_wins else 'not at ' + str(table_wins)} "
            f"-> {verdict(not table_wins)}",
            f"  each further range's compile within {RANGE_COMPILE_S:g} s of its untuned compile "
            "(the model with the range's winner written in, first called at the range's size, "
            "its kernels compiled cold as the range graph's were): "
            + (
                f"worst {worst_range['seconds']:.2f} s against "
                f"{worst_range['untuned_cold_compile_s']:.2f} s at {worst_range['tokens']} tokens "
                f"-> {verdict(worst_range['seconds'] <= worst_range['untuned_cold_compile_s'] + RANGE_COMPILE_S)}"
                f" (against it on the process's warm caches, {worst_range['untuned_compile_s']:.2f} s: "
                f"{verdict(worst_range['seconds'] <= worst_range['untuned_compile_s'] + RANGE_COMPILE_S)}; "
                f"against the model's untuned compile, {untuned:.2f} s: "
                f"{verdict(worst_range['seconds'] <= untuned + RANGE_COMPILE_S)})"
                if worst_range
                else "no further range"
            ),
            "  the same with kernels cached (the tuned compiles again: their further ranges "
            "against the untuned compile on the process's caches, medians): "
            + (
                f"worst {worst_cached['cached_compile_s']:.2f} s against "
                f"{worst_cached['untuned_compile_s']:.2f} s at {worst_cached['tokens']} tokens "
                f"-> {verdict(worst_cached['cached_compile_s'] <= worst_cached['untuned_compile_s'] + RANGE_COMPILE_S)}"
                if worst_cached
                else "no further range compiled again"
            ),
            f"  the serving engine's flow (guards filtered, first call at the largest size) "
            f"within {ENGINE_GOAL_PCT:g}% of plain torch.compile at every size (paired): worst "
            f"{worst_engine['engine_vs_dynamic_paired_pct']:+.1f}% at {worst_engine['tokens']} "
            f"tokens -> {verdict(worst_engine['engine_vs_dynamic_paired_pct'] <= ENGINE_GOAL_PCT)}; "
            "host us/call (engine, plain): "
            + "; ".join(
                f"{r['tokens']}: {r['host_us']['engine']:.0f}, {r['host_us']['dynamic']:.0f}"
                for r in m["rows"]
            ),
            f"  cudagraph skips {m['cudagraph_skips']} -> {verdict(skips == 0)}; compiles after the "
            f"warm-up {m['compiles_after_warm_up']} -> "
            f"{verdict(not any(m['compiles_after_warm_up'].values()))}; the dynamic model's compiles "
            f"{m['compiles']['dynamic']} for {m['ranges']} ranges -> "
            f"{verdict(m['compiles']['dynamic'] <= m['ranges'])}",
            "  warm-up, first calls: "
            + "; ".join(
                f"{c['tokens']}: {c['range']}, {c['compiles']} compiles "
                f"({c['seconds']:.2f} s)"
                for c in m["first_calls"]
            ),
            "  per size: "
            + "; ".join(
                f"{r['tokens']}: {r['range']}, host {r['host_us']['dynamic']:.0f} us/call"
                for r in m["rows"]
            ),
            f"  extra compile of the ladder (tuned {m['compile_s']['dynamic_tuned']:.2f} s - untuned "
            f"{m['compile_s']['dynamic_untuned']:.2f} s; goal <= {LADDER_GOAL_S:g} s per op): "
            f"{m['extra_compile_s']:.2f} s -> {verdict(m['extra_compile_s'] <= LADDER_GOAL_S)}; "
            f"again with the benchmark's kernels compiled: {m['extra_compile_again_s']:.2f} s -> "
            f"{verdict(m['extra_compile_again_s'] <= LADDER_GOAL_S)}; both on fresh caches "
            f"(tuned {m['compile_s']['dynamic_tuned_fresh']:.2f} s - untuned "
            f"{m['compile_s']['dynamic_untuned_fresh']:.2f} s): "
            f"{m['extra_compile_fresh_s']:.2f} s -> "
            f"{verdict(m['extra_compile_fresh_s'] <= LADDER_GOAL_S)}",
        ]
    lines.append(f"wall time: {result['wall_s']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", required=True, help="the results JSON (rank 0 writes it)"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--no-producer",
        action="store_true",
        help="layers x + all_reduce(x @ w): no pointwise producer for an inlined "
        "all-reduce to fuse into its input's copy",
    )
    parser.add_argument(
        "--tokens", default="", help="comma-separated sizes (default: the device's)"
    )
    parser.add_argument(
        "--modes", default="", help="graph,eager (default: the device's)"
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also record each variant's device time per kernel at each size (GPUs)",
    )
    parser.add_argument(
        "--pointwise-autotune",
        choices=["on", "off"],
        default="on",
        help="Inductor's timing of each pointwise kernel's launch configurations at "
        "its first launch, on each rank alone (on: the default, as users run it; off: "
        "every rank and variant keeps the same configuration)",
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="keep each rank's thread on physical cores of its own (SMT siblings "
        "included), which steadies host-bound eager steps; off (the default), the OS "
        "places them, as users run",
    )
    parser.add_argument(
        "--profile-compiles",
        action="store_true",
        help="run each first call of the dynamic model's warm-up under cProfile and "
        "record collective autotuning's cumulative seconds there",
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
