"""Ladders: run one recipe under a list of changes, one process per rung, and keep every result.

The lab's method is to change one knob, run, write down time and memory, and repeat, including
the runs that are expected to run out of memory. A sweep file states that whole ladder::

    name: llm-single
    base: ../recipes/tinyllama-full.yaml     # relative to this file, or an inline recipe mapping
    common: {train.max_steps: 20}            # applied to every variant
    variants:
      - name: bf16-true
        overrides: {precision: bf16-true}
        expect: ok                           # optional: ok | oom
        note: halves parameters, gradients and optimizer state
        tiny: {model.name: tiny-blip2-t5}    # optional: this variant's own --tiny mapping (after tiny: below)
        tiny_note: a T5 rung maps to the T5 preset   # optional: says what --tiny changed and why
    grid:                                    # optional: the cartesian product, as named variants
      train.micro_batch_size: [1, 2, 4]
    tiny:                                    # optional: applied last with --tiny (CPU, minutes)
      model.name: tiny-llama
      accelerator: cpu

Every variant runs as ``python -m bigtune train BASE --set k=v ... --set output_dir=OUT/VARIANT`` in a
process of its own, so an out-of-memory or a crash is a recorded row and the sweep moves on. The
whole file is validated with the recipe schema before the first variant starts: an unknown key, a
wrong type or a bad value anywhere stops the sweep before anything runs. A variant that is well
formed but cannot run here (``check_combinations``: a library missing, a combination bigtune does not
support yet, a CUDA-only feature on a CPU) is not run and is recorded as ``refused`` with the reasons.

Resuming. Rows live in ``OUT/sweep.json``, one per variant, rewritten atomically after every change;
a variant is marked ``running`` (with its process id) before it starts. A finished variant (summary
ok or oom) is reused on the next run. The variant a killed sweep was running is started afresh: its
folder is removed, and if the killed sweep left its process group alive, that is killed first. A
variant's process dies with the sweep (Linux: PR_SET_PDEATHSIG), SIGTERM or Ctrl-C stop the
running variant and record it as ``interrupted``, and a lock file keeps two sweeps out of one folder.
"""

from __future__ import annotations

import ctypes
import difflib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml

from bigtune.recipe import RecipeError, load_recipe

TOP_KEYS = ("name", "description", "base", "common", "tiny", "variants", "grid", "timeout_s")

VARIANT_KEYS = ("name", "overrides", "expect", "note", "timeout_s", "tiny", "tiny_note")

EXPECTS = ("ok", "oom")

FINISHED = ("ok", "oom")  # a variant with one of these summaries is not run again without --rerun

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")

LOG_NAME = "sweep.log"

LOCK_NAME = ".sweep.lock"

GIB = 1024**3


class SweepError(ValueError):
    """A sweep file (or a sweep request) that cannot be run; one line per problem: where, what, fix."""

    def __init__(self, problems: list[str], source: str | Path | None = None, what: str = "invalid sweep file"):
        self.problems = list(problems)
        self.source = str(source) if source is not None else None
        where = f" {self.source}" if self.source else ""
        super().__init__(f"{what}{where}:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any]  # the variant's own overrides (dotted keys)
    expect: Optional[str] = None
    note: Optional[str] = None
    timeout_s: Optional[float] = None
    origin: str = ""  # where it was declared, e.g. "variants[2]" or "grid"
    tiny: dict[str, Any] = field(default_factory=dict)  # this variant's own --tiny overrides (after the sweep's)
    tiny_note: Optional[str] = None  # what --tiny changed for this variant, shown with its results


@dataclass
class Sweep:
    path: Path
    name: str
    description: Optional[str]
    base: Path | dict  # a recipe file (absolute) or an inline recipe mapping
    common: dict[str, Any]
    tiny: Optional[dict[str, Any]]
    variants: list[Variant]
    timeout_s: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)  # command-line --set, applied like `common`
    definition: dict = field(default_factory=dict)  # the file as parsed, for sweep.json

    def overrides_for(self, v: Variant, tiny: bool) -> dict[str, Any]:
        """common → --set → the variant's own → tiny → the variant's tiny (when asked). Later layers win."""
        out: dict[str, Any] = {}
        out.update(self.common)
        out.update(self.extra)
        out.update(v.overrides)
        if tiny and self.tiny:
            out.update(self.tiny)
        if tiny and self.tiny is not None:
            out.update(v.tiny)
        if "name" not in v.overrides:
            out.setdefault("name", v.name)
        return out

    def layer_of(self, v: Variant, key: str, tiny: bool) -> str:
        """Which part of the sweep file set ``key`` for variant ``v`` (for error messages)."""
        if tiny and key in v.tiny:
            return f"{v.origin}.tiny"
        if tiny and self.tiny and key in self.tiny:
            return "tiny"
        if key in v.overrides:
            return f"{v.origin}.overrides" if v.origin != "grid" else "grid"
        if key in self.extra:
            return "--set"
        if key in self.common:
            return "common"
        return "base"

    def base_label(self) -> str:
        return str(self.base) if isinstance(self.base, Path) else "inline base recipe"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"train": {"micro_batch_size": 2}} and {"train.micro_batch_size": 2} mean the same thing."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _mapping(value: Any, where: str, problems: list[str], fix: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(
            f"{where}: expected a mapping of dotted recipe keys to values, got {type(value).__name__} {value!r}; {fix}"
        )
        return {}
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        problems.append(f"{where}: keys must be text (dotted recipe keys), got {bad[0]!r}")
        return {}
    return _flatten(value)


