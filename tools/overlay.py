#!/usr/bin/env python3
"""Lay this repository's Inductor patch onto an installed torch, and take it off again.

    overlay.py [--python PY | --torch-dir DIR] apply|remove|status
    overlay.py edit VERSION PRISTINE_ROOT WORK_ROOT     (developers: see README)
    overlay.py refresh VERSION PRISTINE_ROOT WORK_ROOT

`apply` links every file under this repository's torch/ into the installed torch
(so edits take effect at once) and applies patches/torch-<minor>.diff to the upstream
files it edits, after checking that every hunk applies and before touching anything.
The pristine upstream files are kept beside the install and restored byte for byte by
`remove`. Both are idempotent; `status` says what is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
SUPPORTED = ("2.11", "2.13", "2.14")
STATE_DIR = ".collective_autotuning_overlay"


class OverlayError(Exception):
    pass


# -- unified diffs ----------------------------------------------------------------


@dataclasses.dataclass
class Hunk:
    old_start: int  # 1-based
    old: list[str]
    new: list[str]


@dataclasses.dataclass
class FilePatch:
    path: str  # relative to site-packages, e.g. torch/_inductor/config.py
    hunks: list[Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def parse_diff(text: str) -> list[FilePatch]:
    patches: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            patches.append(FilePatch(path.removeprefix("b/"), []))
            i += 2
            continue
        match = _HUNK.match(line)
        if match:
            hunk = Hunk(int(match.group(1)), [], [])
            old_count, new_count = (int(g) if g else 1 for g in match.group(2, 3))
            i += 1
            # The counts say where the hunk ends ("--- a/next" would read as a removal).
            while i < len(lines) and (
                len(hunk.old) < old_count or len(hunk.new) < new_count or lines[i][:1] == "\\"
            ):
                kind, body = lines[i][:1], lines[i][1:]
                if kind == "\\":  # "\ No newline at end of file" ends the line before
                    previous = lines[i - 1][:1]
                    if previous in (" ", "-"):
                        hunk.old[-1] = hunk.old[-1].rstrip("\n")
                    if previous in (" ", "+"):
                        hunk.new[-1] = hunk.new[-1].rstrip("\n")
                if kind in (" ", "-"):
                    hunk.old.append(body)
                if kind in (" ", "+"):
                    hunk.new.append(body)
                i += 1
            patches[-1].hunks.append(hunk)
            continue
        i += 1
    return patches


def patch_text(original: str, file_patch: FilePatch) -> str:
    """The patched text; raises OverlayError naming the first hunk that does not apply."""
    lines = original.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    for n, hunk in enumerate(file_patch.hunks, 1):
        at = hunk.old_start - 1 if hunk.old else hunk.old_start
        if lines[at : at + len(hunk.old)] != hunk.old:
            raise OverlayError(
                f"{file_patch.path}: hunk {n} (line {hunk.old_start}) does not apply: "
                "this file differs from the upstream file the patch was made against"
            )
        out.extend(lines[cursor:at])
        out.extend(hunk.new)
        cursor = at + len(hunk.old)
    out.extend(lines[cursor:])
    return "".join(out)


def make_diff(path: str, pristine: Path, edited: Path) -> str:
    result = subprocess.run(
        ["diff", "-u", "--label", f"a/{path}", "--label", f"b/{path}", str(pristine), str(edited)],
        capture_output=True,
        text=True,
    )
    if result.returncode > 1:
        raise OverlayError(result.stderr)
    return result.stdout


# -- the installed torch ----------------------------------------------------------


@dataclasses.dataclass
class Install:
    torch_dir: Path
    version: str

    @property
    def site(self) -> Path:
        return self.torch_dir.parent

    @property
    def minor(self) -> str:
        return ".".join(self.version.split("+")[0].split(".")[:2])

    @property
    def state_dir(self) -> Path:
        return self.torch_dir / STATE_DIR

    @property
    def manifest(self) -> Path:
        return self.state_dir / "manifest.json"


def locate(python: str | None, torch_dir: str | None) -> Install:
    if torch_dir is None:
        probe = (
            "import importlib.util as u; s = u.find_spec('torch'); "
            "print(s.submodule_search_locations[0] if s else '')"
        )
        found = subprocess.run(
            [python or sys.executable, "-c", probe], capture_output=True, text=True
        ).stdout.strip()
        if not found:
            raise OverlayError(f"no torch is installed for {python or sys.executable}")
        torch_dir = found
    root = Path(torch_dir).resolve()
    version_file = root / "version.py"
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", version_file.read_text(), re.M)
    if not match:
        raise OverlayError(f"cannot read the torch version from {version_file}")
    return Install(root, match.group(1))


def check_supported(install: Install) -> None:
    if install.minor not in SUPPORTED:
        raise OverlayError(
            f"torch {install.version} at {install.torch_dir} is not supported by the "
            f"collective autotuning overlay; supported: "
            + ", ".join(f"{v}.x" for v in SUPPORTED)
        )


def our_files() -> list[str]:
    """Files of this repository that are new in torch, relative to site-packages."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "torch").rglob("*.py")
        if "__pycache__" not in p.parts
    )


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _diff_for(minor: str) -> tuple[str, list[FilePatch]]:
    text = (PATCHES / f"torch-{minor}.diff").read_text()
    return text, parse_diff(text)


# -- commands ----------------------------------------------------------------------


