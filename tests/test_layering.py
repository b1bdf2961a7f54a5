"""DESIGN.md's one-way layering, checked on the source text: imports, and also any
other mention of a module path (a `module:function` string, importlib, a docstring
example), so a lower layer cannot load a higher one through a string."""

import ast
import re
from pathlib import Path

import distflow

ROOT = Path(distflow.__file__).parent
ORDER = ["algos", "data", "coordinator", "dag", "engines", "runtime", "trainer"]
LEAVES = {"config", "plugins", "collectives"}  # modules every layer may use; they import no distflow module
# what each layer may name besides itself and the leaves
ALLOWED = {
    "algos": set(),
    "data": set(),
    "coordinator": {"data"},
    "dag": {"data", "coordinator"},
    "engines": {"algos", "data"},
    "runtime": {"algos", "data", "coordinator", "dag", "engines"},
    "trainer": set(ORDER),
}
_PACKAGES = "|".join(ORDER + ["cli", "benchmarks", "train"])
_MENTION = re.compile(rf"\bdistflow[./]({_PACKAGES})\b")


def _named(path: Path) -> set[str]:
    """Every distflow package the file names, in code or in text."""
    return set(_MENTION.findall(path.read_text()))


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distflow."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("distflow.")}
    return found


def test_layers_only_name_layers_below():
    violations = []
    for layer, allowed in ALLOWED.items():
        for path in (ROOT / layer).rglob("*.py"):
            bad = (_imports(path) | _named(path)) - allowed - {layer} - LEAVES
            if bad:
                violations.append(f"{path.relative_to(ROOT)} names {sorted(bad)}")
    assert not violations, violations


def test_a_string_naming_a_higher_layer_is_caught(tmp_path):
    """The check itself: a dynamic import by string is found, not only `import`."""
    sneaky = tmp_path / "x.py"
    sneaky.write_text('_IMPL = "distflow.trainer.nodes:"\nimportlib.import_module("distflow.runtime.cli")\n')
    assert _named(sneaky) == {"trainer", "runtime"} and _imports(sneaky) == set()


def test_algos_is_pure_torch():
    for path in (ROOT / "algos").rglob("*.py"):
        assert _imports(path) <= {"algos"}, path
        assert "torch.distributed" not in path.read_text(), path


def test_leaves_import_no_distflow_module():
    for leaf in LEAVES:
        assert _imports(ROOT / f"{leaf}.py") == set(), leaf
