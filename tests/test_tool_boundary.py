"""The tools stay on the library's public API.

``leangraph.cli``, the evidence scripts of ``benchmarks/`` and the ``examples/`` import only
public names of the public core modules (each name in its module's ``__all__``), never a
private name or an internal module such as ``leangraph.api``; and every script of
``benchmarks/`` imports on the CPU, so a rename in the bench breaks this test, not a GPU run.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "src" / "leangraph" / "cli"
PUBLIC_CORE = {"leangraph", "leangraph.order", "leangraph.schedules", "leangraph.progress",
               "leangraph.report", "leangraph.memory", "leangraph.integrations.pipelining",
               "leangraph.integrations.transformers", "leangraph.integrations.megatron",
               "leangraph.integrations.megatron_cpu"}
EXAMPLE_EXTRAS: set[str] = set()

TOOL_FILES = sorted(CLI.glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
EXAMPLE_FILES = sorted((ROOT / "examples").glob("*.py"))


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) of every leangraph import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = "leangraph.cli" if path.parent == CLI else ""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = f"{package}.{module}" if module else package
            if module.split(".")[0] == "leangraph":
                found.append((module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "leangraph"]
    return found


def _root_attributes(path: Path) -> set[str]:
    """Names read as ``leangraph.<name>`` in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "leangraph"}


def _allowed(module: str, extras: set[str]) -> bool:
    return module in PUBLIC_CORE | extras or module == "leangraph.cli" or (
        module.startswith("leangraph.cli.") and "._" not in module)


@pytest.mark.parametrize("path", TOOL_FILES + EXAMPLE_FILES, ids=lambda p: p.name)
def test_tools_import_only_public_names(path: Path) -> None:
    extras = EXAMPLE_EXTRAS if path in EXAMPLE_FILES else set()
    for module, names in _imports(path):
        assert _allowed(module, extras), f"{path.name} imports internal module {module}"
        public = set(getattr(importlib.import_module(module), "__all__", ()))
        for name in names:
            assert name in public, f"{path.name} imports {module}.{name}, not in its __all__"
    import leangraph

    for name in _root_attributes(path) - {"__version__"}:
        assert name in leangraph.__all__, f"{path.name} reads leangraph.{name}, not in __all__"


def test_the_boundary_check_sees_a_private_import(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("from leangraph.api import _check_arguments\nimport leangraph.graphed\n"
                      "import leangraph\nleangraph._version = 1\n")
    assert _imports(script) == [("leangraph.api", ["_check_arguments"]), ("leangraph.graphed", []),
                                ("leangraph", [])]
    assert _root_attributes(script) == {"_version"}
    assert not _allowed("leangraph.api", set()) and not _allowed("leangraph.graphed", set())


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("[!_]*.py")),
                         ids=lambda p: p.name)
def test_benchmark_scripts_import_on_the_cpu(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(path.parent))  # as `python3 benchmarks/x.py` runs them
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # defines, runs nothing: each script's work is in main()
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
