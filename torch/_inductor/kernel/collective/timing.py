"""Building and timing a key's choices in lockstep with the group; picking a winner.

Once the group agreed to benchmark a key (graph_sessions.py), each rank compiles its
choices (:func:`build`), makes the inputs as Inductor does and times one runner per
choice with CollectiveBenchmarker (:func:`benchmark`). Its timings, and so the winner
:func:`pick` takes, are identical on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, TYPE_CHECKING

import torch
from torch._inductor import config
from torch._inductor.kernel.collective import dispatch
from torch._inductor.kernel.collective.ladder import Incumbent, TOLERANCE
from torch._inductor.kernel.collective.choice_modules import (
    Stage,
    AfterOwnedInput,
    costs_alike_uncompiled,
    eager_module,
    module_for_benchmark,
    Neighbours,
)
from torch._inductor.kernel.collective.choices import (
    DEFAULT,
    needs_symmetric_memory,
    own_waits,
)
from torch._inductor.kernel.collective.waits import waited_call
from torch._inductor.runtime.collective_protocol import describe
from torch._inductor.runtime.collective_benchmarking import (
    BenchmarkSettings,
    Candidate,
    ChoiceTiming,
    CollectiveBenchmarker,
    ScreenInputs,
    TimingMode,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from torch._inductor.ir import ChoiceCaller
    from torch._inductor.runtime.collective_protocol import CollectiveSession


log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchmarkInputs:
    """What Inductor makes a call site's benchmark inputs from (see
    ``AlgorithmSelectorCache.get_inputs``)."""

    selector: Any
    input_nodes: list[Any]
    layout: Any
    input_gen_fns: dict[int, Callable[..., torch.Tensor]] | None


@dataclasses.dataclass(frozen=True)
class SiteTiming:
    """How upstream asks a call site's choices to be timed."""

    min_speedup_threshold: float
    benchmark_with_cudagraphs: bool


def timing_mode(
    settings: BenchmarkSettings, device: torch.device, cudagraphs: bool
) -> TimingMode:
    """How to time: as the model runs, or in CUDA graphs where the op asked for it."""
    if cudagraphs and settings.mode == "auto":
        if device.type == "cuda":
            return TimingMode.GRAPH
        torch._logging.warning_once(
            log, "benchmark_with_cudagraphs has no effect on CPU: CUDA graphs need CUDA"
        )
    return settings.timing_mode(device)


def timed_with(neighbours: Neighbours, choices: Sequence[ChoiceCaller]) -> Neighbours:
    """The neighbours to time ``choices`` with: none where a choice needs symmetric
    memory, as a stand-in producer's output would not be in it. Rank-independent."""
    return (
        Neighbours() if any(needs_symmetric_memory(c) for c in choices) else neighbours
    )


# Benchmark modules' pointwise kernels take one launch config instead of autotuning
# at first launch, identically for every choice; the model's own kernels still tune.
_BENCHMARK_MODULE_CONFIG = {"triton.autotune_pointwise": False}


def build(
    name: str,
    choices: dict[str, ChoiceCaller],
    device: torch.device,
    neighbours: Neighbours,
    mode: TimingMode,
    any_size: bool = False,
) -> dict[str, str]:
    """Compile ``choices`` (by label) for benchmarking with ``neighbours`` fused in;
    returns why each one that cannot run here failed. ``any_size``: a dynamic site's
    probe, whose choices are compiled once for every size of the site.

    Two passes (generate all code, then load) so that every choice's kernels compile
    together in Inductor's worker pool."""
    finishes: dict[str, Callable[[], None]] = {}
    failures: dict[str, str] = {}
    traced = timed_as_traced(choices, device, neighbours, mode)
    compile_choice = dispatch.benchmark_module if any_size else module_for_benchmark
    for label, choice in choices.items():
        try:
            finishes[label] = _start(
                compile_choice, choice, device, neighbours, label in traced
            )
        except Exception as e:  # the group drops it, saying why
            log.debug("choice %s of %s did not build", label, name, exc_info=True)
            failures[label] = _failure(choice, e)
    for label, finish in finishes.items():
        try:
            finish()
        except Exception as e:  # likewise
            log.debug("choice %s of %s did not load", label, name, exc_info=True)
            failures[label] = _failure(choices[label], e)
    return failures


def timed_as_traced(
    choices: dict[str, ChoiceCaller],
    device: torch.device,
    neighbours: Neighbours,
    mode: TimingMode,
) -> set[str]:
    """The subgraph ``choices`` to time as traced (choice_modules.eager_module)
    rather than compiled; rank-independent, as it reads only the traced graphs.

    On CPU, all. On GPU, those that compiling would not change on the device
    (costs_alike_uncompiled); outside graph mode all or none, so that every choice
    pays the same host launch costs for its neighbours."""
    subgraphs = {
        label: choice.gm for label, choice in choices.items() if _is_subgraph(choice)
    }
    if device.type != "cuda":
        return set(subgraphs)
    alike = {
        label
        for label, gm in subgraphs.items()
        if costs_alike_uncompiled(gm, neighbours)
    }
    if mode is TimingMode.GRAPH or alike == set(subgraphs):
        return alike
    return set()


