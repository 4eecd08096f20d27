"""What collective autotuning installs into upstream at run time, in one place.

Everything else it needs of upstream is an edit of the upstream file, in the overlay's
diffs (patches/torch-<minor>.diff): the registration, choice preparation, detection and
size-dispatch hooks of custom_op.py, the selection hook of select_algorithm.py, the
knobs of config.py, the logging artifact, the FX-graph cache gate of codecache.py, the
decisions a compiled graph records (output_code.py), and the CUDA-graph rules for a
torch.cond whose predicate reads sizes only (lowering.py, scheduler.py).

What stays here needs no upstream change: it goes through an upstream registry meant
for it. test/inductor/collective_contracts.py checks that it fires.
"""


from __future__ import annotations

import functools
from typing import Any

from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings
from torch._inductor.runtime.collective_protocol import participant


@functools.lru_cache(None)
def install() -> None:
    """Install every hook (once per process)."""
    _beat_while_compiling()


def _beat_while_compiling() -> None:
    """Beat (runtime/collective_protocol.Liveness) while Dynamo compiles a frame or a
    lazy backward, in a process that registered a collective op while collective
    tuning is on: a peer's sessions may wait for this compile, and must, as long as it
    goes on. Dynamo runs these callbacks for the outermost compile only.

    Not a wrapper: Dynamo's own callback registry takes them, so no upstream change
    is needed.
    """
    from torch._dynamo.callback import callback_handler

    compiling: list[Any] = []

    def start(args: Any = None) -> None:
        import torch.distributed as dist
        from torch._inductor import config

        beat = None
        if config.collective_autotune and dist.is_available() and dist.is_initialized():
            # Validated first: a bad knob fails here, naming itself.
            member = participant(BenchmarkSettings.from_config().timeout)
            # (older Dynamo calls its callbacks without arguments)
            doing = f"compiling graph {getattr(args, 'compile_id', '')}".rstrip()
            beat = member.liveness.working(doing)
            beat.__enter__()
        compiling.append(beat)

    def end(args: Any = None) -> None:
        if compiling and (beat := compiling.pop()) is not None:
            beat.__exit__(None, None, None)

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