def _slug(value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    text = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-.")
    return text or "x"


def expand_grid(grid: dict[str, list]) -> list[tuple[str, dict[str, Any]]]:
    """The cartesian product of ``grid`` as (name, overrides), first key varying slowest.

    Names join ``<last part of the key>-<value>`` with ``_``; the full dotted key is used where two keys
    share a last part.
    """
    keys = list(grid)
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    labels = [k if leaves.count(leaf) > 1 else leaf for k, leaf in zip(keys, leaves)]
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        name = "_".join(f"{_slug(label)}-{_slug(v)}" for label, v in zip(labels, combo))
        out.append((name, dict(zip(keys, combo))))
    return out


def _timeout(value: Any, where: str, problems: list[str]) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        problems.append(f"{where}: {value!r} is not a positive number of seconds; e.g. timeout_s: 1800")
        return None
    return float(value)


def read_sweep(path: str | Path, extra: dict[str, Any] | None = None) -> Sweep:
    """Parse a sweep file and check its shape (not yet the recipes: see ``validate``).

    Long because it checks every key of the file in order and collects every problem into one error
    (not the first one only), the way the recipe schema does.
    """
    path = Path(path)
    if not path.is_file():
        near = ""
        if path.parent.is_dir():
            close = difflib.get_close_matches(path.name, [p.name for p in path.parent.glob("*.y*ml")], n=1)
            near = f"; did you mean {path.parent / close[0]}?" if close else ""
        raise SweepError([f"{path} does not exist{near}"], path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise SweepError([f"{path}{line}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax"], path) from None
    if not isinstance(raw, dict):
        raise SweepError(["the top level must be a mapping with name, base and variants (or grid)"], path)
    problems: list[str] = []
    for key in raw:
        if key not in TOP_KEYS:
            close = difflib.get_close_matches(str(key), TOP_KEYS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(TOP_KEYS)}"
            problems.append(f"{key}: unknown top-level key; {hint}")

    name = raw.get("name")
    if name is None:
        name = path.stem
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        problems.append(f"name: {name!r} must be text usable as a folder name (letters, digits, . _ - = +)")
        name = path.stem

    base_raw = raw.get("base")
    base: Path | dict = {}
    if base_raw is None:
        problems.append("base: missing; give a recipe file (relative to the sweep file) or an inline recipe mapping")
    elif isinstance(base_raw, str):
        base = (path.parent / base_raw).resolve()
        if not base.is_file():
            problems.append(
                f"base: recipe file {base_raw} not found (looked for {base}); paths are relative to the sweep file"
            )
    elif isinstance(base_raw, dict):
        base = dict(base_raw)
    else:
        problems.append(f"base: expected a recipe path or mapping, got {type(base_raw).__name__}")

    common = _mapping(raw.get("common"), "common", problems, "e.g. common: {train.max_steps: 20}")
    tiny = None
    if "tiny" in raw:
        tiny = _mapping(raw.get("tiny"), "tiny", problems, "e.g. tiny: {model.name: tiny-llama, accelerator: cpu}")

    variants: list[Variant] = []
    vlist = raw.get("variants")
    if vlist is not None and not isinstance(vlist, list):
        problems.append("variants: expected a list of {name, overrides, expect, note} entries")
        vlist = []
    for i, item in enumerate(vlist or []):
        where = f"variants[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: expected a mapping with name and overrides, got {item!r}")
            continue
        for key in item:
            if key not in VARIANT_KEYS:
                close = difflib.get_close_matches(str(key), VARIANT_KEYS, n=1)
                hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(VARIANT_KEYS)}"
                problems.append(f"{where}.{key}: unknown variant key; {hint} (recipe keys go under overrides)")
        vname = item.get("name")
        if not isinstance(vname, str) or not SAFE_NAME.match(vname):
            problems.append(
                f"{where}.name: {vname!r} must be text usable as a folder name (letters, digits, . _ - = +)"
            )
            vname = f"variant-{i}"
        where = f"variants[{i}] ({vname})"
        overrides = _mapping(
            item.get("overrides"), f"{where}.overrides", problems, "e.g. overrides: {precision: bf16-true}"
        )
        expect = item.get("expect")
        if expect is not None and expect not in EXPECTS:
            problems.append(f"{where}.expect: {expect!r} is not allowed; use ok or oom (or leave it out)")
            expect = None
        note = item.get("note")
        if note is not None and not isinstance(note, str):
            note = str(note)
        vtiny = _mapping(item.get("tiny"), f"{where}.tiny", problems, "e.g. tiny: {model.name: tiny-blip2-t5}")
        if "tiny" in item and "tiny" not in raw:
            problems.append(
                f"{where}.tiny: the sweep has no top-level tiny: block; add one (it may be empty) so "
                "--tiny is allowed, or remove the variant's tiny:"
            )
        tiny_note = item.get("tiny_note")
        if tiny_note is not None and not isinstance(tiny_note, str):
            tiny_note = str(tiny_note)
        variants.append(
            Variant(
                vname,
                overrides,
                expect,
                note,
                _timeout(item.get("timeout_s"), f"{where}.timeout_s", problems),
                f"variants[{i}]",
                vtiny,
                tiny_note,
            )
        )

    grid = raw.get("grid")
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            problems.append(
                "grid: expected a mapping of dotted recipe keys to lists of values, e.g. "
                "grid: {train.micro_batch_size: [1, 2, 4]}"
            )
        else:
            bad = [k for k, v in grid.items() if not isinstance(v, list) or not v]
            for k in bad:
                problems.append(f"grid.{k}: expected a non-empty list of values, e.g. [1, 2, 4]")
            if not bad:
                for gname, over in expand_grid(grid):
                    variants.append(Variant(gname, over, origin="grid"))

    if vlist is None and grid is None:
        problems.append("variants: missing; give a list of variants and/or a grid")
    elif not variants and not problems:
        problems.append("variants: the sweep has no variants; add at least one")
    seen: dict[str, int] = {}
    for v in variants:
        seen[v.name] = seen.get(v.name, 0) + 1
        if "output_dir" in v.overrides:
            problems.append(
                f"{v.origin} ({v.name}).overrides.output_dir: set by the sweep (<out>/<variant>); "
                "remove it and use --out for the sweep folder"
            )
    for key in ("output_dir",):
        if key in common:
            problems.append(f"common.{key}: set by the sweep (<out>/<variant>); remove it and use --out")
    for n, count in seen.items():
        if count > 1:
            problems.append(f"variant name {n!r} is used {count} times; names must be unique (they name folders)")
    top_timeout = _timeout(raw.get("timeout_s"), "timeout_s", problems)
    if problems:
        raise SweepError(problems, path)
    return Sweep(
        path=path.resolve(),
        name=name,
        description=raw.get("description"),
        base=base,
        common=common,
        tiny=tiny,
        variants=variants,
        timeout_s=top_timeout,
        extra=dict(extra or {}),
        definition=raw,
    )


