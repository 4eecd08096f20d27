"""Every hook this package installs into upstream internals at run time, in one place.

The overlay edits the upstream files it must (patches/torch-2.11.diff and
torch-2.13.diff: custom_op.py, select_algorithm.py, config.py, the logging artifact).
What else collective autotuning needs of upstream is installed here, once per process,
by :func:`install` (called when the first op is registered for autotuning). Each hook
says why it is not in the diffs and which upstream change would remove it.

Two overrides of upstream state hold for one moment only, where they are needed, and
are listed here so that this stays the one place to read:

* ``collective_choice_modules.guards_refused``: on torch 2.11, which has no
  ``ShapeEnv.error_on_new_guards``, the ShapeEnv's ``_check_frozen`` is replaced while
  a size-generic module or a size dispatch is traced, so that a new guard raises
  instead of narrowing the model's sizes. Not in the diff: it is one instance of the
  ShapeEnv, for one trace. Removed by dropping torch 2.11 (torch 2.13 has the API).
* ``collective_dispatch._inline_keeping_cudagraphs``: after a size dispatch is
  inlined, the graph's ``disable_cudagraphs_reason`` set by Inductor's ``torch.cond``
  lowering is put back as it was (the predicate reads sizes only). Not in the diff:
  the cond lowering lives in lowering.py, which the 2.11 overlay does not patch.
  Removed by an upstream cond lowering that keeps CUDA graphs for predicates over
  sizes only.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from torch._inductor.kernel import collective_dispatch, collective_graph
from torch._inductor.runtime.collective_protocol import liveness


@functools.lru_cache(None)
def install() -> None:
    """Install every hook (once per process)."""
    _gate_cache_hits()
    _keep_size_dispatches_in_partitions()
    _beat_while_compiling()


def _gate_cache_hits() -> None:
    """Route FX-graph cache hits (also those of AOTAutograd entries) through
    ``collective_graph.cached_graph_may_load``.

    ``FxGraphCache.cache_hit_post_compile`` finishes every hit and may return None
    (a miss, compiled afresh). Wrapped here rather than edited into codecache.py
    because the overlay patches no upstream file it need not (codecache.py is not one
    on torch 2.11). Removed by one line in that function upstream: a call of the gate
    (or of a hook through which a backend may veto a cache hit).
    """
    from torch._inductor.codecache import FxGraphCache

    original = FxGraphCache.cache_hit_post_compile

    def cache_hit_post_compile(graph: Any, cache_info: Any, constants: Any) -> Any:
        from torch._inductor import config

        if not collective_graph.cached_graph_may_load(
            getattr(graph, "counter_deltas", None), config.collective_benchmark_timeout
        ):
            cache_info["cache_state"] = "miss"
            return None, cache_info
        return original(graph, cache_info, constants)

    FxGraphCache.cache_hit_post_compile = staticmethod(cache_hit_post_compile)  # type: ignore[method-assign]


def _keep_size_dispatches_in_partitions() -> None:
    """Keep size dispatches (collective_dispatch.lower_size_dispatch) inside CUDA-graph
    partitions.

    With ``graph_partition`` (the default from torch 2.11), the scheduler runs every
    ``Conditional`` outside CUDA graphs, for the same reason as the cond lowering
    (above): here, partition boundaries at every layer, and on torch 2.11 outputs of
    the partitions around it that CUDA-graph trees refuse. A size dispatch is as safe
    to capture as any kernel. Wrapped here because the overlay patches no upstream
    file it need not (scheduler.py is not one). Removed by one condition upstream in
    ``Scheduler.should_partition``: no partition at a Conditional whose predicate
    reads sizes only.
    """
    from torch._inductor.scheduler import Scheduler

    original = Scheduler.should_partition

    @functools.wraps(original)
    def should_partition(self: Any, node: Any) -> Optional[str]:
        reason = original(self, node)
        if reason == "Conditional ops" and collective_dispatch.is_size_dispatch(getattr(node, "node", None)):
            return None
        return reason

    Scheduler.should_partition = should_partition  # type: ignore[method-assign]


def _beat_while_compiling() -> None:
    """Beat (runtime/collective_protocol.Liveness) while Dynamo compiles a frame or a
    lazy backward: a peer's sessions may wait for this compile, and must, as long as
    it goes on. Dynamo runs these callbacks for the outermost compile only.

    Not a wrapper: Dynamo's own callback registry takes them, so no upstream change
    is needed.
    """
    from torch._dynamo.callback import callback_handler

    compiling: list[Any] = []

    def start(args: Any = None) -> None:
        # (older Dynamo calls its callbacks without arguments)
        compiling.append(liveness.working(f"compiling graph {getattr(args, 'compile_id', '')}".rstrip()))
        compiling[-1].__enter__()

    def end(args: Any = None) -> None:
        if compiling:
            compiling.pop().__exit__(None, None, None)

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
