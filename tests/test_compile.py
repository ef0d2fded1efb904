"""train.compile: compiled blocks train like eager ones, measured CPU steps stay eager (and exact), and the
recipe refuses what it cannot do."""

from __future__ import annotations

import json

import pytest

from bigtune.engine import build as engine_build  # where the model is built and its blocks compiled
from bigtune.engine import loop as engine
from bigtune.recipe import RecipeError, load_recipe
from bigtune.run.training import train
from conftest import read_jsonl, run_cli, tiny_overrides


def test_compiled_blocks_train_like_eager_and_measured_steps_run_eager(tmp_path, monkeypatch):
    # fp32, no dropout in the tiny Llama: compiled and eager steps compute the same thing up to kernel
    # rounding. Every record is truncated to max_seq_length, so every batch has one shape: one compile.
    # Steps 0, 1 and 3 are measured (memory.every_steps=3); 2 and 4 must run compiled.
    seen: list[str] = []  # per forward: what produced the last block's output

    def compile_and_watch(model):
        blocks = real_compile(model)
        norm = model.get_decoder().norm  # after the last block, outside any compiled code
        norm.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0].grad_fn).__name__))
        return blocks

    real_compile = engine_build.compile_blocks
    monkeypatch.setattr(engine_build, "compile_blocks", compile_and_watch)
    source = tmp_path / "long.jsonl"
    source.write_text("".join(json.dumps({"text": f"record {i}: " + "soup and bread " * 20}) + "\n" for i in range(40)))
    runs = {}
    for compiled in (False, True):
        d = tmp_path / f"compile-{compiled}"
        over = tiny_overrides(
            d,
            **{
                "train.compile": compiled,
                "train.max_steps": 5,
                "data.max_seq_length": 32,
                "data.source": str(source),
                "data.format": "jsonl-text",
                "memory.every_steps": 3,
                "memory.plan": False,
                "checkpoint.save_model": True,
            },
        )
        s = train({}, over, quiet_recipe=True)
        assert s["status"] == "ok"
        runs[compiled] = ([m["loss"] for m in read_jsonl(d / "metrics.jsonl")], read_jsonl(d / "memory.jsonl"), d)
    (eager_losses, eager_mem, eager_dir), (losses, mem, d) = runs[False], runs[True]
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-5)
    # Measured steps ran the blocks eager (the tracker would not see inside compiled code), the others
    # compiled: one measured step did not stop compiling for the rest of the run.
    assert ["CompiledFunctionBackward" in name for name in seen] == [False, False, True, False, True], seen
    # So the measured memory is the eager step's, byte for byte.
    assert [(x["step"], x["phase"], x["allocated"], x["peak_allocated"]) for x in mem] == [
        (x["step"], x["phase"], x["allocated"], x["peak_allocated"]) for x in eager_mem
    ]
    # Compiled in place: the saved model has the eager model's parameter names.
    from safetensors import safe_open

    def keys(run):
        with safe_open(str(run / "model" / "model.safetensors"), "pt") as f:
            return sorted(f.keys())

    assert keys(d) == keys(eager_dir)


def test_compiled_blocks_with_checkpointing_and_lora_train_like_eager(tmp_path):
    # Checkpointing puts the block's forward inside torch.utils.checkpoint, adapters add LoRA layers to it:
    # both are compiled with the block. (No adapter dropout: compiled dropout draws other random numbers.)
    source = tmp_path / "long.jsonl"
    source.write_text("".join(json.dumps({"text": f"record {i}: " + "soup and bread " * 20}) + "\n" for i in range(40)))
    losses = {}
    for compiled in (False, True):
        d = tmp_path / f"compile-{compiled}"
        over = tiny_overrides(
            d,
            **{
                "train.compile": compiled,
                "train.max_steps": 3,
                "data.max_seq_length": 32,
                "data.source": str(source),
                "data.format": "jsonl-text",
                "train.activation_checkpointing": True,
                "peft.method": "lora",
                "peft.dropout": 0.0,
                "memory.enabled": False,
                "memory.plan": False,
            },
        )
        assert train({}, over, quiet_recipe=True)["status"] == "ok"
        losses[compiled] = [m["loss"] for m in read_jsonl(d / "metrics.jsonl")]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-5)


def test_recipe_refuses_what_compile_cannot_do(monkeypatch):
    assert load_recipe({}, {}).train.compile is False
    with pytest.raises(RecipeError) as e:
        load_recipe({}, {"train.compile": True, "accelerator": "cpu", "memory.cap_gib": 1.0})
    assert any(
        p.startswith("train.compile with memory.cap_gib on the CPU") and "remove memory.cap_gib" in p
        for p in e.value.problems
    ), e.value.problems
    with pytest.raises(RecipeError) as e:
        load_recipe({}, {"train.compile": True, "strategy": "deepspeed_stage_2", "accelerator": "cpu"})
    assert any(
        p.startswith("train.compile with strategy=deepspeed_stage_2")
        and "set train.compile=false" in p
        and "strategy=fsdp" in p
        for p in e.value.problems
    ), e.value.problems
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(RecipeError) as e:
        load_recipe({}, {"train.compile": True, "accelerator": "cpu"})
    assert e.value.problems == [
        "train.compile on the CPU: torch.compile builds C++ kernels, but the compiler "
        "'no-such-compiler-here' is not on PATH; install g++ (or set CXX), or set "
        "train.compile=false"
    ]
    load_recipe({}, {"train.compile": False, "accelerator": "cpu"})  # only asked for when compiling


def test_plan_ignores_compile_and_says_so():
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan

    over = {"model.name": "tiny-llama", "data.max_seq_length": 64, "accelerator": "cpu"}
    eager = plan(load_recipe({}, over), Target("cpu"))
    compiled = plan(load_recipe({}, {**over, "train.compile": True}), Target("cpu"))
    assert compiled.phases == eager.phases and compiled.peak_allocated == eager.peak_allocated
    assert [n for n in compiled.notes if n not in eager.notes] == [
        n for n in compiled.notes if n.startswith("train.compile: planned as the eager step")
    ]
    assert len(compiled.notes) == len(eager.notes) + 1


def test_compile_key_is_documented(tmp_path):
    res = run_cli("recipe", "--docs", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if line.startswith("| `train.compile` |"))
    assert "| bool | `False` |" in row and "bigtune plan" in row and "eager" in row


def test_a_failed_simulation_leaves_no_tracker_or_eager_stance_behind(monkeypatch, no_sim_cache):
    # Otherwise a plan that fails before training (printed as "plan: unavailable") would leave the run's
    # every step under the tracker and torch.compile switched off.
    import torch._dynamo.eval_frame
    from torch.utils._python_dispatch import _len_torch_dispatch_stack

    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan

    def fail(*args, **kwargs):
        raise RuntimeError("simulated failure inside the measured step")

    monkeypatch.setattr(engine, "hidden_states_out", fail)  # runs inside the measured step
    with pytest.raises(RuntimeError, match="simulated failure"):
        plan(load_recipe({}, {"model.name": "tiny-llama", "accelerator": "cpu"}), Target("cpu"))
    assert _len_torch_dispatch_stack() == 0
    assert torch._dynamo.eval_frame._stance.stance == "default"
