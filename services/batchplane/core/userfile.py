"""Importing the job's strategy file, the one piece of user code every part of a job runs.

The planner compiles the strategy from it; loaders and constructors take their hooks
(`loader_do_plan`, `constructor_do_plan`) from it by the names the planner publishes in
JobInfo. The file's sha256 is part of the job's fingerprint, so every part runs the same code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
import types
from collections.abc import Callable

from batchplane.core.config import JobSettings
from batchplane.core.errors import ConfigError


def import_file(path: pathlib.Path, *, setting: str | None) -> types.ModuleType:
    """Imports a Python file as a module of its own (named after the path, so two jobs' files
    never collide).

    Raises:
        ConfigError: field "strategy" when the file cannot be read or raises on import.
    """
    name = "batchplane_strategy_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"not a Python file: {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except Exception as exc:  # any failure in user code is a configuration error
        sys.modules.pop(name, None)
        raise ConfigError("strategy", f"cannot load {str(path)!r}: {type(exc).__name__}: {exc}", setting) from exc
    return module


def job_hook(job: JobSettings, kind: str, name: str) -> Callable | None:
    """The strategy file's function `name`, registered as hook `kind`; None for no name.

    Raises:
        ConfigError: field "strategy" when the job has no strategy file, the file cannot be
            imported, or it defines no callable `name` (a planner running another file).
    """
    if not name:
        return None
    if job.strategy is None:
        raise ConfigError("strategy", f"the planner names {kind} hook {name!r}, but this part's job has no strategy file", None)
    module = import_file(job.resolve(job.strategy), setting=job.strategy)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError("strategy", f"{kind} hook {name!r} is not a function of {job.strategy!r}", job.strategy)
    return fn