def validate(
    sweep: Sweep, tiny: bool = False, variants: Iterable[Variant] | None = None, out_dir: Path | None = None
) -> dict[str, list[str]]:
    """Build every variant's recipe exactly as its run will; raise one SweepError listing all problems.

    A problem shared by several variants (say, a typo in ``common``) is reported once, with the variants
    it affects. Only keys, types and values count here; a well-formed variant that ``check_combinations``
    refuses (cannot run on this machine or with this bigtune) is returned as ``{variant: [reasons]}``
    for the sweep to record instead of run.
    """
    from bigtune.recipe import check_combinations

    if tiny and sweep.tiny is None:
        raise SweepError(
            [
                "--tiny: this sweep has no tiny: block; add one (e.g. tiny: {model.name: tiny-llama, "
                "accelerator: cpu, train.max_steps: 3, train.max_epochs: null}) or run without --tiny"
            ],
            sweep.path,
        )
    grouped: dict[str, list[str]] = {}
    refused: dict[str, list[str]] = {}
    chosen = list(variants) if variants is not None else sweep.variants
    out = out_dir or Path("runs") / sweep.name
    for v in chosen:
        over = sweep.overrides_for(v, tiny)
        over["output_dir"] = str(out / v.name)
        try:
            recipe = load_recipe(sweep.base, over, check=False)
            reasons = check_combinations(recipe)
            if reasons:
                refused[v.name] = reasons
        except RecipeError as e:
            for p in e.problems:
                key = p.split(":", 1)[0].strip()
                layer = sweep.layer_of(v, key, tiny)
                line = p if layer == "base" else f"{p} (set in {layer})"
                grouped.setdefault(line, []).append(v.name)
    if grouped:
        lines = []
        for line, names in grouped.items():
            if len(names) == 1:
                who = f"variant {names[0]!r}"
            elif len(names) == len(chosen) and len(names) > 2:
                who = f"every variant ({len(names)})"
            else:
                who = "variants " + ", ".join(repr(n) for n in names)
            lines.append(f"{who}: {line}")
        mode = " (with --tiny)" if tiny else ""
        raise SweepError([f"recipe problems{mode}; nothing was run:"] + lines, sweep.path)
    return refused


def load_sweep(path: str | Path, tiny: bool = False, extra: dict[str, Any] | None = None) -> Sweep:
    """Read and fully validate a sweep file."""
    s = read_sweep(path, extra)
    validate(s, tiny)
    return s


