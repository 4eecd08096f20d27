"""Collective autotuning decisions kept on disk, so that a restart need not re-tune.

Each decision is a small JSON file under :func:`decisions_dir`
named by a digest of its key and of the environment it was measured in. An unreadable
or foreign file is a miss, never an error. A group uses a decision from disk only when
every rank read the identical entry."""

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

# Bump when the meaning of a stored decision changes.
_FORMAT = 4


@dataclasses.dataclass(frozen=True)
class Environment(WireMessage):
    """What a measurement depends on beyond the op and its shapes."""

    group_size: int
    torch: str
    backend: str
    device: str
    device_model: str = ""
    # "nvlink", "pcie", or "unknown" where NVML cannot tell.
    interconnect: str = ""
    nvls: bool = False
    nccl: str = ""


@dataclasses.dataclass(frozen=True)
class StoredDecision(WireMessage):
    """One decision as kept on disk."""

    key: str
    environment: Environment
    winner: str
    # Slowest-rank microseconds per choice (medians, quartiles): the logs read them,
    # and a dynamic site's ranges follow from them.
    timings_us: dict[str, float]
    # The next job to meet the key re-times winner against runner-up.
    provisional: bool = False
    runner_up: str = ""
    confidence: str = ""
    low_us: dict[str, float] = dataclasses.field(default_factory=dict)
    high_us: dict[str, float] = dataclasses.field(default_factory=dict)

    def digest(self) -> str:
        """What ranks compare: equal digests mean the decision is taken the same way
        (its timings too: a dynamic site's ranges follow from them)."""
        return digest(
            self.key,
            self.environment.to_wire(),
            self.winner,
            self.timings_us,
            self.low_us,
            self.high_us,
            self.provisional,
            self.runner_up,
        )


@dataclasses.dataclass(frozen=True)
class InlinedDecision:
    """A decision that a compiled graph inlines, as its cache entry keeps it."""

    group_name: str
    plan: str
    key: str
    winner: str
    op: str
    environment: Environment
    # Code identity per implementation: a graph inlining since-changed code is a miss.
    code: dict[str, str]
    # Taken without the group's agreement (a rank was absent): never loaded again.
    provisional: bool
    # Size ranges the graph was guarded on; loaded only where Dynamo checks guards.
    guarded_range: str = ""
    # The call site's autotuning name (a dynamic site's probes share it).
    site: str = ""
    # A dynamic site's qualified op name, SizePath and (range top, winner) pairs.
    qualified_op: str = ""
    size_path: str = ""
    winners: tuple[tuple[float, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class KeptLadder(WireMessage):
    """A dynamic call site's ranges as its group decided them, kept beside the
    decisions so that an engine can read where winners change before it compiles."""

    key: str  # the call site's key, without a size
    op: str  # the op's qualified name, "ns::name"
    environment: Environment
    # Code identity per implementation: ranges of since-changed code are not read.
    code: dict[str, str]
    # Each range's last size, ascending (inf for the last), and the choice it runs.
    tops: tuple[float, ...]
    winners: tuple[str, ...]

    @property
    def split_points(self) -> list[int]:
        """The sizes after which the winner changes."""
        return [int(top) for top in self.tops[:-1]]


def environment(group: ProcessGroup, device: torch.device) -> Environment:
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
    """``group``'s environment on ``made_in``'s kind of device; None if it has none."""
    if made_in.device != "cuda":
        return environment(group, torch.device(made_in.device))
    if not torch.cuda.is_available():
        return None
    return environment(group, torch.device("cuda", torch.cuda.current_device()))


def group_scope(group: ProcessGroup) -> str:
    """A digest of what every decision of ``group`` depends on, whatever its devices."""
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


def decisions_dir() -> Path:
    """Where decisions are kept: ``collective_autotune_decisions_dir``, else under
    Inductor's default cache dir, not TORCHINDUCTOR_CACHE_DIR: an engine moves that per
    config (vLLM: a folder per config hash), and a decision outlives its config."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if config.collective_autotune_decisions_dir:
        return Path(config.collective_autotune_decisions_dir)
    return Path(default_cache_dir()) / "collective_autotuning" / "decisions"


class DecisionStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = decisions_dir() if root is None else root

    def load(self, key: str, env: Environment) -> StoredDecision | None:
        decision = self._read(self._path(key, env), StoredDecision)
        if decision is not None and (
            decision.key != key or decision.environment != env
        ):
            log.debug("ignoring a decision written for another key or environment")
            return None
        return decision

    def save(self, decision: StoredDecision) -> None:
        """Write ``decision`` atomically; a failure is logged, not raised."""
        self._write(self._path(decision.key, decision.environment), decision)

    def _read(self, path: Path, kind: type[Any]) -> Any:
        """The ``kind`` of message ``path`` holds; None for a missing, unreadable or
        foreign file, never an error."""
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.pop("format", None) != _FORMAT:
                log.debug("ignoring %s: written by another version", path)
                return None
            return kind.from_wire(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # MalformedMessageError is a ValueError
            log.debug("ignoring unreadable %s (%s)", path, e)
            return None

    def _write(self, path: Path, message: WireMessage) -> None:
        from torch._inductor.codecache import write_atomic

        payload = {"format": _FORMAT, **message.to_wire()}
        try:
            write_atomic(str(path), json.dumps(payload, sort_keys=True), make_dirs=True)
        except OSError as e:
            log.warning(
                "could not keep the collective autotuning decision %s: %s", path, e
            )

    def save_ladder(self, ladder: KeptLadder) -> None:
        """Keep ``ladder``'s ranges (replacing those of the same key and
        environment); a failure is logged, not raised."""
        self._write(self._ladder_path(ladder.key, ladder.environment), ladder)

    def ladders(self) -> list[KeptLadder]:
        """Every readable kept ladder, oldest first; unreadable files are skipped."""
        found = []
        for path in sorted(
            (self.root / "ladders").glob("*.json"), key=lambda p: p.stat().st_mtime
        ):
            ladder = self._read(path, KeptLadder)
            if ladder is not None:
                found.append(ladder)
        return found

    def _path(self, key: str, env: Environment) -> Path:
        return self.root / f"{digest(key, env.to_wire())}.json"

    def _ladder_path(self, key: str, env: Environment) -> Path:
        return self.root / "ladders" / f"{digest(key, env.to_wire())}.json"


def digest(*parts: Any) -> str:
    return hashlib.blake2b(
        json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=12
    ).hexdigest()