def _is_subgraph(choice: ChoiceCaller) -> bool:
    """Whether ``choice`` is a traced subgraph Inductor compiles for benchmarking."""
    return getattr(choice, "gm", None) is not None and hasattr(
        choice, "_compile_for_benchmarking"
    )


def _start(
    compile_choice: Callable[..., Any],
    choice: ChoiceCaller,
    device: torch.device,
    neighbours: Neighbours,
    as_traced: bool,
) -> Callable[[], None]:
    """Start building ``choice`` with ``compile_choice`` (only lowered where
    ``as_traced``); returns the function that finishes it by loading its module."""
    from torch._dynamo.utils import counters

    if needs_symmetric_memory(choice) and device.type != "cuda":
        raise RuntimeError("uses symmetric memory, which needs CUDA")
    if not _is_subgraph(choice):
        choice.to_callable()
        return lambda: None
    if choice._compiled_module is not None:  # type: ignore[attr-defined]
        return lambda: None
    if as_traced:
        if device.type == "cuda":
            counters["inductor"]["collective_autotune_uncompiled_choices"] += 1
        # Lowered anyway, so a choice that cannot compile is dropped now.
        compile_choice(choice, neighbours.fused, Stage.LOWER)
        module = eager_module(choice, neighbours)
        choice._compiled_module = module  # type: ignore[attr-defined]
        return lambda: None
    with config.patch(_BENCHMARK_MODULE_CONFIG):
        load = compile_choice(choice, neighbours.fused, Stage.START)

    def finish() -> None:
        module = load() if callable(load) else load
        if neighbours.owned_input:
            module = AfterOwnedInput(module, len(choice.sym_input_values))  # type: ignore[attr-defined]
        choice._compiled_module = module  # type: ignore[attr-defined]

    return finish


def _failure(choice: ChoiceCaller, error: Exception) -> str:
    """Why building ``choice`` failed, in the words the group reports."""
    log.debug("build failure of %s", choice.name, exc_info=error)
    return f"does not build ({describe(error)})"


@dataclasses.dataclass(frozen=True)
class SiteBenchmark:
    """A call site's choices by label, what their inputs are made from, and how its
    group times them in lockstep: alike on every rank but the tensors."""

    inputs: BenchmarkInputs
    by_label: dict[str, ChoiceCaller]
    group: ProcessGroup
    settings: BenchmarkSettings
    mode: TimingMode
    neighbours: Neighbours
    # Positions of the tensor inputs the op declares it writes into.
    mutable: Sequence[int]


def _prepared_inputs(
    bench: SiteBenchmark, names: Sequence[str], session: CollectiveSession
) -> tuple[list[Candidate], ScreenInputs]:
    """The candidates ``names`` and the inputs they run on, in symmetric memory where
    a choice needs it."""
    inputs = bench.inputs
    choices = [bench.by_label[n] for n in names]
    args = inputs.selector.get_inputs(
        choices, inputs.input_nodes, inputs.layout, inputs.input_gen_fns
    )
    tensors, _ = args.get_benchmark_tensors(False).unpack()
    tensors = list(tensors)
    available = not any(
        needs_symmetric_memory(c) for c in choices
    ) or _move_to_symmetric_memory(tensors, bench.group, session)
    # Vote topics carry these names, so they must be the same on every rank.
    candidates = [
        (
            Candidate(n, _unavailable("symmetric memory unavailable on this group"))
            if needs_symmetric_memory(c) and not available
            else Candidate(n, _runner(c, tensors, bench.neighbours))
        )
        for n, c in zip(names, choices)
    ]
    return candidates, ScreenInputs(tensors, bench.mutable)


def benchmark(
    bench: SiteBenchmark,
    names: list[str],
    session: CollectiveSession,
    keep_default: bool,
    incumbent: str | None = None,
) -> tuple[list[ChoiceTiming], dict[str, float]]:
    """The group's timings of ``names``, taken in lockstep in ``session``, and this
    rank's seconds per benchmark phase. Stops early once no choice is clearly faster
    than ``incumbent``."""
    candidates, screened = _prepared_inputs(bench, names, session)
    reference = names.index(DEFAULT) if DEFAULT in names else 0
    benchmarker = CollectiveBenchmarker(
        bench.group, bench.inputs.layout.device, bench.settings, session, bench.mode
    )
    timings = benchmarker.benchmark(
        candidates,
        screened,
        reference,
        keep=(reference,) if keep_default else (),
        incumbent=names.index(incumbent) if incumbent in names else None,
    )
    return timings, benchmarker.phases