def apply(install: Install) -> str:
    check_supported(install)
    diff_text, file_patches = _diff_for(install.minor)
    links = our_files()
    if install.manifest.exists():
        manifest = json.loads(install.manifest.read_text())
        if manifest["diff_sha"] == _sha(diff_text.encode()) and manifest["links"] == links and not _drift(install, manifest):
            return f"already applied to torch {install.version} at {install.torch_dir}"
        remove(install)
    # Check everything before touching anything.
    patched: dict[str, str] = {}
    for fp in file_patches:
        patched[fp.path] = patch_text((install.site / fp.path).read_text(), fp)
    for rel in links:
        target = install.site / rel
        if target.exists() and not target.is_symlink():
            raise OverlayError(
                f"{target} exists in the installed torch and is not ours; refusing to "
                "replace an upstream file"
            )
    pristine_root = install.state_dir / "pristine"
    files = {}
    for rel, text in patched.items():
        path = install.site / rel
        original = path.read_bytes()
        backup = pristine_root / rel
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_bytes(original)
        path.write_text(text)
        files[rel] = {"pristine": _sha(original), "patched": _sha(text.encode())}
    for rel in links:
        target = install.site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.symlink_to(REPO / rel)
    install.manifest.write_text(
        json.dumps(
            {
                "version": install.version,
                "repo": str(REPO),
                "diff_sha": _sha(diff_text.encode()),
                "files": files,
                "links": links,
            },
            indent=2,
        )
    )
    return (
        f"applied to torch {install.version} at {install.torch_dir}: patched "
        f"{len(files)} upstream files, linked {len(links)} new files"
    )


def remove(install: Install) -> str:
    if not install.manifest.exists():
        return f"not applied to torch {install.version} at {install.torch_dir}"
    manifest = json.loads(install.manifest.read_text())
    pristine_root = install.state_dir / "pristine"
    for rel, shas in manifest["files"].items():
        backup = (pristine_root / rel).read_bytes()
        if _sha(backup) != shas["pristine"]:
            raise OverlayError(f"the saved pristine copy of {rel} is damaged; not restoring")
        (install.site / rel).write_bytes(backup)
    for rel in manifest["links"]:
        target = install.site / rel
        if target.is_symlink():
            target.unlink()
    shutil.rmtree(install.state_dir)
    return f"removed from torch {install.version} at {install.torch_dir}; upstream files restored"


def _drift(install: Install, manifest: dict) -> list[str]:
    """What differs from what `apply` left."""
    problems = []
    for rel, shas in manifest["files"].items():
        if _sha((install.site / rel).read_bytes()) != shas["patched"]:
            problems.append(f"{rel} changed since the overlay patched it")
    for rel in manifest["links"]:
        target = install.site / rel
        if not (target.is_symlink() and target.resolve() == (Path(manifest["repo"]) / rel).resolve()):
            problems.append(f"{rel} is not linked to the repository")
    return problems


def status(install: Install) -> str:
    head = f"torch {install.version} at {install.torch_dir}"
    if install.minor not in SUPPORTED:
        return f"{head}: unsupported version (supported: {', '.join(v + '.x' for v in SUPPORTED)})"
    if not install.manifest.exists():
        return f"{head}: overlay not applied"
    manifest = json.loads(install.manifest.read_text())
    lines = [f"{head}: overlay applied from {manifest['repo']}"]
    lines += [f"  patched {rel}" for rel in manifest["files"]]
    lines += [f"  linked  {rel}" for rel in manifest["links"]]
    lines += [f"  DRIFT   {p}" for p in _drift(install, manifest)]
    if _sha((PATCHES / f"torch-{install.minor}.diff").read_bytes()) != manifest["diff_sha"]:
        lines.append("  STALE   the repository's diff changed since; run apply again")
    return "\n".join(lines)


def edit(minor: str, pristine_root: Path, work_root: Path) -> str:
    """Write the patched upstream files under WORK_ROOT, for editing by hand."""
    _, file_patches = _diff_for(minor)
    for fp in file_patches:
        dst = work_root / fp.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(patch_text((pristine_root / fp.path).read_text(), fp))
    return f"patched copies of {len(file_patches)} files written under {work_root}"


def refresh(minor: str, pristine_root: Path, work_root: Path) -> str:
    """Regenerate patches/torch-MINOR.diff from the edited files under WORK_ROOT."""
    edited = sorted(
        str(p.relative_to(work_root)) for p in work_root.rglob("*.py") if p.is_file()
    )
    text = "".join(make_diff(rel, pristine_root / rel, work_root / rel) for rel in edited)
    (PATCHES / f"torch-{minor}.diff").write_text(text)
    return f"patches/torch-{minor}.diff: {len(parse_diff(text))} files"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", help="the Python whose torch to patch (default: this one)")
    parser.add_argument("--torch-dir", help="the torch package directory to patch")
    parser.add_argument("command", choices=["apply", "remove", "status", "edit", "refresh"])
    parser.add_argument("args", nargs="*")
    opts = parser.parse_args(argv)
    try:
        if opts.command in ("edit", "refresh"):
            minor, pristine, work = opts.args
            fn = edit if opts.command == "edit" else refresh
            print(fn(minor, Path(pristine), Path(work)))
            return 0
        install = locate(opts.python, opts.torch_dir)
        print({"apply": apply, "remove": remove, "status": status}[opts.command](install))
        return 0
    except OverlayError as e:
        print(f"overlay: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
