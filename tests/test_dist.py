"""Several processes on the CPU (gloo): DDP and FSDP2 match one process; torchrun; sharded checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import (
    HANG_GUARD_S,
    ROOT,
    read_jsonl,
    resume_from_step_3,
    run_cli,
    run_losses,
    same_weights,
    set_args,
    train_cli,
)

COMMON = {
    "train.max_steps": 4,
    "train.max_epochs": None,
    "train.log_every_steps": 1,
    "memory.every_steps": 1,
    "data.max_seq_length": 64,
    "accelerator": "cpu",
    "optim.name": "sgd",
    "optim.lr": 0.5,
    "checkpoint.save_model": True,
    "memory.plan": False,
}


def _train(tmp_path, name, **over):
    return train_cli(tmp_path, name, COMMON, **over)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("single"), "run", **{"train.micro_batch_size": 8})


# "ddp-lightning": Lightning Trainer's defaults, gradients beside DDP's buckets and freed before the next backward
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "ddp-lightning"])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(tmp_path, single, strategy):
    extra = {"ddp_bucket_view": False, "optim.zero_grad": "before_backward"} if strategy == "ddp-lightning" else {}
    strategy = strategy.split("-")[0]
    run = _train(
        tmp_path, strategy, devices=2, strategy=strategy, **{"train.micro_batch_size": 4, "memory.plan": True, **extra}
    )
    assert run_losses(run) == pytest.approx(run_losses(single), rel=1e-5)
    plan = json.loads((run / "summary.json").read_text())["plan"]
    assert abs(plan["peak_error_pct"]) < 2.0, plan["peak_error_pct"]  # the planner's per-rank peak
    same_weights(run, single)
    snaps = read_jsonl(run / "memory.jsonl")
    assert {s["rank"] for s in snaps} == {0, 1}  # every rank measured, rank 0 wrote them
    one = {s["phase"]: s for s in read_jsonl(single / "memory.jsonl") if s["step"] == 2}
    for s in snaps:
        if s["step"] == 2 and s["phase"] == "after_backward":
            if strategy == "fsdp":  # parameters and gradients sharded across the two ranks
                assert s["parameters"] < 0.6 * one["after_backward"]["parameters"]
                assert s["gradients"] < 0.6 * one["after_backward"]["gradients"]
            else:
                assert s["parameters"] == one["after_backward"]["parameters"]


def test_torchrun_launch(tmp_path, single):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29533",
        "-m",
        "bigtune",
        "train",
        *set_args(
            {**COMMON, "output_dir": str(tmp_path / "tr"), "strategy": "ddp", "devices": 2, "train.micro_batch_size": 4}
        ),
    ]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert run_losses(tmp_path / "tr") == pytest.approx(run_losses(single), rel=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_resumes_across_ranks(tmp_path, strategy):
    # The recipe warms the lr up over 10 steps, so a scheduler that is not restored shows: Fabric's
    # sharded (FSDP2) load once left it at step 0 and step 3 after resume diverged (~0.5% in loss).
    over = {
        "devices": 2,
        "strategy": strategy,
        "train.micro_batch_size": 4,
        "train.max_steps": 6,
        "checkpoint.enabled": True,
        "checkpoint.every_steps": 3,
        "checkpoint.keep_last": 5,
        "optim.name": "adamw",
        "optim.lr": 1e-3,
    }
    ref = _train(tmp_path, "ref", **over)
    ckpt = ref / "checkpoints" / "step-000003.ckpt"
    assert ckpt.is_dir() == (strategy == "fsdp"), "FSDP writes a distributed (sharded) checkpoint folder"
    cut = resume_from_step_3(tmp_path, ref, COMMON, over)
    assert run_losses(cut) == pytest.approx(run_losses(ref), rel=1e-5)
    assert [m["lr"] for m in read_jsonl(cut / "metrics.jsonl")] == [m["lr"] for m in read_jsonl(ref / "metrics.jsonl")]
    same_weights(cut, ref)
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 6


def test_slurm_script(tmp_path):
    res = run_cli(
        "launch",
        "slurm",
        str(ROOT / "recipes" / "open-llama-7b-full.yaml"),
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--partition",
        "gpu",
        "--time",
        "02:00:00",
        "--out",
        str(tmp_path / "job.sbatch"),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "job.sbatch").read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=02:00:00",
        "#SBATCH --requeue",
        "--signal=TERM@120",
    ):
        assert line in text, line
    srun = next(x for x in text.splitlines() if x.startswith("srun "))
    assert "devices=4" in srun and "num_nodes=2" in srun and "--auto-resume" in srun
    # a bad recipe is refused when the script is written, not hours later in the queue
    res = run_cli("launch", "slurm", "--set", "train.micro_bach_size=2", cwd=tmp_path)
    assert res.returncode == 2 and "micro_batch_size" in res.stderr


def test_sigterm_checkpoints_and_auto_resume_continues(tmp_path):
    import signal
    import time

    over = {
        **COMMON,
        "train.max_steps": 80,
        "optim.name": "adamw",
        "optim.lr": 1e-3,
        "memory.every_steps": 1000,
        "checkpoint.enabled": True,
        "checkpoint.every_steps": 1000,
        "output_dir": str(tmp_path / "run"),
        "checkpoint.save_model": False,
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bigtune", "train", *set_args(over)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + HANG_GUARD_S
    while (
        (not metrics.exists() or len(metrics.read_text().splitlines()) < 5)
        and proc.poll() is None
        and time.time() < deadline
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=HANG_GUARD_S)[0]
    assert proc.returncode == 143, out[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    stopped = summary["preempted_at_step"]
    assert summary["status"] == "preempted" and 5 <= stopped < 80
    assert (tmp_path / "run" / "checkpoints" / f"step-{stopped:06d}.ckpt").exists()
    res = run_cli("train", *set_args(over), "--auto-resume", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:]
    assert f"at step {stopped}" in res.stdout
    assert [m["step"] for m in read_jsonl(metrics)] == list(range(1, 81))


def test_tracker_sees_storage_resizes():
    """FSDP2 gathers into storages it grows with resize_(n) and frees with resize_(0), which no
    dispatch mode sees: the CPU tracker once counted every gathered weight alive until the step ended."""
    from bigtune.memory.tracker import LiveTensorTracker

    keep = torch.empty(1000)  # made before the tracker: unknown to it until resized
    with LiveTensorTracker() as tracker:
        t = torch.zeros(250)
        assert tracker.live_bytes == 1000
        t.untyped_storage().resize_(0)
        assert tracker.live_bytes == 0 and tracker.peak_bytes == 1000
        t.untyped_storage().resize_(3000)
        keep.untyped_storage().resize_(8000)
        assert tracker.live_bytes == 11000 == tracker.peak_bytes
    from bigtune.memory.tracker import _ORIGINAL_RESIZE

    assert torch.UntypedStorage.resize_ is _ORIGINAL_RESIZE  # unpatched outside the tracker


def test_monitor_separates_backward_transients_from_growing_gradients():
    """The planner rebuilds a sharded backward from the simulated one: the high of what is not a model
    state, over the whole backward and from the first block on, and how much of the new gradients was
    still to come then. Two linear blocks, the second's backward first; numbers by hand."""
    from bigtune.memory.monitor import MemoryMonitor

    blocks = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    x = torch.randn(8, 64)
    monitor = MemoryMonitor(torch.device("cpu"))
    hooks = monitor.follow_gradients(blocks.parameters(), list(blocks))
    monitor.begin_step(blocks, None, extra=[x])
    loss = blocks(x).square().sum()
    monitor.snapshot(0, "after_forward", blocks, None)
    loss.backward()
    snap = monitor.snapshot(0, "after_backward", blocks, None)
    monitor.end_step()
    for h in hooks:
        h.remove()
    weight, acts = 64 * 64 * 4, 8 * 64 * 4
    assert snap.gradients == 2 * weight and snap.parameters == 2 * weight
    # neither high counts a stored gradient; before any is stored, a weight's gradient in the making
    # (one matrix) rides on top of the saved activations
    assert snap.phase_peak_activations_late <= snap.phase_peak_activations < snap.phase_peak - snap.parameters
    assert weight <= snap.phase_peak_activations <= 6 * acts + weight
    assert 0 < snap.phase_gradients_pending_late <= 2 * weight
    plain = MemoryMonitor(torch.device("cpu"))  # not told about gradients: no such measures
    plain.begin_step(blocks, None)
    assert plain.snapshot(0, "before_forward", blocks, None).phase_peak_activations is None
    plain.end_step()


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """tiny-llama with 8 decoder blocks: enough blocks that gathering one at a time differs from all at once."""
    from bigtune.core.presets import preset_config, tiny_tokenizer

    folder = tmp_path_factory.mktemp("deep") / "m"
    tok = tiny_tokenizer()
    cfg = preset_config("tiny-llama", tok)
    cfg.num_hidden_layers = 8
    cfg.save_pretrained(folder)
    tok.save_pretrained(folder)
    # records longer than max_seq_length: every micro-batch full length, none padded
    (folder / "long.jsonl").write_text(
        "".join(json.dumps({"text": f"plate {i} of soup with bread " * 30}) + "\n" for i in range(64))
    )
    return folder


