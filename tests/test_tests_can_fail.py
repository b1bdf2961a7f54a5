"""Every test must be able to fail: a test function with no `assert`, no
`pytest.raises`/`pytest.fail`, and no call to a helper that asserts, passes whatever the
code does. This scan finds such functions (docs/TESTING.md says why and how to write
them); the allow-list names the few smoke tests whose only claim is "it runs"."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent
# test id -> why running it to the end is the whole claim
ALLOWED: dict[str, str] = {}
_CHECKS = ("raises", "fail", "warns", "approx")


def _checks(fn: ast.AST, asserting: set[str]) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _CHECKS or name in asserting or name.startswith(("assert", "check", "close")):
                return True
    return False


def _asserting_helpers(tree: ast.Module) -> set[str]:
    """Module-level functions (not tests) that assert: calling one counts as a check."""
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")
            and any(isinstance(x, ast.Assert) for x in ast.walk(n))}


def vacuous_tests(root: Path = TESTS) -> list[str]:
    found = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        helpers = _asserting_helpers(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                test_id = f"{path.relative_to(root)}::{node.name}"
                if not _checks(node, helpers) and test_id not in ALLOWED:
                    found.append(test_id)
    return found


def test_every_test_function_checks_something():
    assert vacuous_tests() == []


def test_the_scan_finds_a_test_without_a_check(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def helper(x):\n    assert x\n"
        "def test_runs_only():\n    sum([1, 2])\n"
        "def test_asserts():\n    assert 1\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_calls_helper():\n    helper(1)\n")
    assert vacuous_tests(tmp_path) == ["test_x.py::test_runs_only"]
