"""Timing a key's choices on this rank, in lockstep with its group, and the winner.

Once the group agreed to benchmark a key (kernel/collective/graph_sessions.py), each
rank compiles its choices (:func:`build`: with the call site's pointwise neighbours, or
for any size where the key is a range of a dynamic op), makes the benchmark inputs as
Inductor makes them (in symmetric memory where a choice needs it), and hands one runner
per choice to runtime/collective_benchmarking's CollectiveBenchmarker
(:func:`benchmark`). The timings it returns are identical on every rank, and so is the
winner :func:`pick` takes from them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, TYPE_CHECKING

import torch
from torch._inductor import config
from torch._inductor.kernel.collective import dispatch
from torch._inductor.kernel.collective.dispatch import Incumbent
from torch._inductor.kernel.collective.choice_modules import (
    AfterOwnedInput,
    costs_alike_uncompiled,
    eager_module,
    LOWER,
    module_for_benchmark,
    Neighbours,
    START,
)
from torch._inductor.kernel.collective.choices import (
    DEFAULT,
    needs_symmetric_memory,
    own_waits,
)
from torch._inductor.kernel.collective.waits import waited_call
from torch.distributed._store_session import describe
from torch._inductor.runtime.collective_benchmarking import (
    BenchmarkSettings,
    Candidate,
    ChoiceTiming,
    CollectiveBenchmarker,
    DROP_MARGIN,
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
    """What Inductor makes a call site's benchmark inputs from: the
    AlgorithmSelectorCache (its ``get_inputs``), the site's input nodes, its output
    layout and the op's input generators."""

    selector: Any
    input_nodes: list[Any]
    layout: Any
    input_gen_fns: dict[int, Callable[..., torch.Tensor]] | None


def timing_mode(
    settings: BenchmarkSettings, device: torch.device, cudagraphs: bool
) -> TimingMode:
    """How to time: as the model runs, or in CUDA graphs where the op was registered
    with ``benchmark_with_cudagraphs``."""
    if cudagraphs and settings.mode == "auto":
        if device.type == "cuda":
            return TimingMode.GRAPH
        _warn_cudagraphs_on_cpu()
    return settings.timing_mode(device)


@functools.lru_cache(None)  # once per process, as Python's own warnings
def _warn_cudagraphs_on_cpu() -> None:
    log.warning("benchmark_with_cudagraphs has no effect on CPU: CUDA graphs need CUDA")


def timed_with(neighbours: Neighbours, choices: Sequence[ChoiceCaller]) -> Neighbours:
    """The neighbours to time a site's choices with: none where a choice calls
    symmetric-memory ops in its graph, whose inputs the benchmark places in symmetric
    memory itself (a stand-in producer's output would not be). The same on every
    rank: it reads the traced graphs."""
    return (
        Neighbours() if any(needs_symmetric_memory(c) for c in choices) else neighbours
    )


# A benchmark module's pointwise kernels get one launch config (the first of those
# Inductor would try), not the several it times at a kernel's first launch: 50-90 ms a
# kernel, one after another, inside the choices' first calls. Every compiled choice's
# neighbours and copies get the same one; the model's own kernels, the inlined
# winner's included, are tuned as before.
_BENCHMARK_MODULE_CONFIG = {"triton.autotune_pointwise": False}


