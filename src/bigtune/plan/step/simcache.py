"""Simulated steps kept on disk: a second plan of the same step reads the first one's result.

A simulation (simulate.simulate) is a pure function of the recipe, the model config, the cut depths, the
target's kernels and the code that runs, so its result is stored under a key made of all of them:
bigtune's own source files, the versions of the libraries whose code the fake step runs (torch,
transformers, peft, bitsandbytes, torchao), and, for a model read from a local folder, that folder's
files. Any change to one of them is a different key; nothing is ever invalidated by hand.

Stored as JSON (tagged tuples and non-string keys), never pickle: a cache file is data, not code. Written
under a temporary name and renamed, so a reader sees a whole file or none, and several processes (the
alternatives' workers, a test suite's workers) can share one folder.

On for the command line (``bigtune plan`` and everything that plans), off for library calls unless asked:
``BIGTUNE_SIM_CACHE`` is a folder, ``on`` (the default folder: ``$XDG_CACHE_HOME/bigtune/sims``, else
``~/.cache/bigtune/sims``) or ``off``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

ENV = "BIGTUNE_SIM_CACHE"
# Files kept before the oldest half is pruned (one is a few KB to a few hundred KB).
MAX_FILES = 4000
_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "torchao", "lightning")


def folder() -> Optional[Path]:
    """The cache folder, or None when the cache is off."""
    value = os.environ.get(ENV, "").strip()
    if not value or value.lower() in ("off", "0", "false", "no"):
        return None
    if value.lower() in ("on", "1", "true", "yes"):
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "bigtune" / "sims"
    return Path(value)


def package_root() -> Path:
    """The bigtune package folder (this file is bigtune/plan/step/simcache.py)."""
    return Path(__file__).resolve().parents[2]


def source_files() -> list[Path]:
    """Every module of the bigtune package (the engine's step runs in the simulation, not only the planner)."""
    return sorted(package_root().rglob("*.py"))


@lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of bigtune's own source and of the versions of the libraries the simulated step runs."""
    h = hashlib.sha256()
    root = package_root()
    for path in source_files():
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    for name in _LIBRARIES:
        try:
            h.update(f"{name}={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=absent".encode())
    return h.hexdigest()


def _folder_fingerprint(path: str) -> list:
    """(name, size, mtime) of a local model folder's files: its processor or tokenizer settings may change
    while its config does not."""
    p = Path(path)
    if not p.is_dir():
        return []
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir() if f.is_file())


def key(recipe, config, **inputs: Any) -> str:
    """The cache key of one simulation: every input it reads, the code included."""
    to_json = getattr(config, "to_json_string", None)
    parts = {
        "code": code_version(),
        "recipe": dataclasses.asdict(recipe),
        "config": to_json(use_diff=False) if to_json else repr(config),
        "folders": [_folder_fingerprint(x) for x in (recipe.model.name, recipe.model.tokenizer) if x],
        "inputs": encode(inputs),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data that decode() turns back into equal Python values (tuples stay tuples,
    dictionaries keep non-string keys, dataclasses come back as their class)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"simcache cannot store a {type(value).__name__}")


# Classes a cache file may name: decode() builds nothing else.
_ALLOWED = ("bigtune.plan.step.simulate:Sim", "bigtune.plan.step.quantized:NF4Base", "bigtune.plan.step.simulate:Stack")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {_hashable(decode(k)): decode(v) for k, v in value["__items__"]}
    if "__dataclass__" in value:
        name = value["__dataclass__"]
        if name not in _ALLOWED:
            raise ValueError(f"simcache: a cache file names {name}, which it never stores")
        module, qualname = name.split(":")
        import importlib

        cls = getattr(importlib.import_module(module), qualname)
        return cls(**{k: decode(v) for k, v in value["fields"].items()})
    return {k: decode(v) for k, v in value.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k


def cached(compute: Callable[[], Any], recipe, config, **inputs: Any) -> Any:
    """``compute()``, or its earlier result for the same inputs when the cache is on."""
    where = folder()
    if where is None:
        return compute()
    path = where / f"{key(recipe, config, **inputs)}.json"
    try:
        return decode(json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError):
        path.unlink(missing_ok=True)  # unreadable or from an older layout: simulate again
    result = compute()
    try:
        _store(where, path, encode(result))
    except (OSError, TypeError):
        pass  # a read-only or full disk costs the next plan its speed, never this plan its answer
    return result


def _store(where: Path, path: Path, data: Any) -> None:
    where.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=where, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)
    files = list(where.glob("*.json"))
    if len(files) > MAX_FILES:
        files.sort(key=lambda f: f.stat().st_mtime)
        for f in files[: len(files) // 2]:
            f.unlink(missing_ok=True)


def cached_by_inputs(ignore: tuple[str, ...] = ()):
    """Decorate ``fn(recipe, config, ...)`` so that its result comes from cached() under its bound arguments
    (those in ``ignore`` left out of the key); ``fn.__wrapped__`` still computes."""

    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            inputs = {k: v for k, v in bound.arguments.items() if k not in ignore}
            recipe, config = inputs.pop("recipe"), inputs.pop("config")
            return cached(lambda: fn(*args, **kwargs), recipe, config, **inputs)

        return wrapper

    return decorate