# Issue #6's CPU matrix on 2 ranks: precision × checkpointing × LoRA, per-block and flat units, accumulation.
FSDP_MATRIX = {
    "block": ("block", 1, {}),
    "none": ("none", 1, {}),
    "block-acc2": ("block", 2, {}),
    "bf16-mixed": ("block", 1, {"precision": "bf16-mixed"}),
    "bf16-true-lora": ("block", 1, {"precision": "bf16-true", "peft.method": "lora"}),
    "ckpt": ("block", 1, {"train.activation_checkpointing": True}),
    "bf16-mixed-ckpt": ("block", 1, {"precision": "bf16-mixed", "train.activation_checkpointing": True}),
    "lora-ckpt": ("block", 1, {"peft.method": "lora", "train.activation_checkpointing": True}),
    "none-ckpt": ("none", 1, {"train.activation_checkpointing": True}),
    "sgd": ("block", 1, {"optim.name": "sgd"}),
    "step-sync-acc2": ("block", 2, {"fsdp_grad_sync": "step"}),
    "step-sync-acc2-bf16-mixed": ("block", 2, {"fsdp_grad_sync": "step", "precision": "bf16-mixed"}),
}


@pytest.mark.parametrize("case", list(FSDP_MATRIX))
def test_fsdp_units_planned_per_phase(tmp_path, deep_model, case):
    """Per rank, every phase's parameters, gradients, optimizer state and allocated bytes as planned
    (gathered weights count under activations in both) and the peak within 2 %. One flat unit
    (fsdp_wrap=none, as Lightning's FSDPStrategy() without a wrap policy) holds the whole model gathered
    after the forward and needs more memory than per-block units; with accumulation the gradients are
    reduce-scattered every micro-batch, so they stay sharded through the window."""
    wrap, accumulate, extra = FSDP_MATRIX[case]
    run = _train(
        tmp_path,
        case if case != "block" else "block1",
        devices=2,
        strategy="fsdp",
        fsdp_wrap=wrap,
        **{
            "model.name": str(deep_model),
            "model.init": "random",
            "data.source": str(deep_model / "long.jsonl"),
            "optim.name": "adamw",
            "optim.lr": 1e-3,
            "train.micro_batch_size": 4 // accumulate,
            "train.accumulate_grad_batches": accumulate,
            "memory.plan": True,
            "checkpoint.save_model": False,
            **extra,
        },
    )
    plan = json.loads((run / "summary.json").read_text())["plan"]
    snaps = {s["phase"]: s for s in read_jsonl(run / "memory.jsonl") if s["step"] == 2 and s["rank"] == 0}
    shard = snaps["before_forward"]["parameters"]  # this rank's half of the fp32 weights
    # one unit's gathered fp32 weights: a block (46,208 parameters), or the whole model in one flat unit
    cfg = json.loads((deep_model / "config.json").read_text())
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    unit = 2 * shard if wrap == "none" else 4 * (2 * h * h + 2 * h * kv + 3 * h * cfg["intermediate_size"] + 2 * h)
    # The peak within 2 %, or over it by no more than the one late block the after_forward check allows
    # (CI, 2026-11-28, lora-ckpt: the measured peak 4.8 % over a 3.8 MB plan, one block's 184,832 B gathered
    # weights still alive under gloo's async collectives; the plan itself is deterministic).
    over = plan["measured_peak_allocated"] - plan["predicted_peak_allocated_like_for_like"]
    assert abs(plan["peak_error_pct"]) < 2.0 or 0 <= over <= unit + 4096, (plan["peak_error_pct"], over, unit)
    for phase, cats in plan["phases"].items():
        for c in ("parameters", "gradients", "optimizer_device", "allocated"):
            if c == "allocated" and phase == "after_forward":
                # under load (CI: twice in ~20 runs, with checkpointing) the snapshot counted exactly one more
                # block's gathered weights (184,832 B): their release is timing-dependent under gloo's async
                # collectives; once (CI, 2026-11-27) 1,174 B more beside them, small tensors of the same
                # in-flight collective. Never less than planned, never more than one unit (and 4 KiB) over.
                assert 0 <= cats[c]["measured"] - cats[c]["predicted"] <= unit + 4096, (phase, cats[c], unit)
            elif c == "allocated" and phase in ("after_backward", "after_optimizer"):
                # the root's last reduce-scatter input may outlive the backward until its collective is
                # waited on (timing-dependent under gloo): at most the root's unsharded gradients, its
                # weights' size (embeddings and head; with one flat unit, the whole model: 2 shards here)
                root_grads = 2 * shard + 512 if wrap == "none" else 0.35 * shard
                assert 0 <= cats[c]["measured"] - cats[c]["predicted"] < root_grads, (phase, cats[c])
            else:
                # (abs: Adam's step counters are whole on every rank; the plan halves them with the rest)
                assert cats[c]["measured"] == pytest.approx(cats[c]["predicted"], rel=1e-3, abs=512), (
                    phase,
                    c,
                    cats[c],
                )
    assert snaps["before_forward"]["activations"] < 0.05 * shard  # nothing left gathered
    after_forward = snaps["after_forward"]["activations"]
    if wrap == "none":
        assert after_forward > 2 * shard  # the whole model gathered (the tiny model's activations are smaller)
        block = (
            json.loads((tmp_path / "block1" / "summary.json").read_text()) if (tmp_path / "block1").exists() else None
        )
        assert block is None or plan["measured_peak_allocated"] > block["plan"]["measured_peak_allocated"]
    if accumulate > 1 and "fsdp_grad_sync" in extra:
        # reduced once per window: the last micro-batch's forward holds whole (fp32) gradients, twice a shard
        assert snaps["after_forward"]["gradients"] == 2 * snaps["after_backward"]["gradients"] > 0
    elif accumulate > 1:  # the last micro-batch's forward holds only the first one's sharded gradients
        assert snaps["after_forward"]["gradients"] == snaps["after_backward"]["gradients"] > 0


