"""Beats a rank's heartbeat while Dynamo compiles, so that peers in a session wait for
it. Other upstream changes are in patches/series/ (see patches/torch-<minor>.series)."""

from __future__ import annotations

from typing import Any

from torch._inductor.runtime.collective_benchmarking import BenchmarkSettings
from torch._inductor.runtime.collective_protocol import (
    participant,
    process_group_initialized,
)

# A heartbeat (or None) per running compile; fresh_cache (maybe mid-compile) keeps it.
_compiling: list[Any] = []


def install(compiling: bool) -> None:
    """Register the callbacks again if ``torch._dynamo.reset()`` dropped them."""
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
        member = participant(BenchmarkSettings.from_config().timeout)
        # some Dynamo versions call callbacks without arguments
        beat = member.liveness.working(
            f"compiling graph {getattr(args, 'compile_id', '')}".rstrip()
        )
        beat.__enter__()
    _compiling.append(beat)


def _end(args: Any = None) -> None:
    if _compiling and (beat := _compiling.pop()) is not None:
        beat.__exit__(None, None, None)
