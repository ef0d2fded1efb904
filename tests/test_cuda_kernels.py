"""Attention kernels CUDA would pick, emulated in the planner's CPU simulation."""

from __future__ import annotations

import json

import pytest
import torch

from bigtune.core.gpus import CATALOG, compute_capability, find_gpu
from bigtune.models.configs import resolve_config
from bigtune.plan.base.target import Target
from bigtune.plan.device.kernels import sdpa_backend
from bigtune.plan.planner import plan
from bigtune.plan.step.simulate import simulate_full_depth
from bigtune.recipe import load_recipe
from bigtune.run.training import train
from conftest import ROOT

A100, V100, T4 = (8, 0), (7, 0), (7, 5)


def _qk(dtype, kv_heads=8):
    return torch.empty(2, 8, 16, 64, dtype=dtype), torch.empty(2, kv_heads, 16, 64, dtype=dtype)


@pytest.mark.parametrize(
    "dtype, kv, mask, gqa, arch, version, expected",
    [
        (torch.bfloat16, 8, False, False, A100, (2, 11), "flash"),
        (torch.bfloat16, 2, False, True, A100, (2, 11), "flash"),  # flash takes grouped-query heads
        (torch.bfloat16, 8, True, False, A100, (2, 11), "efficient"),  # a mask rules flash out
        (torch.float32, 8, False, False, A100, (2, 11), "efficient"),  # no fp32 flash
        (torch.float32, 2, False, True, A100, (2, 11), "math"),  # fp32 GQA before mem-efficient GQA
        (torch.float32, 2, False, True, A100, (2, 13), "efficient"),
        (torch.bfloat16, 2, False, False, A100, (2, 13), "math"),  # unequal heads without enable_gqa
        (torch.bfloat16, 8, False, False, V100, (2, 11), "math"),  # no bf16 fused kernel below sm80
        (torch.bfloat16, 8, False, False, T4, (2, 11), "math"),
        (torch.float16, 8, False, False, V100, (2, 11), "efficient"),
        (torch.float16, 8, True, False, T4, (2, 11), "efficient"),
    ],
)
def test_sdpa_backend_rules(dtype, kv, mask, gqa, arch, version, expected):
    q, k = _qk(dtype, kv)
    m = torch.ones(2, 1, 16, 16, dtype=torch.bool) if mask else None
    assert sdpa_backend(q, k, m, gqa, arch, version) == expected


def test_every_catalog_gpu_has_a_compute_capability():
    for key, gpu in CATALOG.items():
        assert compute_capability(gpu) >= (7, 0), key
    assert compute_capability(find_gpu("v100-32gb")) == (7, 0)
    assert compute_capability(find_gpu("h100-80gb")) == (9, 0)


