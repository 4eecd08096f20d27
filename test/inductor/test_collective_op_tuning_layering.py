# Owner(s): ["module: inductor"]
"""The collective modules import one way: no module imports, even inside a function,
one that imports it back (directly or through others).

A circle hides which module holds the shared vocabulary and which one builds on it.
Reads the sources only: no torch, no ranks.
"""

from __future__ import annotations

import ast
from pathlib import Path

from torch.testing._internal.common_utils import run_tests, TestCase


REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("torch._inductor.kernel.collective", "torch._inductor.runtime")
# Modules outside those packages: the generic Store session protocol, beside c10d.
MODULES = ("torch.distributed._store_session",)


def _modules() -> dict[str, Path]:
    """Each collective module's qualified name and source file."""
    found = {}
    for package in PACKAGES:
        folder = REPO.joinpath(*package.split("."))
        pattern = "collective_*.py" if package.endswith("runtime") else "[!_]*.py"
        for path in sorted(folder.glob(pattern)):
            found[f"{package}.{path.stem}"] = path
    for module in MODULES:
        found[module] = REPO.joinpath(*module.split(".")).with_suffix(".py")
    return found


def _imported(module: str, tree: ast.Module) -> set[str]:
    """The qualified names of every module that ``tree`` (the source of ``module``)
    imports anywhere in its body, functions and TYPE_CHECKING blocks included."""
    package = module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else ""
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            source = ".".join(part for part in (base, node.module or "") if part)
            names.add(source)
            # `from package import module`
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Each collective module and the collective modules it imports."""
    modules = _modules()
    return {
        name: _imported(name, ast.parse(path.read_text(), str(path)))
        & set(modules) - {name}
        for name, path in modules.items()
    }


def find_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in ``graph`` (its modules in order, the first again at the
    end), or [] where imports run one way."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str]:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return []
        path.append(name)
        for imported in sorted(graph[name]):
            circle = visit(imported)
            if circle:
                return circle
        path.pop()
        done.add(name)
        return []

    for name in sorted(graph):
        circle = visit(name)
        if circle:
            return circle
    return []


class TestCollectiveImportLayering(TestCase):
    def test_the_graph_is_read(self):
        graph = import_graph()
        glue = "torch._inductor.kernel.collective.hooks"
        self.assertIn("torch._inductor.kernel.collective.selection", graph[glue])
        self.assertIn(
            "torch._inductor.runtime.collective_protocol",
            graph["torch._inductor.runtime.collective_benchmarking"],
        )  # a relative import

    def test_the_store_session_protocol_imports_nothing_of_inductor(self):
        name = "torch.distributed._store_session"
        path = _modules()[name]
        imported = _imported(name, ast.parse(path.read_text(), str(path)))
        self.assertFalse(
            [m for m in imported if m.startswith("torch._inductor")], msg=imported
        )
        protocol = import_graph()["torch._inductor.runtime.collective_protocol"]
        self.assertIn(name, protocol)

    def test_inductors_collective_package_reaches_the_store_through_the_protocol(self):
        # The generic Store session is collective_protocol's to wrap: the package's
        # modules take its types and its helpers from there.
        modules = _modules()
        reaching = [
            name
            for name, path in modules.items()
            if name.startswith(PACKAGES[0])
            and any(
                m.startswith("torch.distributed._store_session")
                for m in _imported(name, ast.parse(path.read_text(), str(path)))
            )
        ]
        self.assertEqual(reaching, [])

    def test_collective_modules_import_one_way(self):
        self.assertEqual(find_circle(import_graph()), [])

    def test_a_circle_is_found(self):
        self.assertEqual(
            find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}),
            ["a", "b", "c", "a"],
        )


if __name__ == "__main__":
    run_tests()
