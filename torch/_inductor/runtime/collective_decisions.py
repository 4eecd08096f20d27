"""Collective autotuning decisions kept on disk, so that a restart need not re-tune.

Each benchmarked decision is one small JSON file under
``<inductor cache dir>/collective_autotuning/decisions/``, named by a digest of the
decision's key (op, input sizes, strides and dtypes, choices, timing mode) and of the
*environment* it was measured in: group size, device model, interconnect (NVLink or
PCIe), whether NVLink multicast (NVLS) is enabled, backend, and the torch and NCCL
versions. A decision measured elsewhere therefore never matches. Every rank keeps its
own files (ranks of a host usually share them); a decision read from disk is used
only when every rank of the group read the identical entry, which the group checks in
one vote (see collective/graph_sessions.py), and otherwise the group tunes afresh.

A file that cannot be read, does not parse, or belongs to another key or environment is
a miss, never an error. Files are written atomically (codecache.write_atomic), so a
reader never sees half an entry. A key covers the code identity of every choice
(kernel/collective/choices.py:code_identity), so a changed implementation is a miss; and
a stored winner is screened against the op's own implementation again before a restart
uses it (kernel/collective/graph_sessions.py), so an edited file cannot make a wrong
choice run. To forget every decision, delete the ``collective_autotuning`` folder of the
cache dir; ``collective_autotune_persist=False`` neither reads nor writes them, and
``collective_autotune_retune=True`` ignores what is there and overwrites it with fresh
measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, TYPE_CHECKING

import torch
from torch.distributed._store_session import WireMessage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


log = logging.getLogger(__name__)

# Bumped whenever the meaning of a stored decision changes.
_FORMAT = 3


@dataclasses.dataclass(frozen=True)
class Environment(WireMessage):
    """What a measurement depends on beyond the op and its shapes."""

    group_size: int
    torch: str
    backend: str
    device: str
    # CUDA devices only.
    device_model: str = ""
    # "nvlink", "pcie", or "unknown" where NVML cannot tell.
    interconnect: str = ""
    # NVLink multicast (NVLS) on.
    nvls: bool = False
    nccl: str = ""


@dataclasses.dataclass(frozen=True)
class StoredDecision(WireMessage):
    """One decision as kept on disk."""

    key: str
    environment: Environment
    winner: str
    # Slowest-rank microseconds per choice when it was measured, for the logs.
    timings_us: dict[str, float]
    # Timed without confidence (runtime/collective_confidence): the next job to meet
    # the key times the winner against the runner-up again, and settles or replaces it.
    provisional: bool = False
    runner_up: str = ""
    # Why, for the logs (Confidence.describe).
    confidence: str = ""

    def digest(self) -> str:
        """What ranks compare: the same digest means the same decision, to be taken the
        same way (used, or timed again)."""
        return digest(
            self.key,
            self.environment.to_wire(),
            self.winner,
            self.provisional,
            self.runner_up,
        )


@dataclasses.dataclass(frozen=True)
class InlinedDecision:
    """A decision that a compiled graph inlines, as its cache entry keeps it: the group
    and graph plan it was agreed in, the key, the winner, the op (for the records) and
    the environment it holds in."""

    group_name: str
    plan: str
    key: str
    winner: str
    op: str
    environment: Environment
    # The code identity of each implementation the key covers, by qualified name
    # (kernel/collective/choices.py): a graph inlining code since changed is a miss.
    code: dict[str, str]
    # Taken without the group's agreement on merit (a rank was absent): never loaded
    # by another job attempt.
    provisional: bool
    # The size ranges the graph was guarded on (a range graph), "" for none: such a
    # graph is loaded only where Dynamo checks its guards.
    guarded_range: str = ""
    # For a range of a dynamic op's ladder: how the call site ran each size (a
    # SizePath's value) and the winners by size (range top, winner), as a graph loaded
    # from the cache reports them again.
    size_path: str = ""
    winners: tuple[tuple[float, str], ...] = ()


def environment(group: ProcessGroup, device: torch.device) -> Environment:
    """The environment of a measurement on ``device`` in ``group``."""
    import torch.distributed as dist

    common = Environment(
        group.size(), torch.__version__, str(dist.get_backend(group)), device.type
    )
    if device.type != "cuda":
        return common
    return dataclasses.replace(common, **_cuda_environment(device.index or 0))


def current_environment(
    group: ProcessGroup, made_in: Environment
) -> Environment | None:
    """The environment of ``group`` today on the kind of device of ``made_in``, or None
    where there is no such device."""
    if made_in.device != "cuda":
        return environment(group, torch.device(made_in.device))
    if not torch.cuda.is_available():
        return None
    return environment(group, torch.device("cuda", torch.cuda.current_device()))


def group_scope(group: ProcessGroup) -> str:
    """A digest of what every decision of ``group`` depends on, whatever its devices:
    the decisions a group keeps in the Store for the job are kept under it."""
    return digest(environment(group, torch.device("meta")).to_wire())


@functools.lru_cache(None)  # for the process: its devices and libraries stay
def _cuda_environment(index: int) -> dict[str, Any]:
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else ()
    return {
        "device_model": torch.cuda.get_device_name(index),
        "interconnect": _interconnect(index),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE", "") != "0"
        and os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "") != "1",
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    }


def _interconnect(index: int) -> str:
    """ "nvlink" when the device has an active NVLink, else "pcie" (NVML decides);
    "unknown" where NVML cannot tell (no pynvml, no driver): said, not guessed."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        log.debug("pynvml is not installed: device %d's interconnect is unknown", index)
        return "unknown"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as e:
        log.debug("NVML cannot tell device %d's interconnect: %s", index, e)
        return "unknown"
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                return "nvlink"
        except pynvml.NVMLError:  # past the device's last link
            break
    return "pcie"


class DecisionStore:
    """The decisions of this rank's cache dir."""

    def __init__(self, root: Path | None = None) -> None:
        if root is None:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            root = Path(cache_dir()) / "collective_autotuning" / "decisions"
        self.root = root

    def load(self, key: str, env: Environment) -> StoredDecision | None:
        """The decision stored for ``key`` in ``env``, or None (a miss, never an
        error)."""
        path = self._path(key, env)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.pop("format", None) != _FORMAT:
                log.debug("ignoring %s: written by another version", path)
                return None
            decision = StoredDecision.from_wire(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # MalformedMessageError is a ValueError
            log.debug("ignoring unreadable decision %s (%s)", path, e)
            return None
        if decision.key != key or decision.environment != env:
            log.debug("ignoring %s: written for another key or environment", path)
            return None
        return decision

    def save(self, decision: StoredDecision) -> None:
        """Write ``decision`` atomically; a failure to write is logged, not raised."""
        from torch._inductor.codecache import write_atomic

        path = self._path(decision.key, decision.environment)
        payload = {"format": _FORMAT, **decision.to_wire()}
        try:
            write_atomic(str(path), json.dumps(payload, sort_keys=True), make_dirs=True)
        except OSError as e:
            log.warning(
                "could not store the collective autotuning decision %s: %s", path, e
            )

    def _path(self, key: str, env: Environment) -> Path:
        return self.root / f"{digest(key, env.to_wire())}.json"


def digest(*parts: Any) -> str:
    """A short name for ``parts`` (JSON-able data), the same on every rank."""
    return hashlib.blake2b(
        json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=12
    ).hexdigest()