def test_flat_fsdp_unit_is_planned_far_larger_and_advised_against():
    """The lab's OpenLLaMA-7B on 4 A100s: one flat unit gathers the whole model (12.55 GiB in bf16) and
    holds every gradient unsharded, so its plan exceeds the per-block plan by at least the model; the
    OOM advice names the per-block wrap first."""
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan
    from bigtune.recipe import load_recipe
    from bigtune.run.advice import oom_advice

    over = {
        "model.name": "openlm-research/open_llama_7b",
        "precision": "bf16-true",
        "train.micro_batch_size": 4,
        "data.max_seq_length": 512,
        "devices": 4,
        "strategy": "fsdp",
        "accelerator": "cpu",
    }
    target = Target("cuda", find_gpu("a100-80gb"), 4, "fsdp")
    block = plan(load_recipe({}, over), target)
    flat_recipe = load_recipe({}, {**over, "fsdp_wrap": "none"})
    flat = plan(flat_recipe, target)
    model_bytes = 2 * 6.7e9
    assert flat.peak_allocated - block.peak_allocated > model_bytes
    assert (
        flat.phases["after_forward"]["activations"] - block.phases["after_forward"]["activations"] > 0.9 * model_bytes
    )
    assert any("fsdp_wrap=none" in n for n in flat.notes)
    assert oom_advice(flat_recipe)[0].startswith("fsdp_wrap=block")
    assert not any("fsdp_wrap" in a for a in oom_advice(load_recipe({}, over)))
    # --alternatives offers FSDP with per-block units, named as the change it is
    from bigtune.plan.search.alternatives import alternatives

    alts = alternatives(flat_recipe, target, max_gpus=4, workers=1)
    named = [p for p in alts if "fsdp_wrap=block" in p.variant]
    assert named and all(p.peak_allocated < flat.peak_allocated for p in named)