def screen_stored(bench: SiteBenchmark, winner: str, session: CollectiveSession) -> str:
    """Screen a stored ``winner`` against the op's own implementation in lockstep:
    "" where it passed, else why not (identical on every rank)."""
    candidates, screened = _prepared_inputs(bench, [DEFAULT, winner], session)
    benchmarker = CollectiveBenchmarker(
        bench.group, bench.inputs.layout.device, bench.settings, session, bench.mode
    )
    outcome = benchmarker.screen(candidates, screened, reference=0)[1]
    return "" if outcome.ok else f"failed its screen: {outcome.reason}"


def _runner(
    choice: ChoiceCaller, inputs: list[torch.Tensor], neighbours: Neighbours
) -> Callable[[], torch.Tensor]:
    """One call of ``choice`` on ``inputs`` with ``neighbours`` around it."""
    module = getattr(choice, "_compiled_module", None)
    if module is not None:  # compiled by build() with its neighbours
        sym_inputs = list(choice.sym_input_values)  # type: ignore[attr-defined]
        return lambda: module.call([*sym_inputs, *inputs])[0]
    kernel = choice.to_callable()
    if getattr(choice, "has_out_variant", False):
        out = torch.empty_strided(
            [int(s) for s in choice.layout.size],
            [int(s) for s in choice.layout.stride],
            dtype=choice.layout.dtype,
            device=choice.layout.device,
        )

        def call(*args: torch.Tensor) -> torch.Tensor:
            kernel(*args, out=out)
            return out

    else:
        # Wait here where the op leaves waiting to its caller.
        call = waited_call(
            kernel,
            own_waits(getattr(getattr(choice, "choice", None), "op_overload", None)),
        )
    # As in the model: the op is an opaque call, its neighbours separate kernels.
    with_neighbours = neighbours.around(call)
    return lambda: with_neighbours(*inputs)


def _move_to_symmetric_memory(
    inputs: list[torch.Tensor], group: ProcessGroup, session: CollectiveSession
) -> bool:
    """Replace ``inputs`` by copies in ``group``'s symmetric memory; collective.
    False, on every rank, where any rank could not."""
    from torch.distributed import _symmetric_memory as symm_mem

    why_not: str | None = None
    moved = list(inputs)
    try:
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        for i, t in enumerate(inputs):
            if t.is_contiguous():
                buf = symm_mem.empty(t.shape, dtype=t.dtype, device=t.device)
                symm_mem.rendezvous(buf, group.group_name)
                moved[i] = buf.copy_(t)
    except Exception as e:  # reported through the vote
        why_not = f"{type(e).__name__}: {e}"[:500]
    votes = session.vote("symmetric_memory", why_not)
    failed = {r: why for r, why in enumerate(votes) if why is not None}
    if not failed:
        inputs[:] = moved
        return True
    log.warning(
        "symmetric memory is not available on group %s (%s); its choices are dropped "
        "on every rank",
        group.group_name,
        "; ".join(f"group rank {r}: {why}" for r, why in failed.items()),
    )
    return False


def _unavailable(why: str) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        raise RuntimeError(why)

    return run


def pick(
    names: list[str],
    timings: Sequence[ChoiceTiming],
    min_speedup_threshold: float,
    incumbent: Incumbent | None = None,
) -> tuple[str, str]:
    """The winner and why. A dynamic site's probe keeps ``incumbent`` unless another
    choice beats it by more than the ladder's tolerance on their slowest ranks, and
    their samples do not overlap: a switch costs a size dispatch, and neither a near
    tie nor noise may move a split."""
    # Timings are identical on every rank; min() breaks ties by order.
    best = min(range(len(names)), key=lambda i: timings[i].max_us)
    if not math.isfinite(timings[best].max_us):
        return (
            DEFAULT,
            "every choice failed on some rank; using the op's own implementation",
        )
    because = "fastest on its slowest rank"
    if (
        incumbent is not None
        and incumbent.winner != names[best]
        and incumbent.winner in names
    ):
        kept = names.index(incumbent.winner)
        ahead, leader = timings[kept], timings[best]
        if ahead.max_us <= leader.max_us * (1 + TOLERANCE):
            because = (
                f"{names[best]} is within {100 * TOLERANCE:g}% of {names[kept]} on "
                f"their slowest ranks, and {names[kept]} won at {incumbent.won_at}"
            )
            best = kept
        elif ahead.low_us <= leader.high_us:
            because = (
                f"{names[best]}'s and {names[kept]}'s samples overlap on their slowest "
                f"ranks, and {names[kept]} won at {incumbent.won_at}"
            )
            best = kept
    own = next((t for t in timings if t.name == DEFAULT), None)
    if (
        min_speedup_threshold > 1.0
        and names[best] != DEFAULT
        and own is not None
        and math.isfinite(own.max_us)
        and timings[best].max_us * min_speedup_threshold > own.max_us
    ):
        return DEFAULT, (
            f"{names[best]} is only {own.max_us / timings[best].max_us:.2f}x faster "
            "than the op's own implementation on its slowest rank, below "
            f"min_speedup_threshold={min_speedup_threshold:g}"
        )
    return names[best], because
