"""Importing the job's user code: its strategy file, the one piece of user code every part of a
job runs, and callables named by import path (cost models, mixture schedules).

The planner compiles the strategy from it; loaders and constructors take their hooks
(`loader_do_plan`, `constructor_do_plan`) from it by the names the planner publishes in
JobInfo. The file's sha256 is part of the job's fingerprint, so every part runs the same code.
"""

from __future__ import annotations

import hashlib
import importlib
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


def import_callable(path: str) -> Callable:
    """Imports the callable named by "package.module:attribute[.attribute...]".

    Raises:
        ImportError: the path is not of that form, the module cannot be imported (whatever it
            raised), an attribute is missing or the object is not callable; the message says which.
    """
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ImportError(f"{path!r} is not an import path 'package.module:callable'")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code
        raise ImportError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ImportError(f"{module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(obj):
        raise ImportError(f"{attr_path!r} in {module_name!r} is not callable ({type(obj).__name__})")
    return obj
