"""tools/overlay.py on fake torch installs: apply, remove, status.

Imports only pytest, the standard library and torch (for its version and location): the
other test modules import the overlay's own modules, which need it applied.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch


REPO = Path(__file__).resolve().parents[2]


def _fake_install(root: Path, version: str, pristine: Path) -> Path:
    """A torch package directory holding only the upstream files the overlay edits."""
    torch_dir = root / "site" / "torch"
    diff = (REPO / "patches" / f"torch-{version[:4]}.diff").read_text()
    for line in diff.splitlines():
        if line.startswith("+++ b/"):
            rel = line[len("+++ b/"):]
            (root / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pristine / rel, root / "site" / rel)
    (torch_dir / "version.py").write_text(f"__version__ = '{version}'\n")
    return torch_dir


def _overlay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "overlay.py"), *args], capture_output=True, text=True
    )


def _pristine_roots() -> list:
    roots = []
    shared = REPO.parent / "shared" / "upstream" / "torch-2.11.0"
    if shared.is_dir():
        roots.append(pytest.param("2.11.0", shared, id="2.11"))
    site = Path(torch.__file__).parent.parent
    state = Path(torch.__file__).parent / ".collective_autotuning_overlay" / "pristine"
    roots.append(pytest.param("2.13.0", state if state.is_dir() else site, id="2.13"))
    return roots


@pytest.mark.parametrize("version,pristine", _pristine_roots())
def test_overlay_round_trip_restores_pristine_files(tmp_path, version, pristine):
    torch_dir = _fake_install(tmp_path, version, pristine)
    before = {p: p.read_bytes() for p in torch_dir.rglob("*.py")}

    applied = _overlay("--torch-dir", str(torch_dir), "apply")
    assert applied.returncode == 0, applied.stderr
    manifest = json.loads((torch_dir / ".collective_autotuning_overlay" / "manifest.json").read_text())
    assert all(before[torch_dir.parent / rel] != (torch_dir.parent / rel).read_bytes() for rel in manifest["files"])
    for rel in manifest["links"]:
        assert (torch_dir.parent / rel).resolve() == REPO / rel
    assert "already applied" in _overlay("--torch-dir", str(torch_dir), "apply").stdout
    assert "DRIFT" not in _overlay("--torch-dir", str(torch_dir), "status").stdout

    removed = _overlay("--torch-dir", str(torch_dir), "remove")
    assert removed.returncode == 0, removed.stderr
    assert {p: p.read_bytes() for p in torch_dir.rglob("*.py")} == before
    assert not (torch_dir / ".collective_autotuning_overlay").exists()
    assert not any((torch_dir.parent / rel).exists() for rel in manifest["links"])


def test_overlay_refuses_unsupported_versions_and_changed_files(tmp_path):
    pristine = _pristine_roots()[-1].values[1]
    torch_dir = _fake_install(tmp_path, "2.13.0", pristine)
    (torch_dir / "version.py").write_text("__version__ = '2.12.1'\n")
    refused = _overlay("--torch-dir", str(torch_dir), "apply")
    assert refused.returncode == 2
    assert "2.12.1" in refused.stderr and "2.11.x, 2.13.x" in refused.stderr

    (torch_dir / "version.py").write_text("__version__ = '2.13.0'\n")
    config = torch_dir / "_inductor" / "config.py"
    changed = config.read_text().replace("collective_benchmark_timeout", "collective_benchmark_timeout_s")
    config.write_text(changed)
    before = {p: p.read_bytes() for p in torch_dir.rglob("*.py")}
    refused = _overlay("--torch-dir", str(torch_dir), "apply")
    assert refused.returncode == 2 and "does not apply" in refused.stderr
    assert {p: p.read_bytes() for p in torch_dir.rglob("*.py")} == before
    assert not (torch_dir / ".collective_autotuning_overlay").exists()