def build(
    name: str,
    choices: dict[str, ChoiceCaller],
    device: torch.device,
    neighbours: Neighbours,
    mode: TimingMode,
) -> dict[str, str]:
    """Compile ``choices`` (by label) of op ``name`` for benchmarking in timing
    ``mode``, with ``neighbours`` fused in; why each one that cannot run here fails (""
    if it can).

    In two passes: every choice is lowered and its code generated first, so that the
    kernels of all of them compile together in Inductor's worker pool; then each module
    is loaded, waiting for its kernels. (Compiled one after the other, a key's choices
    cost the sum of their compiles.)"""
    finishes: dict[str, Callable[[], None]] = {}
    failures: dict[str, str] = {}
    traced = timed_as_traced(choices, device, neighbours, mode)
    for label, choice in choices.items():
        try:
            finishes[label] = _start(name, choice, device, neighbours, label in traced)
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
    """The subgraph ``choices`` (by label) to time as traced, with ``neighbours``'
    stand-ins run eagerly around them (choice_modules.eager_module), rather than
    compiled with them. The same on every rank that traced the same choices: it reads
    the traced graphs (a choice that one rank could not trace, the group drops).

    On a CPU every one (eager_module says why). On a GPU, those whose compile would
    put nothing more on the device (costs_alike_uncompiled): in graph mode each such
    choice, a CUDA graph's replay costing what its kernels cost on the device; in the
    default mode all of them or none. There the host launches each kernel, and an
    eager stand-in launches cheaper than a Triton kernel: a key whose choices were
    timed some compiled and some as traced once took a choice 38% slower in the model
    (a host-bound step). Timed all alike, each choice pays the same launches for the
    same neighbours, as in the model, where every choice's neighbours are the model's
    own kernels; a choice with pointwise work of its own must be compiled to be timed
    as it runs, and then so are the others."""
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
    """Whether ``choice`` is a traced subgraph that Inductor compiles for its benchmark
    (the op's own implementation is called as it is)."""
    return getattr(choice, "gm", None) is not None and hasattr(
        choice, "_compile_for_benchmarking"
    )


def _start(
    name: str,
    choice: ChoiceCaller,
    device: torch.device,
    neighbours: Neighbours,
    as_traced: bool,
) -> Callable[[], None]:
    """Start building ``choice``, compiled or (``as_traced``) only lowered, to be
    timed as traced (:func:`timed_as_traced`, counted in
    ``counters["inductor"]["collective_autotune_uncompiled_choices"]`` on GPUs); the
    function that finishes it (its module loaded)."""
    from torch._dynamo.utils import counters

    if needs_symmetric_memory(choice) and device.type != "cuda":
        raise RuntimeError("uses symmetric memory, which needs CUDA")
    if not _is_subgraph(choice):
        choice.to_callable()
        return lambda: None
    if choice._compiled_module is not None:  # type: ignore[attr-defined]
        return lambda: None
    compile_choice = (
        dispatch.benchmark_module if dispatch.is_range(name) else module_for_benchmark
    )
    if as_traced:
        if device.type == "cuda":
            counters["inductor"]["collective_autotune_uncompiled_choices"] += 1
        # Lowered (a choice that cannot be compiled is dropped now, not found when
        # the winner is inlined), and timed as traced.
        compile_choice(choice, neighbours.fused, LOWER)
        module = eager_module(choice, neighbours)
        choice._compiled_module = module  # type: ignore[attr-defined]
        return lambda: None
    with config.patch(_BENCHMARK_MODULE_CONFIG):
        load = compile_choice(choice, neighbours.fused, START)

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


def _prepared_inputs(
    inputs: BenchmarkInputs,
    by_label: dict[str, ChoiceCaller],
    names: Sequence[str],
    process_group: ProcessGroup,
    session: CollectiveSession,
    neighbours: Neighbours,
    mutable: Sequence[int],
) -> tuple[list[Candidate], ScreenInputs]:
    """The candidates ``names`` (labels of ``by_label``) on benchmark inputs made as
    Inductor makes them (in symmetric memory where a choice needs it)."""
    choices = [by_label[n] for n in names]
    args = inputs.selector.get_inputs(
        choices, inputs.input_nodes, inputs.layout, inputs.input_gen_fns
    )
    tensors, _ = args.get_benchmark_tensors(False).unpack()
    tensors = list(tensors)
    available = not any(
        needs_symmetric_memory(c) for c in choices
    ) or _move_to_symmetric_memory(tensors, process_group, session)
    # Vote topics carry these names, so they must be the same on every rank.
    candidates = [
        (
            Candidate(n, _unavailable("symmetric memory unavailable on this group"))
            if needs_symmetric_memory(c) and not available
            else Candidate(n, _runner(c, tensors, neighbours))
        )
        for n, c in zip(names, choices)
    ]
    return candidates, ScreenInputs(tensors, mutable)


