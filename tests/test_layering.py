"""DESIGN.md's one-way layering, checked on the imports in the source."""

import ast
from pathlib import Path

import distflow

ROOT = Path(distflow.__file__).parent
ORDER = ["algos", "data", "coordinator", "dag", "engines", "runtime", "trainer"]
# what each layer may import besides itself and distflow.config
ALLOWED = {
    "algos": set(),
    "data": set(),
    "coordinator": {"data"},
    "dag": {"data", "coordinator"},
    "engines": {"algos", "data"},
    "runtime": {"algos", "data", "coordinator", "dag", "engines"},
    "trainer": set(ORDER),
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distflow."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("distflow.")}
    return found


def test_layers_only_import_downwards():
    violations = []
    for layer, allowed in ALLOWED.items():
        for path in (ROOT / layer).rglob("*.py"):
            bad = _imports(path) - allowed - {layer, "config", "plugins"}
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, violations


def test_algos_is_pure_torch():
    for path in (ROOT / "algos").rglob("*.py"):
        assert _imports(path) == set(), path


def test_config_and_plugins_are_leaves():
    assert _imports(ROOT / "config.py") == set()
    assert _imports(ROOT / "plugins.py") == set()
