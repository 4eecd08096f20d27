"""What collective autotuning installs into upstream at run time, in one place.

Everything else it needs of upstream is an edit of the upstream file, in the overlay's
diffs (patches/torch-<minor>.diff): the registration, choice preparation, detection and
size-dispatch hooks of custom_op.py, the selection hook of select_algorithm.py, the
knobs of config.py, the logging artifact, the FX-graph cache gate of codecache.py, the
decisions a compiled graph records (output_code.py), lowering a benchmark choice
without compiling it (codegen/subgraph.py), and the CUDA-graph rules for a torch.cond
whose predicate reads sizes only (lowering.py, scheduler.py).

What stays here needs no upstream change: it goes through an upstream registry meant
for it. test/inductor/collective_contracts.py checks that it fires.
"""

from __future__ import annotations

from typing import Any

from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings
from torch._inductor.runtime.collective_protocol import (
    participant,
    process_group_initialized,
)

# The heartbeats of the compiles in progress (None where collective tuning is off):
# pushed as a compile starts and popped as it ends, so empty between compiles. Not
# cleared by Inductor's fresh_cache, which may run inside a compile: its end would
# find no heartbeat to stop.
_compiling: list[Any] = []


def install(compiling: bool) -> None:
    """Beat (_store_session.Liveness) while Dynamo compiles a frame or a
    lazy backward, in a process that registered a collective op while collective
    tuning is on: a peer's sessions may wait for this compile, and must, as long as it
    goes on. Dynamo runs these callbacks for the outermost compile only.

    Dynamo's callback registry takes them, so no upstream change is needed; but
    ``torch._dynamo.reset()`` empties it, so every hook of ours that runs inside a
    compile (``compiling``) installs them again where they are gone, and beats at once
    for the rest of that compile.
    """
    from torch._dynamo.callback import callback_handler

    if _start in callback_handler.start_callbacks:
        return
    callback_handler.register_start_callback(_start)
    callback_handler.register_end_callback(_end)
    if compiling:
        _start()


def _start(args: Any = None) -> None:
    from torch._inductor import config

    beat = None
    if config.collective_autotune and process_group_initialized():
        # Validated first: a bad knob fails here, naming itself.
        member = participant(BenchmarkSettings.from_config().timeout)
        # (older Dynamo calls its callbacks without arguments)
        beat = member.liveness.working(
            f"compiling graph {getattr(args, 'compile_id', '')}".rstrip()
        )
        beat.__enter__()
    _compiling.append(beat)


def _end(args: Any = None) -> None:
    if _compiling and (beat := _compiling.pop()) is not None:
        beat.__exit__(None, None, None)