def benchmark(
    inputs: BenchmarkInputs,
    by_label: dict[str, ChoiceCaller],
    names: list[str],
    process_group: ProcessGroup,
    settings: BenchmarkSettings,
    mode: TimingMode,
    session: CollectiveSession,
    keep_default: bool,
    neighbours: Neighbours,
    mutable: Sequence[int] = (),
    incumbent: str | None = None,
) -> tuple[list[ChoiceTiming], dict[str, float]]:
    """The group's timings of the choices ``names`` (labels of ``by_label``), in
    lockstep with its other ranks in ``session``, and the seconds each step of the
    benchmark took on this rank. Sampling stops early once no choice is clearly faster
    than ``incumbent`` (a screened ladder range's)."""
    candidates, screened = _prepared_inputs(
        inputs, by_label, names, process_group, session, neighbours, mutable
    )
    reference = names.index(DEFAULT) if DEFAULT in names else 0
    benchmarker = CollectiveBenchmarker(
        process_group, inputs.layout.device, settings, session, mode
    )
    timings = benchmarker.benchmark(
        candidates,
        screened,
        reference,
        keep=(reference,) if keep_default else (),
        incumbent=names.index(incumbent) if incumbent in names else None,
    )
    return timings, benchmarker.phases


def screen_stored(
    inputs: BenchmarkInputs,
    by_label: dict[str, ChoiceCaller],
    winner: str,
    process_group: ProcessGroup,
    settings: BenchmarkSettings,
    mode: TimingMode,
    session: CollectiveSession,
    neighbours: Neighbours,
    mutable: Sequence[int] = (),
) -> str:
    """Screen a kept ``winner`` against the op's own implementation on every rank, in
    lockstep: "" where it passed, else why not (the same words on every rank)."""
    names = [DEFAULT, winner]
    candidates, screened = _prepared_inputs(
        inputs, by_label, names, process_group, session, neighbours, mutable
    )
    benchmarker = CollectiveBenchmarker(
        process_group, inputs.layout.device, settings, session, mode
    )
    outcome = benchmarker.screen(candidates, screened, reference=0)[1]
    return "" if outcome.ok else f"failed its screen: {outcome.reason}"


def _runner(
    choice: ChoiceCaller, inputs: list[torch.Tensor], neighbours: Neighbours
) -> Callable[[], torch.Tensor]:
    """One call of ``choice`` on ``inputs`` with ``neighbours`` around it, returning
    its output."""
    module = getattr(choice, "_compiled_module", None)
    if module is not None:  # a subgraph choice, compiled by build with its neighbours
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
        # The op's own implementation: waited for where its body leaves that to the
        # caller.
        call = waited_call(
            kernel,
            own_waits(getattr(getattr(choice, "choice", None), "op_overload", None)),
        )
    # The op's own implementation runs as an opaque call in the model, its
    # neighbours as kernels of their own: so here.
    with_neighbours = neighbours.around(call)
    return lambda: with_neighbours(*inputs)


def _move_to_symmetric_memory(
    inputs: list[torch.Tensor], group: ProcessGroup, session: CollectiveSession
) -> bool:
    """Replace ``inputs`` by copies in symmetric memory of ``group`` (all ranks at
    once)."""
    from torch.distributed import _symmetric_memory as symm_mem

    # Each rank votes why it could not (None: it could).
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
    except Exception as e:  # whatever it raised: the group votes, and says why
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
    """The winner and why. ``incumbent``: for a ladder range, the winner of its nearest
    decided ranges, which keeps this range unless the fastest here is clearly faster
    (by more than their samples' spread): switching implementations along the ladder
    costs a size dispatch, so noise must not decide it."""
    # The vector is identical on every rank; min() keeps the first of equal times.
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
        # (A kept choice that failed has infinite quartiles: anything is clearly
        # faster.)
        if not timings[best].clearly_faster_than(timings[kept]):
            because = (
                f"{names[best]} is not clearly faster at this range's top size on "
                "their slowest ranks (their quartiles are within "
                f"{100 * DROP_MARGIN:g}% of each other), and {names[kept]} won at "
                f"{incumbent.won_at}"
            )
            best = kept
    own = next((t for t in timings if t.name == DEFAULT), None)
    # A threshold of 1 asks for the fastest, a tie above included.
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
