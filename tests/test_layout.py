"""The package layout's rules, checked on the source (docs/explanation/architecture.md states them).

- every module imports on its own, in a fresh interpreter, whatever was imported before it;
- no module imports another module's private (underscore) names;
- the layers of pyproject.toml's import-linter contract hold (also run by .ci/run);
- a function longer than ~80 lines says why in its docstring ("Long because ...").
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_FUNCTION_LINES = 80


def _modules() -> list[tuple[str, Path]]:
    out = []
    for p in sorted((SRC / "bigtune").rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != "bigtune.__main__":  # runs the CLI when imported
            out.append((name, p))
    return out


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    # One interpreter, but bigtune's modules are dropped from sys.modules before each import, so each
    # module is imported first, as a user's script would: an import cycle or a missing import shows.
    names = [n for n, _ in _modules()]
    code = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    for m in [m for m in sys.modules if m == 'bigtune' or m.startswith('bigtune.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "", res.stdout
    assert len(names) > 50  # the whole package was walked


def test_no_module_imports_another_modules_private_names():
    bad = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bigtune"):
                if node.module == name:
                    continue
                bad += [
                    f"{name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not bad, "make these public (and documented) or keep them in their module:\n" + "\n".join(bad)


def test_layers_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install import-linter); .ci/run installs and runs it")
    res = subprocess.run([exe], capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "broken" in res.stdout and "0 broken" in res.stdout


def test_a_long_function_says_why():
    bad = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_FUNCTION_LINES and "Long because" not in doc:
                    bad.append(f"{name}.{node.name}: {lines} lines")
    assert not bad, "split these, or say in the docstring why they stay whole ('Long because ...'):\n" + "\n".join(bad)