def _yaml_value(value: Any) -> str:
    """Text for ``--set key=TEXT`` that the recipe loader parses back to exactly ``value``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    elif text.endswith("..."):
        text = text[:-3].rstrip()
    if yaml.safe_load(text) != value:
        raise SweepError([f"value {value!r} cannot be passed on the command line unchanged"])
    return text


def default_out_dir(sweep: Sweep, tiny: bool) -> Path:
    return Path("runs") / (sweep.name + ("-tiny" if tiny else ""))


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _capacity(summary: dict) -> Optional[int]:
    cap = ((summary.get("recipe") or {}).get("memory") or {}).get("cap_gib")
    if cap:
        return int(cap * GIB)
    return (summary.get("device") or {}).get("memory_bytes")


def row_from_summary(summary: dict) -> dict:
    """The fields of a run's summary.json that a ladder compares."""
    plan = summary.get("plan") or {}
    oom = summary.get("oom")
    row = {
        "status": summary.get("status"),
        "steps": summary.get("steps"),
        "peak_allocated_bytes": summary.get("peak_allocated_bytes"),
        "peak_reserved_bytes": summary.get("peak_reserved_bytes"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "step_time_s": summary.get("step_time_s"),
        "first_loss": summary.get("first_loss"),
        "final_loss": summary.get("final_loss"),
        "wall_seconds": summary.get("wall_seconds"),
        "oom": {k: oom.get(k) for k in ("phase", "step", "message")} if isinstance(oom, dict) else None,
        "error": summary.get("error"),
        "plan": {
            k: plan.get(k)
            for k in (
                "predicted_peak_allocated",
                "predicted_peak_total",
                "predicted_peak_allocated_like_for_like",
                "measured_peak_allocated",
                "peak_error_pct",
                "phases",
            )
        }
        if plan
        else None,
        "device": summary.get("device"),
        "capacity_bytes": _capacity(summary),
        "parameters": (summary.get("parameters") or {}).get("total"),
    }
    return row


def _read_summary(run_dir: Path) -> Optional[dict]:
    p = run_dir / "summary.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _kill(proc: subprocess.Popen) -> None:
    """Stop a variant's process and everything it started (its own session), politely first."""
    if proc.poll() is not None:
        return
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        proc.wait(timeout=10)
    except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        try:
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the bigtune that is running this sweep
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _fmt_bytes(n: Optional[float]) -> str:
    from bigtune.core.stepmath import human_bytes  # stepmath imports torch: keep `bigtune --help` fast

    return human_bytes(n)


def _one_line(row: dict) -> str:
    st = row["status"]
    bits = [st]
    if st == "oom" and row.get("oom"):
        bits.append(f"in {row['oom'].get('phase')} at step {row['oom'].get('step')}")
    if row.get("peak_allocated_bytes") is not None:
        bits.append(f"peak {_fmt_bytes(row['peak_allocated_bytes'])}")
    if row.get("tokens_per_s"):
        bits.append(f"{row['tokens_per_s']:,.0f} tok/s")
    if row.get("final_loss") is not None:
        bits.append(f"loss {row['final_loss']:.4f}")
    if st == "crashed":
        bits.append(f"exit code {row.get('exit_code')}")
    if st not in FINISHED and row.get("error"):
        bits.append(str(row["error"])[:200])
    if row.get("expect") and row.get("expect_met") is False:
        bits.append(f"UNEXPECTED (expected {row['expect']})")
    return ", ".join(bits)


class SweepStopped(BaseException):
    """SIGTERM reached the sweep: the running variant was stopped and recorded as interrupted."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by signal {signum}")


def _die_with_parent(parent: int) -> None:
    """In the variant's process, before exec: be killed when the sweep dies, even by SIGKILL (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the sweep died before prctl took effect
        os._exit(1)


def _lock(out: Path):
    """Hold ``out/.sweep.lock`` for the sweep's lifetime; the kernel drops it when the process dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    fh = (out / LOCK_NAME).open("a+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip()
        fh.close()
        raise SweepError(
            [
                f"another bigtune sweep{f' (pid {holder})' if holder else ''} is running in {out}; wait "
                "for it, stop it, or use a different --out"
            ],
            what="cannot run the sweep",
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def _alive_group(pgid: Optional[int]) -> bool:
    if not pgid or not hasattr(os, "killpg"):
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _reap_stale(row: dict) -> Optional[str]:
    """A row still marked running belongs to a sweep that died (we hold the lock): stop what it left."""
    pgid = row.get("pid")
    if _alive_group(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for _ in range(100):
            if not _alive_group(pgid):
                break
            time.sleep(0.05)
        return f"killed the leftover process group {pgid} of the interrupted sweep"
    return None


def run_sweep(
    path: str | Path,
    out_dir: str | Path | None = None,
    tiny: bool = False,
    rerun: bool = False,
    timeout_s: Optional[float] = None,
    only: Optional[list[str]] = None,
    extra: dict[str, Any] | None = None,
    quiet: bool = False,
) -> list[dict]:
    """Run every variant of the sweep at ``path`` (validated first); return one row per variant.

    Rows are also written to ``<out>/sweep.json`` after each change. A variant whose summary says ok
    or oom is reused unless ``rerun``. ``only`` restricts the run to the named variants (the others
    keep their earlier rows, if any). ``extra`` holds overrides applied to every variant (``--set``).
    A variant refused by the recipe checks is recorded with status ``refused`` and its reasons.
    """
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    sweep = read_sweep(path, extra)
    out = Path(out_dir) if out_dir is not None else default_out_dir(sweep, tiny)
    chosen = sweep.variants
    if only:
        names = [v.name for v in sweep.variants]
        unknown = [n for n in only if n not in names]
        if unknown:
            hints = []
            for n in unknown:
                close = difflib.get_close_matches(n, names, n=1)
                hints.append(f"--only {n}: no such variant" + (f"; did you mean {close[0]}?" if close else ""))
            raise SweepError(
                hints + [f"variants in this sweep: {', '.join(names)}"], sweep.path, what="cannot run the sweep"
            )
        chosen = [v for v in sweep.variants if v.name in only]
    refused = validate(sweep, tiny, out_dir=out.resolve())

    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    lock = _lock(out)
    previous_handler = None
    if hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread():

        def _on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
            raise SweepStopped(signum)

        previous_handler = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run_locked(sweep, path, out, chosen, refused, tiny, rerun, timeout_s, only, extra, say)
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        if lock is not None:
            lock.close()


@dataclass
class _SweepRun:
    """What the steps of one locked sweep share: its folder and options, its rows and sweep.json's document."""

    sweep: Sweep
    out: Path
    tiny: bool
    rerun: bool
    timeout_s: Optional[float]
    refused: dict[str, list[str]]
    say: Callable[..., None]
    base_file: Path
    doc: dict
    rows: list[dict] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def base_row(self, v: Variant) -> dict:
        """The fields every row of ``v`` starts from, whatever its status."""
        row = {
            "variant": v.name,
            "note": v.note,
            "expect": v.expect,
            "overrides": self.sweep.overrides_for(v, self.tiny),
            "run_dir": str(self.out / v.name),
        }
        if self.tiny and v.tiny_note:
            row["tiny_note"] = v.tiny_note
        return row

    def save(self) -> None:
        """Rewrite ``out/sweep.json`` atomically with the current rows."""
        self.doc["rows"] = self.rows
        self.doc["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        _atomic_json(self.out / "sweep.json", self.doc)


def _run_locked(
    sweep: Sweep,
    path,
    out: Path,
    chosen: list[Variant],
    refused: dict[str, list[str]],
    tiny: bool,
    rerun: bool,
    timeout_s: Optional[float],
    only,
    extra,
    say,
) -> list[dict]:
    """Run the ``chosen`` variants while holding the sweep's lock; return one row per variant."""
    base_file = _base_file(sweep, out)
    previous = _previous_rows(out / "sweep.json")
    command = _sweep_command(path, out, tiny, rerun, timeout_s, only, extra)
    doc = _sweep_doc(sweep, out, tiny, command)
    run = _SweepRun(sweep, out, tiny, rerun, timeout_s, refused, say, base_file, doc)
    for v in sweep.variants:
        run.rows.append(_starting_row(run, v, previous.get(v.name)))
    run.save()
    say(
        f"sweep {sweep.name}: {len(chosen)} of {len(sweep.variants)} variants, base {sweep.base_label()}"
        f"{' (tiny)' if tiny else ''}; results in {out}"
    )
    cannot = [v.name for v in chosen if v.name in refused]
    if cannot:
        say(f"{len(cannot)} variant(s) cannot run here and are recorded as refused: {', '.join(cannot)}")
    run.env = _child_env()
    parent = _track_sweep(run, chosen)
    finished = False
    try:
        for i, v in enumerate(chosen, 1):
            _run_variant(run, v, f"[{i}/{len(chosen)}]")
        finished = True
    finally:
        if parent is not None:
            from bigtune.engine.tracking.mlflow_backend import end_parent_run

            end_parent_run(parent[0], parent[1], run.rows, finished)
    return run.rows


def _track_sweep(run: _SweepRun, chosen: list[Variant]) -> Optional[tuple[Optional[str], str]]:
    """When the rungs are tracked (tracking.backends of the first rung's recipe): the ladder's name for them to
    group by (W&B group, MLflow tag) and, for MLflow, a run of the ladder itself that each rung's run nests
    under (passed down in the environment). Returns (MLflow URI, that run's id) to close it, or None."""
    if not chosen:
        return None
    try:
        first = load_recipe(run.base_file, run.sweep.overrides_for(chosen[0], run.tiny), check=False)
    except RecipeError:
        return None  # validate() has recorded the rung as refused
    if not first.tracking.backends:
        return None
    from bigtune.engine.tracking import DEFAULT_EXPERIMENT, MLFLOW_PARENT_ENV, SWEEP_ENV

    run.env[SWEEP_ENV] = run.sweep.name
    if "mlflow" not in first.tracking.backends:
        return None
    from bigtune.engine.tracking.mlflow_backend import start_parent_run, tracking_uri

    uri = tracking_uri(first.tracking.mlflow_uri)
    params = {"sweep": run.sweep.name, "variants": [v.name for v in chosen], "tiny": run.tiny}
    parent = start_parent_run(uri, first.tracking.experiment or DEFAULT_EXPERIMENT, run.sweep.name, params)
    if parent is None:
        return None
    run.env[MLFLOW_PARENT_ENV] = parent
    run.say(f"tracking: mlflow run {run.sweep.name} ({parent}) holds one nested run per variant")
    return uri, parent


def _base_file(sweep: Sweep, out: Path) -> Path:
    """The recipe file each variant's process trains from: the sweep's own, or its inline one written out."""
    if isinstance(sweep.base, Path):
        return sweep.base
    base_file = out / "base-recipe.yaml"
    base_file.write_text(yaml.safe_dump(sweep.base, sort_keys=False))
    return base_file


def _previous_rows(sweep_json: Path) -> dict[str, dict]:
    """An earlier sweep's rows in ``sweep_json``, by variant name; none when it is missing or unreadable."""
    if not sweep_json.is_file():
        return {}
    try:
        return {r["variant"]: r for r in json.loads(sweep_json.read_text()).get("rows", [])}
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return {}


def _sweep_command(path, out: Path, tiny: bool, rerun: bool, timeout_s: Optional[float], only, extra) -> list[str]:
    """The ``bigtune sweep`` command line that runs this sweep again (recorded in sweep.json)."""
    return (
        ["bigtune", "sweep", str(path)]
        + (["--tiny"] if tiny else [])
        + (["--rerun"] if rerun else [])
        + ["--out", str(out)]
        + (["--timeout", str(timeout_s)] if timeout_s else [])
        + (["--only", *only] if only else [])
        + [a for k, v in (extra or {}).items() for a in ("--set", f"{k}={_yaml_value(v)}")]
    )


def _sweep_doc(sweep: Sweep, out: Path, tiny: bool, command: list[str]) -> dict:
    """sweep.json's document, without rows yet: what was run, how, and each variant's changes."""
    return {
        "format": 1,
        "name": sweep.name,
        "description": sweep.description,
        "sweep_file": str(sweep.path),
        "base": sweep.base_label(),
        "tiny": tiny,
        "out_dir": str(out),
        "command": command,
        "python": sys.executable,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "definition": sweep.definition,
        "variants": [
            {
                "name": v.name,
                "overrides": sweep.overrides_for(v, tiny),
                "expect": v.expect,
                "note": v.note,
                **({"tiny_note": v.tiny_note} if tiny and v.tiny_note else {}),
            }
            for v in sweep.variants
        ],
        "rows": [],
    }


def _starting_row(run: _SweepRun, v: Variant, old: Optional[dict]) -> dict:
    """Variant ``v``'s row before this sweep runs anything, from its earlier row ``old`` and its folder."""
    summary = _read_summary(run.out / v.name)
    if old is not None and old.get("status") == "running":
        # The sweep that started it is gone (this one holds the lock): whatever it left is stale.
        reaped = _reap_stale(old)
        row = {
            **old,
            **run.base_row(v),
            "status": "interrupted",
            "error": "the sweep was stopped while this variant ran; it runs again from the start",
        }
        row.pop("pid", None)
        if reaped:
            run.say(f"{v.name}: {reaped}")
        return row
    if summary is not None and summary.get("status") in FINISHED:
        return _reused_row(run, v, summary)
    if old is not None:
        return {**old, **run.base_row(v)}
    return {**run.base_row(v), "status": "pending"}


def _reused_row(run: _SweepRun, v: Variant, summary: dict) -> dict:
    """The row of a variant whose finished run (``summary``) is kept rather than run again."""
    row = {**run.base_row(v), **row_from_summary(summary), "reused": True}
    row["expect_met"] = None if v.expect is None else row["status"] == v.expect
    return row


def _refused_row(run: _SweepRun, v: Variant, reasons: list[str]) -> dict:
    """The row of a variant the recipe checks refused: not run, with the reasons."""
    row = {
        **run.base_row(v),
        "status": "refused",
        "reasons": reasons,
        "error": "; ".join(reasons),
        "reused": False,
    }
    row["expect_met"] = None if v.expect is None else False
    return row


def _run_variant(run: _SweepRun, v: Variant, tag: str) -> None:
    """Reuse, refuse or run one chosen variant, and record its row; ``tag`` is its "[i/n]" for messages."""
    idx = next(j for j, r in enumerate(run.rows) if r["variant"] == v.name)
    run_dir = run.out / v.name
    prev = _read_summary(run_dir)
    if prev is not None and prev.get("status") in FINISHED and not run.rerun:
        run.rows[idx] = _reused_row(run, v, prev)
        run.say(f"{tag} {v.name}: already finished ({_one_line(run.rows[idx])}); --rerun runs it again")
        run.save()
        return
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an earlier attempt's leftovers; the engine would pick <variant>-2 otherwise
    if v.name in run.refused:
        reasons = run.refused[v.name]
        run.rows[idx] = _refused_row(run, v, reasons)
        run.save()
        run.say(f"{tag} {v.name}: refused, not run:\n    " + "\n    ".join(reasons))
        return
    args = _train_args(run, v, run_dir)
    limit = v.timeout_s or run.timeout_s or run.sweep.timeout_s
    live_log = run.out / f".{v.name}.running.log"
    run.say(f"{tag} {v.name}: running{f' (timeout {limit:.0f} s)' if limit else ''}; log: {live_log}")
    t0 = time.perf_counter()
    code, status_override = _run_child(run, idx, v, args, limit, live_log)
    wall = time.perf_counter() - t0
    _move_log(live_log, run_dir)
    row = _outcome_row(run, v, args, code, status_override, limit, wall)
    run.rows[idx] = row
    run.save()
    run.say(f"{tag} {v.name}: {_one_line(row)} ({wall:.1f} s)")
    if row["status"] not in FINISHED and row.get("log_tail"):
        run.say("    " + "\n    ".join(row["log_tail"].splitlines()[-5:]))


def _train_args(run: _SweepRun, v: Variant, run_dir: Path) -> list[str]:
    """The ``python -m bigtune train`` command line of variant ``v``, writing into ``run_dir``."""
    over = run.sweep.overrides_for(v, run.tiny)
    args = [sys.executable, "-m", "bigtune", "train", str(run.base_file)]
    for k, val in over.items():
        args += ["--set", f"{k}={_yaml_value(val)}"]
    args += ["--set", f"output_dir={_yaml_value(str(run_dir))}"]
    return args


def _run_child(
    run: _SweepRun, idx: int, v: Variant, args: list[str], limit: Optional[float], live_log: Path
) -> tuple[Optional[int], Optional[str]]:
    """Run variant ``v``'s process with its log in ``live_log``, for at most ``limit`` seconds.

    Returns the exit code and "timeout" when the limit killed it (else None). Its row says ``running``
    (with the process id) while it runs. An interruption (SIGTERM, Ctrl-C) stops the process, records
    the row as ``interrupted`` and is raised again.
    """
    status_override = None
    pre = None
    if sys.platform.startswith("linux"):
        me = os.getpid()
        pre = lambda: _die_with_parent(me)  # noqa: E731
    with live_log.open("w") as log:
        log.write("$ " + " ".join(_shell_quote(a) for a in args) + "\n")
        log.flush()
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=run.env,
            start_new_session=hasattr(os, "killpg"),
            preexec_fn=pre,
        )
        try:
            run.rows[idx] = {
                **run.base_row(v),
                "status": "running",
                "pid": proc.pid,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "log": str(live_log),
            }
            run.save()
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill(proc)
            code = proc.returncode
            status_override = "timeout"
            log.write(f"\nbigtune sweep: killed after {limit:.0f} s (timeout)\n")
        except BaseException as e:
            _kill(proc)
            _record_interrupted(run, idx, v, proc, log, live_log, e)
            raise
    return code, status_override


def _record_interrupted(
    run: _SweepRun, idx: int, v: Variant, proc: subprocess.Popen, log, live_log: Path, e: BaseException
) -> None:
    """Record variant ``v``, whose stopped process is ``proc``, as interrupted by ``e``; keep its log."""
    run_dir = run.out / v.name
    why = "SIGTERM" if isinstance(e, SweepStopped) else type(e).__name__
    log.write(f"\nbigtune sweep: interrupted ({why})\n")
    run.rows[idx] = {
        **run.base_row(v),
        "status": "interrupted",
        "exit_code": proc.returncode,
        "error": f"the sweep was stopped ({why}) while this variant ran; it runs again from "
        "the start on the next sweep",
        "log": str(run_dir / LOG_NAME),
    }
    log.close()
    _move_log(live_log, run_dir)
    run.save()


def _outcome_row(
    run: _SweepRun,
    v: Variant,
    args: list[str],
    code: Optional[int],
    status_override: Optional[str],
    limit: Optional[float],
    wall: float,
) -> dict:
    """Variant ``v``'s row once its process ended: its summary (if it wrote one), exit code and log."""
    run_dir = run.out / v.name
    summary = _read_summary(run_dir)
    row = run.base_row(v)
    if status_override is not None:
        row.update({"status": status_override, "timeout_s": limit})
        if summary is not None:
            row["partial_summary"] = row_from_summary(summary)
    elif summary is not None:
        row.update(row_from_summary(summary))
    else:
        row.update({"status": "crashed"})
    row.update(
        {
            "exit_code": code,
            "process_seconds": wall,
            "log": str(run_dir / LOG_NAME),
            "command": args,
            "reused": False,
        }
    )
    if row["status"] not in FINISHED:
        row["log_tail"] = _tail(run_dir / LOG_NAME)
        if not row.get("error"):
            row["error"] = _reason_from_log(row["log_tail"], row["status"], code, limit)
    row["expect_met"] = None if v.expect is None else row["status"] == v.expect
    return row


def _reason_from_log(tail: str, status: str, code: Optional[int], limit: Optional[float]) -> str:
    """One line saying why a variant did not finish: bigtune's own error line, else the last log line."""
    if status == "timeout":
        return f"killed after {limit:.0f} s (timeout)"
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("bigtune: error:") or "Error:" in ln:
            return ln
    return (lines[-1] if lines else f"exit code {code}, no output")[:500]


def _move_log(live_log: Path, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if live_log.exists():
        os.replace(live_log, run_dir / LOG_NAME)


def _shell_quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def format_rows(rows: list[dict]) -> str:
    """A compact fixed-width table of sweep rows (printed at the end of a sweep)."""
    head = f"{'variant':<28} {'status':<9} {'peak alloc':>11} {'tok/s':>10} {'step s':>8} {'loss':>8}  note"
    lines = [head]
    for r in rows:
        st = r.get("status", "?")
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        stp = f"{r['step_time_s']:.3f}" if r.get("step_time_s") else "-"
        loss = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else "-"
        extra = []
        if r.get("status") == "oom" and r.get("oom"):
            extra.append(f"OOM in {r['oom'].get('phase')} at step {r['oom'].get('step')}")
        if r.get("expect") and r.get("expect_met") is False:
            extra.append(f"UNEXPECTED: expected {r['expect']}")
        if r.get("status") not in FINISHED and r.get("error"):
            extra.append(str(r["error"])[:120])
        if r.get("reused"):
            extra.append("reused")
        lines.append(
            f"{r['variant'][:28]:<28} {st:<9} {_fmt_bytes(r.get('peak_allocated_bytes')):>11} {tps:>10} "
            f"{stp:>8} {loss:>8}  {'; '.join(extra)}"
        )
    return "\n".join(lines)


def plan_sweep(
    path: str | Path,
    gpu_name: str,
    tiny: bool = False,
    only: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    as_json: bool = False,
    data_lengths: bool = False,
) -> int:
    """Plan every variant on one catalog GPU (× the variant's devices) without running anything: the
    lab's question "which rungs will run out of memory?" answered before renting the GPU.
    ``data_lengths``: each variant at its data's own lengths (datalengths.py) instead of full rows."""
    import json

    from bigtune.core.gpus import find_gpu
    from bigtune.core.stepmath import human_bytes
    from bigtune.models.configs import resolve_config
    from bigtune.plan.base.target import Target, run_strategy
    from bigtune.plan.planner import plan

    gpu = find_gpu(gpu_name)
    sweep = load_sweep(path, tiny=tiny, extra=extra)
    chosen = [v for v in sweep.variants if not only or v.name in only]
    configs: dict[str, Any] = {}
    out = []
    for v in chosen:
        row: dict[str, Any] = {"variant": v.name, "note": v.note}
        try:
            r = load_recipe(sweep.base, {**sweep.overrides_for(v, tiny), "accelerator": "cpu"}, check=False)
            n = r.world_size
            strategy = run_strategy(r.strategy, n)
            if r.model.name not in configs:
                configs[r.model.name] = resolve_config(r)
            target = Target("cuda", gpu, n, strategy)
            if data_lengths:
                from bigtune.plan.search.lengths import plan_at_data_lengths

                p = plan_at_data_lengths(r, target, config=configs[r.model.name])
                p.variant = v.name
            else:
                p = plan(r, target, v.name, config=configs[r.model.name])
            row.update(p.to_dict())
        except Exception as e:  # noqa: BLE001 - one variant the planner cannot do must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
        if not as_json:
            if "error" in row:
                print(f"{v.name[:28]:<28} cannot plan: {row['error']}", flush=True)
            else:
                verdict = ("FITS" if row["fits"] else "OOM") + ("~" if row.get("tight") else "")
                step = f"{row['step_time_s']:.2f} s/step" if row.get("step_time_s") else "-"
                need = row.get("needed_total") or row["peak_total"]
                print(
                    f"{v.name[:28]:<28} {verdict:<5} needs {human_bytes(need):>11} of "
                    f"{human_bytes(row['capacity'])} on {n}× {gpu.key}  {step}",
                    flush=True,
                )
    if as_json:
        print(json.dumps({"sweep": sweep.name, "gpu": gpu.key, "plans": out}, indent=2))
    elif any(r.get("tight") for r in out):
        from bigtune.plan.base.constants import FIT_UNCERTAINTY

        print(
            f"(~: tight, the need is within {FIT_UNCERTAINTY:.0%} of the card of the FITS line, the planner's "
            "typical error: either verdict may turn)"
        )
    return 0 if all("error" not in r for r in out) else 1
