"""The import directions of docs/ARCHITECTURE.md, "Layout": nothing imports `launch/`;
`models/`, `comm/` and `kernels/` import neither `executor/` nor `drafter/`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "executor": ("speculant.launch",),
    "drafter": ("speculant.launch",),
    "models": ("speculant.launch", "speculant.executor", "speculant.drafter"),
    "comm": ("speculant.launch", "speculant.executor", "speculant.drafter"),
    "kernels": ("speculant.launch", "speculant.executor", "speculant.drafter", "speculant.models"),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_import_directions(folder):
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).glob("*.py"))
        for name in imported_modules(path)
        if name.startswith(FORBIDDEN[folder])
    ]
    assert not bad, bad
