"""Checkpoints (resumable, written atomically), resuming a run, and the trained model in Hugging Face format."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import torch

from bigtune.core.rundir import RunDir
from bigtune.engine.report import notice
from bigtune.engine.state import Built, LoopState, epoch_loss_mean
from bigtune.recipe import Recipe, RecipeError, load_recipe


def save_checkpoint(b: Built, run: RunDir, state: LoopState) -> Path:
    from bigtune.engine.strategies import is_deepspeed, is_sharded, save_sharded_trainable

    path = run.checkpoint_path(state.step)
    tmp = path.with_name(path.name + ".tmp")
    payload = {
        "model": b.model,
        "optimizer": b.optimizer,
        "scheduler": b.scheduler,
        "loop": {
            "step": state.step,
            "tokens": state.tokens,
            "samples": state.samples,
            "train_seconds": state.train_seconds,
            "losses": list(state.losses),
            "best_val_loss": state.best_val_loss,
            "best_score": state.best_score,
            # every rank takes part (a collective); the mean over ranks, which each rank resumes from
            "epoch_loss_sum": epoch_loss_mean(b.fabric, state) * state.epoch_loss_steps,
            "epoch_loss_steps": state.epoch_loss_steps,
            "epoch_losses": list(state.epoch_losses),
        },
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
    }
    trainable = {n for n, p in b.model.module.named_parameters() if p.requires_grad}
    # Adapter runs checkpoint only what trains: the frozen base is reloaded from its source on resume.
    only_trainable = {"model": lambda name, _: name in trainable} if b.recipe.peft.method != "none" else None
    if is_deepspeed(b.recipe):
        only_trainable = None  # DeepSpeed filters itself (exclude_frozen_parameters) and refuses a filter
    if only_trainable is not None and is_sharded(b.fabric):  # FSDP2 + adapters: Fabric cannot filter
        rest = {k: payload[k] for k in ("loop", "rng")} | {"scheduler": b.scheduler.state_dict()}
        save_sharded_trainable(b.fabric, tmp, b.model.module, b.optimizer.optimizer, rest)
    else:
        b.fabric.save(tmp, payload, filter=only_trainable)  # every rank takes part (FSDP writes shards)
    if b.fabric.global_rank == 0:
        os.replace(tmp, path)
    b.fabric.barrier()
    run.prune_checkpoints(b.recipe.checkpoint.keep_last)
    return path


def load_checkpoint(b: Built, path: Path, state: LoopState) -> None:
    from bigtune.engine.strategies import TRAINABLE_STATE_FILE, load_sharded_trainable

    payload = {"model": b.model, "optimizer": b.optimizer, "scheduler": b.scheduler}
    if (path / TRAINABLE_STATE_FILE).is_file():  # FSDP2 + adapters (save_sharded_trainable)
        rest = load_sharded_trainable(path, b.model.module, b.optimizer.optimizer)
        payload["scheduler"] = rest["scheduler"]
    else:
        rest = b.fabric.load(path, payload, strict=b.recipe.peft.method == "none", weights_only=True)
    # Fabric's sharded (FSDP2) load restores only the model and optimizer itself: anything else in
    # `payload` is replaced by its saved state dict and left for the caller. The scheduler (warmup
    # position) must then be restored here, or the lr restarts from step 0 one step after resume.
    if isinstance(payload["scheduler"], dict):
        b.scheduler.load_state_dict(payload["scheduler"])
    loop = rest["loop"]
    state.step, state.tokens, state.samples = loop["step"], loop["tokens"], loop["samples"]
    state.train_seconds, state.losses = loop["train_seconds"], list(loop["losses"])
    state.best_val_loss = loop.get("best_val_loss")
    state.best_score = loop.get("best_score", state.best_val_loss)
    # checkpoints written before the epoch loss was kept restart its average at the resumed step
    state.epoch_loss_sum, state.epoch_loss_steps = loop.get("epoch_loss_sum", 0.0), loop.get("epoch_loss_steps", 0)
    state.epoch_losses = list(loop.get("epoch_losses", []))
    torch.set_rng_state(rest["rng"]["torch"])
    random.setstate(_as_tuple(rest["rng"]["python"]))
    if rest["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rest["rng"]["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def find_resume_checkpoint(resume: str | Path) -> tuple[Path, Optional[Path]]:
    """(run dir, checkpoint) from a run dir (its newest checkpoint) or a checkpoint path; (run dir, None)
    for a run that stopped before its first optimizer step, which has nothing to continue and starts afresh."""
    p = Path(resume)
    if p.is_file() or p.suffix == ".ckpt":
        if not p.exists():
            raise FileNotFoundError(f"--resume: checkpoint {p} does not exist")
        return p.parent.parent, p
    if not p.is_dir():
        raise FileNotFoundError(f"--resume: {p} is neither a run directory nor a checkpoint")
    ckpts = RunDir(p).list_checkpoints()
    if not ckpts:
        saved = _saved_summary(p)
        if saved is not None and saved.get("steps") == 0:
            return p, None
        raise FileNotFoundError(f"--resume: {p} has no checkpoint to continue from: {_no_checkpoint_reason(saved)}")
    return p, ckpts[-1]


def _saved_summary(run_path: Path) -> Optional[dict]:
    try:
        return json.loads((run_path / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _no_checkpoint_reason(saved: Optional[dict]) -> str:
    """Why a run that did train some steps left no checkpoint, from its summary.json, and what to do."""
    if saved is None:
        return (
            "no summary.json either, so it was killed before it could write one (or is still running); "
            "start it again without --resume"
        )
    ckpt = saved.get("recipe", {}).get("checkpoint", {})
    ended = f"it ended ({saved.get('status')}) at step {saved.get('steps')}"
    if not ckpt.get("enabled"):
        return f"{ended} with checkpoint.enabled=false (set checkpoint.enabled=true and checkpoint.every_steps=N)"
    return f"{ended}, before its first checkpoint (checkpoint.every_steps={ckpt.get('every_steps')})"


# Keys that decide the shapes and meaning of what a checkpoint holds: a resumed run must keep them.
CHECKPOINT_KEYS = (
    "model.",
    "peft.",
    "precision",
    "strategy",
    "optim.name",
    "seed",
    "data.source",
    "data.format",
    "data.packing",
    "data.max_seq_length",
    "data.num_train_samples",
    "data.chat_template",
    "data.train_on",
)


def resume_recipe(run_path: Path, ckpt: Path, recipe, overrides) -> Recipe:
    """The recipe a resumed run continues with: the run's own recipe.yaml, with ``recipe`` (if given) and
    ``overrides`` on top. Raises RecipeError, naming the keys, when the result cannot continue that
    checkpoint: a changed model, adapter, precision, strategy, optimizer, seed or data, or a step limit
    the checkpoint has already reached."""
    saved_path = run_path / "recipe.yaml"
    if not saved_path.is_file():
        raise RecipeError([f"--resume {run_path}: no recipe.yaml in the run directory; it is not a bigtune run"])
    saved = load_recipe(saved_path)
    r = load_recipe(recipe if recipe is not None else saved_path, overrides)
    if recipe is not None:
        old, new = saved.to_dict(), r.to_dict()
        flat_old, flat_new = _flatten(old), _flatten(new)
        changed = sorted(
            k
            for k in set(flat_old) | set(flat_new)
            if k.startswith(CHECKPOINT_KEYS) and flat_old.get(k) != flat_new.get(k)
        )
        if changed:
            diffs = "; ".join(f"{k}: {flat_old.get(k)!r} in the run, {flat_new.get(k)!r} now" for k in changed[:8])
            raise RecipeError(
                [
                    f"--resume {run_path}: the recipe does not match the checkpoint ({diffs}). Resume with the "
                    f"run's own recipe (bigtune train --resume {run_path}, no recipe), or start a new run"
                ]
            )
    return r


def checkpoint_step(ckpt: Path) -> Optional[int]:
    """The optimizer step a checkpoint was written at, from its name (step-NNNNNN.ckpt)."""
    tail = ckpt.stem.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def resume_point(r: Recipe, b: Built, run_path: Path, ckpt: Path) -> Optional[dict]:
    """None to go on training; the run's saved summary when its checkpoint is already the last step.
    Raises RecipeError when the recipe's length ends before the checkpoint."""
    step = checkpoint_step(ckpt)
    if step is None or step < b.total_steps:
        return None
    more = f"--set train.max_steps=N with N > {step}"
    if step > b.total_steps:
        raise RecipeError(
            [
                f"--resume {run_path}: the recipe trains {b.total_steps} steps (train.max_steps="
                f"{r.train.max_steps}, train.max_epochs={r.train.max_epochs}) but the checkpoint {ckpt.name} is "
                f"at step {step}: nothing is left to train. To train longer: {more}"
            ]
        )
    notice(f"{run_path}: finished at step {step} of {b.total_steps}; nothing to resume. To train longer: {more}")
    saved = run_path / "summary.json"
    return json.loads(saved.read_text()) if saved.is_file() else {"status": "ok", "run_dir": str(run_path)}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def save_at_end(b: Built, run: RunDir, state: LoopState) -> None:
    """The last checkpoint (unless the last step already wrote one) and the Hugging Face folder."""
    r = b.recipe
    if r.checkpoint.enabled and (
        not run.list_checkpoints() or run.list_checkpoints()[-1] != run.checkpoint_path(state.step)
    ):
        save_checkpoint(b, run, state)
    if r.checkpoint.save_model:
        save_hf_model(b, run)


def save_hf_model(b: Built, run: RunDir, dest_name: Optional[str] = None, keep_base: bool = True) -> Path:
    """The trained model in Hugging Face format (safetensors), written atomically.

    Full fine-tuning: <run>/model. Adapters: <run>/adapter (peft format), plus <run>/base with the
    initial weights when the base has no folder of its own (presets, random init);
    `bigtune export --merge` folds them into one model.
    """
    from bigtune.engine.strategies import full_state_dict

    model = b.model.module if hasattr(b.model, "module") else b.model
    dest = run.path / (dest_name or ("adapter" if b.recipe.peft.method != "none" else "model"))
    # FSDP: every rank joins the gather; rank 0 gets it
    state = full_state_dict(b.fabric, model, trainable_only=b.recipe.peft.method != "none")
    if b.fabric.global_rank != 0:
        return dest
    tmp = run.path / f".{dest.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    if state is not None:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    b.tokenizer.save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    if keep_base and b.base_dir is not None and b.base_dir.exists():
        if (run.path / "base").exists():
            shutil.rmtree(run.path / "base")
        shutil.move(str(b.base_dir), run.path / "base")
    return dest
