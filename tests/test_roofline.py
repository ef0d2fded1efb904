"""The time model: operators recorded from the simulated step, priced per kernel (roofline.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from bigtune.core.gpus import find_gpu
from bigtune.engine.build import build, setup_fabric
from bigtune.engine.loop import LoopState, train_step
from bigtune.models.configs import resolve_config
from bigtune.plan.base.target import Target
from bigtune.plan.device.roofline import (
    BANDWIDTH_EFFICIENCY,
    GEMM_EFFICIENCY,
    HOST_SECONDS_PER_OP,
    OpCounter,
    scale,
    step_seconds,
)
from bigtune.plan.layout.time import DDP_BUCKET_BYTES, _exposed_communication
from bigtune.plan.planner import plan
from bigtune.plan.search.alternatives import _interpolate
from bigtune.plan.step.simulate import simulate, simulate_full_depth
from bigtune.recipe import load_recipe

TINY = {
    "model.name": "tiny-llama",
    "data.max_seq_length": 32,
    "train.micro_batch_size": 2,
    "train.accumulate_grad_batches": 2,
    "precision": "32-true",
    "accelerator": "cpu",
    "optim.implementation": "foreach",
}


def _recipe(**over):
    return load_recipe({"name": "roofline"}, {**TINY, **over}, check=False)


def _sum(ops, kind, phase, i):
    return sum(v[i] for k, v in ops.items() if k[0] == kind and k[1] == phase)


def test_gemm_flops_are_two_per_weight_per_token_forward_and_twice_that_backward():
    r = _recipe()
    sim = simulate(r, resolve_config(r), 2, cuda=False)
    tokens = 2 * 32
    assert _sum(sim.ops, "gemm", "forward", 1) == 2 * tokens * sim.matmul_numel
    # input and weight gradients of every Linear (the embeddings are trained, so the first layer's
    # input gradient is needed too)
    assert _sum(sim.ops, "gemm", "backward", 1) == 2 * _sum(sim.ops, "gemm", "forward", 1)


def test_frozen_weights_skip_weight_gradients_and_checkpointing_adds_a_forward():
    full, lora = (
        _recipe(),
        _recipe(
            **{
                "peft.method": "lora",
                "peft.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            }
        ),
    )
    cfg = resolve_config(full)
    s_full = simulate(full, cfg, 2, cuda=False)
    s_lora = simulate(lora, cfg, 2, cuda=False)
    fwd = _sum(s_full.ops, "gemm", "forward", 1)
    # LoRA: the base weights' backward is their input gradient only (+ the adapters' thin matmuls)
    assert _sum(s_lora.ops, "gemm", "backward", 1) == pytest.approx(fwd, rel=0.25)
    assert _sum(s_lora.ops, "gemm", "backward", 1) < 0.65 * _sum(s_full.ops, "gemm", "backward", 1)
    ckpt = simulate(_recipe(**{"train.activation_checkpointing": True}), cfg, 2, cuda=False)
    # Recomputation runs in backward: one more forward of the blocks, not of the output layer, and
    # not of each block's last matmul either: non-reentrant checkpointing stops recomputing once the
    # tensors backward needs are back, and down_proj's output is not one of them.
    tokens = 2 * 32
    head = 2 * tokens * cfg.hidden_size * cfg.vocab_size
    down = 2 * tokens * cfg.num_hidden_layers * cfg.intermediate_size * cfg.hidden_size
    extra = _sum(ckpt.ops, "gemm", "backward", 1) - _sum(s_full.ops, "gemm", "backward", 1)
    assert extra == fwd - head - down


def test_fused_attention_counts_half_the_scores_when_causal_and_backward_two_and_a_half_times():
    r = _recipe()
    cfg = resolve_config(r)
    sim = simulate(r, cfg, 1, cuda=True, arch=(8, 0))  # fp32 on sm80: the memory-efficient kernel
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    causal = 4 * 2 * cfg.num_attention_heads * 32 * 32 * head_dim / 2
    assert _sum(sim.ops, "attn", "forward", 1) == causal
    assert _sum(sim.ops, "attn", "backward", 1) == 2.5 * causal


def test_one_large_gemm_runs_at_the_tile_occupancy_of_the_assumed_efficiency():
    a100 = find_gpu("a100-80gb")
    ops = {("gemm", "forward", "bf16", (1, 4096, 4096, 4096)): [1, 2.0 * 4096**3, 3 * 4096**2 * 2]}
    t = step_seconds(ops, a100, "bf16")
    tiles = 32 * 32
    occupancy = tiles / (math.ceil(tiles / a100.sms) * a100.sms)  # 1024 tiles in 10 waves of 108
    assert t["forward_s"] == pytest.approx(2.0 * 4096**3 / (a100.bf16_tflops * 1e12 * GEMM_EFFICIENCY * occupancy))
    assert t["step_s"] == t["device_s"] == t["forward_s"]


def test_the_dense_peak_floor_counts_matmuls_and_attention_at_the_catalog_rate():
    """step_seconds' ``peak_s``: each tensor-core row's FLOPs at its dtype's catalog peak, nothing else; the
    floor bench/published.py holds published rates against. On a GeForce card that is the FP32-accumulate
    rate (RTX 4090: 165.2 dense bf16, not the 330 fp16-accumulate marketing figure)."""
    rtx = find_gpu("rtx-4090")
    assert rtx.bf16_tflops == 165.2
    gemm, attn = 2.0 * 4096**3, 1e12
    ops = {
        ("gemm", "forward", "bf16", (1, 4096, 4096, 4096)): [1, gemm, 3 * 4096**2 * 2],
        ("gemm", "backward", "fp32", (1, 4096, 16, 4096)): [1, 2.0 * 4096 * 16 * 4096, 4096**2 * 4],
        ("attn", "backward", "bf16", ()): [1, attn, 1e6],
        ("mem", "forward", "", (30,)): [1, 0.0, 1e9],
    }
    t = step_seconds(ops, rtx, "bf16")
    lora_a = 2.0 * 4096 * 16 * 4096
    assert t["tensor_flops"] == gemm + lora_a + attn
    assert t["peak_s"] == pytest.approx((gemm + attn) / 165.2e12 + lora_a / (rtx.fp32_tflops * 1e12))
    assert t["peak_s"] < t["device_s"]  # efficiencies, occupancy and the memory-bound row only add


def test_memory_bound_kernels_take_their_bytes_over_the_bandwidth_and_the_host_can_bound_the_step():
    h100 = find_gpu("h100-sxm-80gb")
    big = {("mem", "optimizer", "", (33,)): [10, 0.0, 80e9]}
    t = step_seconds(big, h100, "bf16")
    assert t["optimizer_s"] == pytest.approx(80e9 / (h100.mem_bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY))
    small = {("mem", "forward", "", (10,)): [1000, 0.0, 1000 * 1024], ("host", "forward", "", ()): [1000, 0, 0]}
    t = step_seconds(small, h100, "bf16")
    assert t["host_s"] == pytest.approx(2000 * HOST_SECONDS_PER_OP)
    assert t["step_s"] == t["host_s"] > t["device_s"]
    with pytest.raises(ValueError, match="no bf16"):
        step_seconds({("gemm", "forward", "bf16", (1, 64, 64, 64)): [1, 1.0, 1.0]}, find_gpu("v100-32gb"), "bf16")
    assert (
        step_seconds({("gemm", "forward", "bf16", (1, 64, 64, 64)): [1, 1.0, 1.0]}, find_gpu("v100-32gb"), "fp16")[
            "step_s"
        ]
        > 0
    )  # 16-mixed: simulated bf16 is fp16


def test_the_simulated_step_issues_the_operators_of_the_real_step():
    """The fake-tensor step and a real CPU step of the engine record the same operators (±5 %)."""
    over = {"data.max_seq_length": 256, "train.micro_batch_size": 1, "optim.grad_clip": 1.0}
    r = _recipe(**over)
    fabric = setup_fabric(r)
    built = build(r, fabric)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, built.model.config.vocab_size, (1, 256), generator=g) for _ in range(2)]
    batches = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]
    state = LoopState(step=1)
    train_step(built, batches, None, False, state)  # optimizer state exists from here on, as in the sim
    with OpCounter(state) as real:
        train_step(built, batches, None, False, state)
    # as on a GPU, clipping takes its foreach kernels (a CPU run of plain tensors does too)
    sim = simulate(r, resolve_config(r), 2, cuda=True, arch=(8, 0))
    window = scale(sim.ops, ("forward", "backward"), 2)
    for kind in ("gemm", "mem"):
        n_real = sum(v[0] for k, v in real.ops.items() if k[0] == kind)
        n_sim = sum(v[0] for k, v in window.items() if k[0] == kind)
        assert n_sim == pytest.approx(n_real, rel=0.05), kind
    flops_real = sum(v[1] for k, v in real.ops.items() if k[0] == "gemm")
    assert sum(v[1] for k, v in window.items() if k[0] == "gemm") == pytest.approx(flops_real, rel=1e-6)


def test_operator_rows_extrapolate_with_depth_like_memory():
    r = _recipe()
    cfg = copy.deepcopy(resolve_config(r))
    cfg.num_hidden_layers = 5
    direct = simulate(r, cfg, 5, cuda=False)
    extrapolated = simulate_full_depth(r, cfg, cuda=False)
    for kind in ("gemm", "mem", "host"):
        for i in range(3):
            want = sum(v[i] for k, v in direct.ops.items() if k[0] == kind)
            got = sum(v[i] for k, v in extrapolated.ops.items() if k[0] == kind)
            assert got == pytest.approx(want, rel=1e-9), (kind, i)


def test_interpolated_micro_batches_time_between_their_exact_ends():
    r = _recipe(**{"data.max_seq_length": 64})
    cfg = resolve_config(r)
    lo, hi = (
        simulate(_recipe(**{"data.max_seq_length": 64, "train.micro_batch_size": m}), cfg, 2, True, arch=(8, 0))
        for m in (1, 4)
    )
    gpu = find_gpu("a100-80gb")

    def per_sample(sim, m):
        return step_seconds(scale(sim.ops, ("optimizer",), 0.0), gpu, "bf16")["step_s"] / m

    at_hi = _interpolate(lo, hi, 1, 4, 4)
    assert per_sample(at_hi, 4) == pytest.approx(per_sample(hi, 4))
    mid = per_sample(_interpolate(lo, hi, 1, 4, 2), 2)
    assert min(per_sample(lo, 1), per_sample(hi, 4)) <= mid <= max(per_sample(lo, 1), per_sample(hi, 4))


def test_small_models_are_bound_by_the_host_and_large_ones_by_the_gpu():
    h100 = find_gpu("h100-sxm-80gb")
    tiny = plan(_recipe(**{"precision": "bf16-true"}), Target("cuda", h100))
    assert any("host (eager dispatch) bounds the step" in n for n in tiny.notes)
    big = plan(
        load_recipe(
            {},
            {
                "model.name": "openlm-research/open_llama_7b",
                "precision": "bf16-true",
                "train.micro_batch_size": 4,
                "data.max_seq_length": 512,
                "train.accumulate_grad_batches": 8,
                "accelerator": "cpu",
            },
        ),
        Target("cuda", h100),
    )
    assert any("the GPU bounds the step" in n for n in big.notes)
    # a sane MFU for an eager 7B step: between a third and 80 % of the dense peak
    flops = 6 * 6.7e9 * big.tokens_per_s
    assert 0.33 < flops / (h100.bf16_tflops * 1e12) < 0.8


def test_communication_is_exposed_only_where_compute_cannot_hide_it():
    a100 = find_gpu("a100-80gb")  # NVLink 600 GB/s: 300 GB/s one way
    gib = 2**30
    states = {"gradients": 12 * gib, "parameters": 12 * gib}
    r = _recipe(**{"train.accumulate_grad_batches": 4})
    bw = 300e9
    # DDP: the all-reduce (2 × 3/4 × 12 GiB) overlaps the last micro-batch's backward; the last bucket does not
    slow = {"forward_s": 0.04, "backward_s": 0.08}  # 0.02 s of backward per micro-batch
    ddp = _exposed_communication(r, Target("cuda", a100, 4, "ddp"), states, slow)
    reduce = 2 * 0.75 * 12 * gib / bw
    assert ddp == pytest.approx(reduce - 0.02 + 2 * 0.75 * DDP_BUCKET_BYTES / bw)
    hidden = _exposed_communication(r, Target("cuda", a100, 4, "ddp"), states, {"forward_s": 4.0, "backward_s": 8.0})
    assert hidden == pytest.approx(2 * 0.75 * DDP_BUCKET_BYTES / bw)
    # FSDP: the weights are gathered for every micro-batch's forward and backward and the gradients
    # reduce-scattered after each (they stay sharded through the window), behind its 0.03 s of compute
    fsdp = _exposed_communication(r, Target("cuda", a100, 4, "fsdp"), states, slow)
    gather, scatter = 2 * 0.75 * 12 * gib / bw, 0.75 * 12 * gib / bw
    assert fsdp == pytest.approx(4 * (gather + scatter - 0.03))
    # grad_op keeps the weights from the forward for the backward: one gather per micro-batch
    r_op = _recipe(**{"train.accumulate_grad_batches": 4, "fsdp_sharding": "grad_op"})
    op = _exposed_communication(r_op, Target("cuda", a100, 4, "fsdp"), states, slow)
    assert op == pytest.approx(4 * (gather / 2 + scatter - 0.03))
    # one flat unit (fsdp_wrap=none): gathered before the forward, reduced after the backward, nothing hidden
    r_flat = _recipe(**{"train.accumulate_grad_batches": 4, "fsdp_wrap": "none"})
    flat = _exposed_communication(r_flat, Target("cuda", a100, 4, "fsdp"), states, slow)
    assert flat == pytest.approx(4 * (gather / 2 + scatter))
    assert _exposed_communication(r, Target("cuda", a100, 1, "single"), states, slow) == 0.0
