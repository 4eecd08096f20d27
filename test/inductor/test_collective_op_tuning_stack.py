# Owner(s): ["module: inductor"]
"""STACK.md orders the work as PRs upstream could land one after another. Every
module, test file and patch belongs to exactly one PR, and nothing imports from a
later one: a module's imports, a test's imports (of modules and of test helpers) and
the modules a patch's added lines call.

Reads the sources only: no torch compile, no ranks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_collective_op_tuning_layering import _imported, import_graph

from torch.testing._internal.common_utils import run_tests, TestCase


REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "STACK.md"
# The PRs' sections ("## 1. ...") and the lines of each that list its parts.
_SECTION = re.compile(r"^## (\d+)\. ", re.MULTILINE)
_OUTSIDE = "## Outside the stack"
_PARTS = re.compile(r"^- (code|tests|patches): (.*)$", re.MULTILINE)
# Modules a patch's added lines import or call.
_PATCH_MODULE = re.compile(
    r"torch\._inductor\.(kernel\.collective\.\w+|runtime\.collective_\w+)"
)
# What a patch's added lines take from hooks: imported names, and hooks.<name>(...).
_HOOKS_IMPORT = re.compile(
    r"kernel\.collective\.hooks import (\([^)]*\)|\w+)", re.MULTILINE
)
_HOOKS_CALL = re.compile(r"\bhooks\.(\w+)\(")
OUTSIDE = 10**6  # the rank of "outside the stack": after every PR


def read_stack(text: str) -> dict[str, dict[str, int]]:
    """{"code" | "tests" | "patches": {path or patch number: PR}} from STACK.md; a
    part listed twice raises."""
    stack: dict[str, dict[str, int]] = {"code": {}, "tests": {}, "patches": {}}
    starts = [(int(m.group(1)), m.start()) for m in _SECTION.finditer(text)]
    outside = text.find(_OUTSIDE)
    if outside >= 0:
        starts.append((OUTSIDE, outside))
    starts.sort(key=lambda s: s[1])
    for (pr, start), (_, end) in zip(starts, [*starts[1:], (0, len(text))]):
        for kind, listed in _PARTS.findall(text[start:end]):
            names = (
                re.findall(r"\d{4}", listed)
                if kind == "patches"
                else re.findall(r"`([^`]+)`", listed)
            )
            for name in names:
                if name in stack[kind]:
                    raise AssertionError(f"{name} is listed twice in STACK.md")
                stack[kind][name] = pr
    return stack


def _module_path(module: str) -> str:
    """The repository path of ``module``'s source ("" where it is no module of ours:
    ``from module import name`` names both)."""
    for path in (
        f"{module.replace('.', '/')}.py",
        f"{module.replace('.', '/')}/__init__.py",
    ):
        if (REPO / path).is_file():
            return path
    return ""


def _code_files() -> set[str]:
    folder = REPO / "torch/_inductor/kernel/collective"
    return (
        {str(p.relative_to(REPO)) for p in folder.glob("*.py")}
        | {
            str(p.relative_to(REPO))
            for p in (REPO / "torch/_inductor/runtime").glob("collective_*.py")
        }
        | {"torch/distributed/_store_session.py"}
    )


def _test_files() -> set[str]:
    return {str(p.relative_to(REPO)) for p in (REPO / "test").rglob("*.py")}


def _patch_numbers() -> set[str]:
    return {p.name[:4] for p in (REPO / "patches/series").glob("*.patch")}


def later_imports(
    code: dict[str, int], graph: dict[str, set[str]]
) -> list[tuple[str, str]]:
    """(module, imported) for each import of a module of a later PR than the
    importer's, by the PRs of ``code`` ({path: PR})."""
    return [
        (module, imported)
        for module, imports in graph.items()
        for imported in imports
        if code[_module_path(imported)] > code[_module_path(module)]
    ]


def _test_imports(path: Path, helpers: dict[str, str]) -> set[str]:
    """The repository files (code modules and test helpers) a test file imports."""
    module = "test." + str(path.relative_to(REPO / "test")).replace("/", ".")[:-3]
    imported = _imported(module, ast.parse(path.read_text(), str(path)))
    code = _code_files()
    files = {helpers[name] for name in imported if name in helpers}
    return files | ({_module_path(name) for name in imported} & code)


class TestStack(TestCase):
    def setUp(self):
        self.stack = read_stack(STACK.read_text())

    def test_every_module_test_and_patch_is_in_one_pr(self):
        for kind, found in (
            ("code", _code_files()),
            ("tests", _test_files()),
            ("patches", _patch_numbers()),
        ):
            listed = set(self.stack[kind])
            self.assertEqual(sorted(found - listed), [], msg=f"{kind} not in STACK.md")
            self.assertEqual(
                sorted(listed - found), [], msg=f"{kind} in STACK.md that do not exist"
            )

    def test_no_module_imports_from_a_later_pr(self):
        self.assertEqual(later_imports(self.stack["code"], import_graph()), [])

    def test_no_test_imports_from_a_later_pr(self):
        pr_of = {**self.stack["code"], **self.stack["tests"]}
        helpers = {
            Path(path).stem: path
            for path in self.stack["tests"]
            if path.startswith("test/inductor/")
        }
        later = [
            (test, imported)
            for test, pr in self.stack["tests"].items()
            for imported in _test_imports(REPO / test, helpers)
            if pr_of[imported] > pr
        ]
        self.assertEqual(later, [])

    def test_no_patch_calls_a_later_pr(self):
        code = self.stack["code"]
        later = []
        for number, pr in self.stack["patches"].items():
            for patch in (REPO / "patches/series").glob(f"{number}-*.patch"):
                added = "\n".join(
                    line for line in patch.read_text().splitlines() if line[:1] == "+"
                )
                for module in set(_PATCH_MODULE.findall(added)):
                    if code[_module_path(f"torch._inductor.{module}")] > pr:
                        later.append((patch.name, module))
        self.assertEqual(later, [])

    def test_hooks_exports_only_what_upstream_calls(self):
        """Upstream's patched files import ``hooks`` alone; users and engines read
        ``api``. hooks.__all__ is exactly what the patches import or call."""
        hooks = REPO / "torch/_inductor/kernel/collective/hooks.py"
        exported = next(
            ast.literal_eval(node.value)
            for node in ast.parse(hooks.read_text()).body
            if isinstance(node, ast.Assign)
            and any(getattr(t, "id", None) == "__all__" for t in node.targets)
        )
        called = set()
        for patch in (REPO / "patches/series").glob("*.patch"):
            added = "\n".join(
                line[1:] for line in patch.read_text().splitlines() if line[:1] == "+"
            )
            for names in _HOOKS_IMPORT.findall(added):
                called.update(re.findall(r"\w+", names))
            called.update(_HOOKS_CALL.findall(added))
        self.assertEqual(sorted(exported), sorted(called))

    def test_a_later_import_is_found(self):
        hooks = "torch._inductor.kernel.collective.hooks"
        detection = "torch._inductor.kernel.collective.detection"
        stack = read_stack(
            f"## 1. a\n- code: `{_module_path(hooks)}`\n"
            f"## 2. b\n- code: `{_module_path(detection)}`\n"
        )
        self.assertEqual(
            later_imports(stack["code"], {hooks: {detection}, detection: set()}),
            [(hooks, detection)],
        )

    def test_a_part_listed_twice_is_refused(self):
        with self.assertRaisesRegex(AssertionError, "listed twice"):
            read_stack("## 1. a\n- patches: 0001\n## 2. b\n- patches: 0001\n")


if __name__ == "__main__":
    run_tests()
