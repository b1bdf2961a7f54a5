"""Loading user code named in a config: `package.module:function` or `path/to/file.py:function`.

A leaf module (no distflow imports) so every layer can resolve the callables a config
names (reward functions, DAG nodes) with the same rules and the same one-line errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable


class PluginError(ValueError):
    """A callable named in a config that cannot be loaded; the message is one line."""


def load_callable(spec: str, what: str) -> Callable:
    """`what` names the config key in errors, e.g. "reward.custom_fn"."""
    target, name, path = _located(spec, what)
    if path is not None:
        module = _load_file(path, spec, what)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise PluginError(f"{what}={spec!r}: cannot import {target} ({e})") from None
        except Exception as e:  # the module is there but fails as it runs: one line, as a file's does
            raise PluginError(f"{what}={spec!r}: importing {target} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise PluginError(f"{what}={spec!r}: {target} has no function {name}")
    return fn


def check_callable(spec: str, what: str) -> None:
    """What `load_callable` checks before it runs any of the user's code: the form, and
    that the file or module is there (a launcher checks this; the workers import it)."""
    target, _, path = _located(spec, what)
    if path is None:
        try:
            found = importlib.util.find_spec(target) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            raise PluginError(f"{what}={spec!r}: cannot import {target} (no such module)")


def _located(spec: str, what: str) -> tuple[str, str, str | None]:
    """(module or file, function name, the file's absolute path or None for a module)."""
    target, _, name = str(spec).rpartition(":")
    if not target or not name:
        raise PluginError(f"{what}={spec!r}: expected module:function or path.py:function")
    if not target.endswith(".py"):
        return target, name, None
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.isfile(path):
        raise PluginError(f"{what}={spec!r}: no such file {path}")
    return target, name, path


def _load_file(path: str, spec: str, what: str):
    """A user's .py file as a module, executed once per process: a second load returns
    the same module, so its registrations (e.g. `@register_adv_est`) run once."""
    name = f"distflow_user_{abs(hash(path))}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # while it runs, as an import has it: a dataclass looks its module up there
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # nothing half-run stays registered, whatever stopped it
        sys.modules.pop(name, None)
        if not isinstance(e, Exception):  # Ctrl-C, SystemExit: as they are
            raise
        # the user's file fails to import: say which and why, in one line
        raise PluginError(f"{what}={spec!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    return module