def test_gradient_sync_once_per_window_is_planned_as_unsharded_gradients():
    """fsdp_grad_sync=step (Fabric's no_backward_sync under FSDP, as litgpt's multi-GPU scripts): every
    rank holds the whole unsharded gradient (12.55 GiB in bf16 for OpenLLaMA-7B) through the window, so
    the last micro-batch's forward carries it; the traffic falls to one reduce-scatter per window; the
    OOM advice names the per-micro-batch sync."""
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan
    from bigtune.recipe import load_recipe
    from bigtune.run.advice import oom_advice

    over = {
        "model.name": "openlm-research/open_llama_7b",
        "precision": "bf16-true",
        "train.micro_batch_size": 2,
        "train.accumulate_grad_batches": 4,
        "data.max_seq_length": 512,
        "devices": 4,
        "strategy": "fsdp",
        "accelerator": "cpu",
    }
    target = Target("cuda", find_gpu("a100-80gb"), 4, "fsdp")
    each = plan(load_recipe({}, over), target, replay=False)
    step_recipe = load_recipe({}, {**over, "fsdp_grad_sync": "step"})
    once = plan(step_recipe, target, replay=False)
    whole = 2 * 6.74e9
    assert once.phases["after_forward"]["gradients"] == pytest.approx(whole, rel=0.02)
    assert each.phases["after_forward"]["gradients"] == pytest.approx(whole / 4, rel=0.02)
    assert once.peak_allocated - each.peak_allocated > 0.7 * whole
    assert once.phases["after_backward"]["gradients"] == each.phases["after_backward"]["gradients"]
    assert any("fsdp_grad_sync=step" in n for n in once.notes)
    assert once.step_time_s <= each.step_time_s  # NVLink hides the reduce-scatters either way
    pcie = Target("cuda", find_gpu("l40s"), 4, "fsdp")  # there three fewer per window show
    assert (
        plan(step_recipe, pcie, replay=False).step_time_s < plan(load_recipe({}, over), pcie, replay=False).step_time_s
    )
    assert oom_advice(step_recipe)[0].startswith("fsdp_grad_sync=micro_batch")
    assert not any("fsdp_grad_sync" in a for a in oom_advice(load_recipe({}, over)))
    # DDP (replicated states, its buckets) on the same cards: far above either
    ddp = plan(
        load_recipe({}, {**over, "strategy": "ddp"}), Target("cuda", find_gpu("a100-80gb"), 4, "ddp"), replay=False
    )
    assert ddp.peak_allocated > once.peak_allocated + whole