def test_math_path_simulation_equals_the_real_math_kernel(tmp_path):
    """The planner's emulated math attention (fake tensors) saves exactly what the real math kernel
    saves: a CPU run forced onto SDPA's math backend measures the same peak as a simulation told the
    GPU is a V100 (bf16: no fused kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": f"plate {i} of soup with basil " * 30}) + "\n" for i in range(32)))
    over = {
        "model.name": "tiny-llama",
        "data.source": str(data),
        "data.max_seq_length": 64,
        "train.micro_batch_size": 4,
        "train.max_steps": 3,
        "train.max_epochs": None,
        "memory.every_steps": 1,
        "checkpoint.save_model": False,
        "accelerator": "cpu",
        "precision": "bf16-true",
        "output_dir": str(tmp_path / "run"),
        "memory.plan": False,
    }
    with sdpa_kernel([SDPBackend.MATH]):
        measured = train({}, over, quiet_recipe=True)["peak_allocated_bytes"]
    r = load_recipe({}, over)
    cfg = resolve_config(r)
    math = simulate_full_depth(r, cfg, cuda=False, arch=V100)
    fused = simulate_full_depth(r, cfg, cuda=False)
    assert math.attention == ("math",) and fused.attention == ()
    assert abs(math.peak_allocated - measured) / measured < 0.005, (math.peak_allocated, measured)
    assert math.peak_allocated > fused.peak_allocated


def test_v100_bf16_plans_the_saved_fp32_scores():
    """TinyLlama shapes, bf16, batch 8 × 512: on a V100 every layer saves its fp32 attention
    probabilities (22 layers × 8 × 32 heads × 512² × 4 bytes = 5.5 GiB) that an A100 (flash) does not."""
    r = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {"precision": "bf16-true", "train.micro_batch_size": 8, "data.max_seq_length": 512},
    )
    cfg = resolve_config(r)
    v100 = plan(r, Target("cuda", find_gpu("v100-32gb")), config=cfg)
    a100 = plan(r, Target("cuda", find_gpu("a100-80gb")), config=cfg)
    probs = cfg.num_hidden_layers * 8 * cfg.num_attention_heads * 512**2 * 4
    extra = v100.peak_allocated - a100.peak_allocated
    assert probs <= extra <= 1.5 * probs, (extra, probs)
    assert any("math path" in n for n in v100.notes) and not any("math path" in n for n in a100.notes)
    # the model states do not depend on the attention kernel
    assert v100.model_states == a100.model_states


def test_cuda_dropout_runs_the_fused_kernel_and_saves_a_bool_mask():
    """On CUDA F.dropout is one native_dropout kernel that keeps a bool mask for backward; on a CPU it
    multiplies by a noise tensor of the input's dtype and keeps that. The emulation switches only the
    out-of-place training call, and its gradient is the same masked, rescaled one."""
    from bigtune.plan.device.kernels import cuda_dropout

    x = torch.randn(64, 32, requires_grad=True)
    drop = torch.nn.Dropout(0.25)
    with cuda_dropout(True):
        y = drop(x)
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
        saved = [getattr(y.grad_fn, n) for n in dir(y.grad_fn) if n.startswith("_saved_")]
        assert [t.dtype for t in saved if isinstance(t, torch.Tensor)] == [torch.bool]
        y.sum().backward()
        kept = y != 0
        assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 1 / 0.75))
        assert (x.grad[~kept] == 0).all()
        # in place, evaluation and p = 0 are left to torch (CUDA's dropout_ never takes the fused kernel)
        z = torch.randn(8, 8)
        torch.nn.functional.dropout(z, 0.25, True, inplace=True)
        assert type(torch.nn.functional.dropout(x, 0.25, False)) is torch.Tensor
    plain = drop(x)
    assert type(plain.grad_fn).__name__ == "MulBackward0"


def test_lora_dropout_costs_a_mask_byte_per_element_on_cuda_and_four_on_a_cpu():
    """LoRA dropout (fp32 adapters: PEFT casts the input to fp32 first) adds, per adapted layer, one
    bool per input element on CUDA, where a CPU keeps a 4-byte noise tensor: the difference between
    dropout 0.1 and no dropout (PEFT then uses an identity) is 4 times larger when planned for a CPU.
    The first layer keeps neither: its input (the frozen embedding's output) needs no gradient."""
    over = {
        "model.name": "tiny-llama",
        "data.max_seq_length": 64,
        "train.micro_batch_size": 4,
        "precision": "bf16-true",
        "peft.method": "lora",
        "peft.target_modules": ["q_proj", "v_proj"],
        "accelerator": "cpu",
    }
    saved = {}
    for cuda in (False, True):
        for p in (0.0, 0.1):
            r = load_recipe({}, {**over, "peft.dropout": p})
            sim = simulate_full_depth(r, resolve_config(r), cuda=cuda)
            saved[cuda, p] = sim.phases["after_forward"]["activations"]
    cfg = resolve_config(load_recipe({}, over))
    elements = (cfg.num_hidden_layers - 1) * 2 * 4 * 64 * cfg.hidden_size  # layers × (q, v) × tokens × inputs
    cpu, gpu = saved[False, 0.1] - saved[False, 0.0], saved[True, 0.1] - saved[True, 0.0]
    assert abs(cpu - 4 * elements) <= 512 * 2 * cfg.num_hidden_layers, (cpu, elements)
    assert abs(gpu - elements) <= 512 * 2 * cfg.num_hidden_layers, (gpu, elements)


def test_attention_dropout_stays_inside_cudas_fused_kernel():
    """BERT drops out 10 % of its attention probabilities. CUDA's flash and memory-efficient kernels do
    that inside the kernel and keep nothing more; PyTorch's CPU flash kernel takes no dropout, so a CPU
    step (and a careless simulation) falls back to the math path and keeps seq × seq tensors per head."""
    import copy

    r = load_recipe(
        {},
        {
            "model.name": "tiny-bert",
            "model.family": "sequence-classification",
            "data.max_seq_length": 256,
            "train.micro_batch_size": 4,
            "precision": "bf16-true",
            "accelerator": "cpu",
        },
    )
    cfg = resolve_config(r)
    assert cfg.attention_probs_dropout_prob > 0
    quiet = copy.deepcopy(cfg)
    quiet.attention_probs_dropout_prob = 0.0
    acts = {
        (cuda, c is cfg): simulate_full_depth(r, c, cuda=cuda).phases["after_forward"]["activations"]
        for cuda in (False, True)
        for c in (cfg, quiet)
    }
    assert acts[True, True] == acts[True, False]
    scores = cfg.num_hidden_layers * 4 * cfg.num_attention_heads * 256**2 * 2  # bf16 seq² per head and layer
    assert acts[False, True] - acts[False, False] >= scores


def test_cuda_autocast_keeps_eager_attention_probabilities_in_fp32(monkeypatch, no_sim_cache):
    """BERT's eager attention calls softmax without a dtype. Under CUDA autocast that runs in fp32: the
    fp32 probabilities are saved for softmax's backward and a bf16 copy for the matmul with V (4 more
    bytes per score than CPU autocast, which keeps one bf16 tensor for both)."""
    import contextlib
    import copy

    import bigtune.plan.device.kernels

    r = load_recipe(
        {},
        {
            "model.name": "tiny-bert",
            "model.family": "sequence-classification",
            "model.attn_implementation": "eager",
            "data.max_seq_length": 256,
            "train.micro_batch_size": 4,
            "precision": "bf16-mixed",
            "accelerator": "cpu",
        },
    )
    cfg = copy.deepcopy(resolve_config(r))
    cfg.attention_probs_dropout_prob = 0.0  # dropout's own CPU/CUDA difference is tested above
    cfg.hidden_dropout_prob = 0.0
    gpu = simulate_full_depth(r, cfg, cuda=True).phases["after_forward"]["activations"]
    monkeypatch.setattr(bigtune.plan.device.kernels, "cuda_autocast", lambda enabled: contextlib.nullcontext())
    cpu_rules = simulate_full_depth(r, cfg, cuda=True).phases["after_forward"]["activations"]
    scores = cfg.num_hidden_layers * 4 * cfg.num_attention_heads * 256**2
    assert gpu - cpu_rules == 4 * scores, (gpu - cpu_rules, scores)
