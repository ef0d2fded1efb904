"""bigtune plan --for generate|caption|predict: the plan against measured CPU peaks, the KV cache in closed form,
the largest batch, the estimates' physics, the CLI, and launch slurm's host resources."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from bigtune.core.gpus import custom_gpu, find_gpu
from bigtune.models.configs import resolve_config_name
from bigtune.plan.base.constants import CUDA_CONTEXT_BYTES, GIB
from bigtune.plan.base.target import Target
from bigtune.plan.serving import (
    ASSUMED_DECODE_BW_EFFICIENCY,
    Workload,
    kv_cache_bytes,
    measure_cpu,
    plan_inference,
    simulate,
    simulate_full_depth,
)
from bigtune.recipe import load_recipe
from conftest import ROOT, run_cli

MiB = 2**20


def _recipe(model: str, **over):
    family = {"model.family": "image-to-text"} if model.startswith("tiny-blip2") else {}
    return load_recipe({}, {"model.name": model, "accelerator": "cpu", **family, **over})


def _config(model: str):
    return resolve_config_name(_recipe(model).model)


# (model, task, batch, prompt tokens, new tokens, dtype): batch sizes and lengths where the prefill peaks and
# where the last decode step peaks, both dtypes, every preset family.
CASES = [
    ("tiny-llama", "generate", 4, 16, 8, torch.float32),
    ("tiny-llama", "generate", 8, 48, 4, torch.bfloat16),
    ("tiny-llama", "generate", 16, 8, 24, torch.float32),
    ("tiny-opt", "generate", 2, 64, 6, torch.float32),
    ("tiny-opt", "generate", 12, 8, 20, torch.bfloat16),
    ("tiny-blip2-opt", "caption", 8, 0, 12, torch.float32),
    ("tiny-blip2-opt", "caption", 4, 6, 6, torch.bfloat16),
    ("tiny-blip2-t5", "caption", 6, 0, 10, torch.float32),
    ("tiny-llama", "predict", 8, 32, 0, torch.float32),
    ("tiny-opt", "predict", 4, 64, 0, torch.bfloat16),
]


@pytest.mark.parametrize("model, task, b, p, n, dtype", CASES)
def test_cpu_plan_matches_measured_peak(model, task, b, p, n, dtype):
    """The plan for device cpu against transformers' own generate (or forward) under the live tensor tracker."""
    r = _recipe(model)
    w = Workload(task, b, p, n, dtype)
    plan = plan_inference(r, Target("cpu"), w)
    measured = measure_cpu(_config(model), r.model.family, w)
    assert plan.weights == measured["weights"]
    assert plan.overhead == 0 and plan.peak_total == plan.needed_total == plan.peak_allocated  # no CUDA terms
    assert abs(plan.peak_allocated - measured["peak"]) / measured["peak"] < 0.05, (plan.peak_allocated, measured)


def test_kv_cache_term_is_the_closed_form_and_the_simulated_cache():
    # tiny-llama: 2 layers, GQA with 2 key/value heads of 4, head_dim 64/4 = 16
    cfg = _config("tiny-llama")
    w = Workload("generate", 8, 40, 9, torch.bfloat16)
    analytic = 2 * 2 * 2 * 16 * (40 + 9 - 1) * 8 * 2
    assert kv_cache_bytes(cfg, w) == analytic
    assert simulate(cfg, "causal-lm", w, cuda=False).cache == analytic
    assert plan_inference(_recipe("tiny-llama"), Target("cpu"), w).kv_cache == analytic
    # BLIP-2 OPT: the 4 query tokens and BOS come before the prompt; 4 heads of 16, no GQA
    cfg = _config("tiny-blip2-opt")
    w = Workload("caption", 3, 5, 7, torch.float32)
    analytic = 2 * 2 * 4 * 16 * ((4 + 1 + 5) + 7 - 1) * 3 * 4
    assert kv_cache_bytes(cfg, w) == analytic
    assert simulate(cfg, "image-to-text", w, cuda=False).cache == analytic
    # BLIP-2 Flan-T5: decoder self-attention over start + 7 − 1 tokens, cross-attention over the encoder's
    # 4 image tokens + 5 prompt tokens + EOS; 2 decoder layers, 4 heads of d_kv 16
    cfg = _config("tiny-blip2-t5")
    analytic = 2 * 2 * 4 * 16 * (7 + (4 + 5 + 1)) * 3 * 4
    assert kv_cache_bytes(cfg, w) == analytic
    assert simulate(cfg, "image-to-text", w, cuda=False).cache == analytic


def test_real_size_kv_cache_respects_gqa():
    # Llama-3-8B: 32 layers, 8 key/value heads (of 32), head_dim 128; bf16, batch 16 × (512 + 128 − 1) tokens
    cfg = _config("meta-llama/Meta-Llama-3-8B")
    w = Workload("generate", 16, 512, 128, torch.bfloat16)
    assert kv_cache_bytes(cfg, w) == 2 * 32 * 8 * 128 * (512 + 127) * 16 * 2


def test_depth_extrapolation_matches_a_deeper_measurement():
    """Planned from 2- and 3-layer simulations, measured on a real 5-layer model."""
    cfg = copy.deepcopy(_config("tiny-llama"))
    cfg.num_hidden_layers = 5
    w = Workload("generate", 6, 24, 10, torch.float32)
    extrapolated = simulate_full_depth(cfg, "causal-lm", w, cuda=False)
    direct = simulate(cfg, "causal-lm", w, cuda=False)
    assert extrapolated.weights == direct.weights and extrapolated.cache == direct.cache
    for ph in direct.phases:
        assert abs(extrapolated.phases[ph] - direct.phases[ph]) <= 0.001 * direct.phases[ph], ph
    measured = measure_cpu(cfg, "causal-lm", w)
    assert abs(max(extrapolated.phases.values()) - measured["peak"]) / measured["peak"] < 0.05


def test_largest_batch_fits_and_one_more_does_not():
    r = _recipe("tiny-opt")
    w = Workload("generate", 4, 32, 16, torch.float32)
    cap_gib = (CUDA_CONTEXT_BYTES + 6 * 2**20) / GIB  # 6 MiB above the context
    target = Target("cuda", custom_gpu(cap_gib, find_gpu("a10g")))
    p = plan_inference(r, target, w)
    m = p.max_batch_size
    assert m and m > 1
    at = plan_inference(r, target, dataclasses.replace(w, batch_size=m), search_batch=False)
    above = plan_inference(r, target, dataclasses.replace(w, batch_size=m + 1), search_batch=False)
    assert at.fits and not above.fits
    # reserved is the caching allocator's: whole 2 MiB segments, at least the allocated peak; what must fit
    # (its least capacity + context) lies between allocated + context and reserved + context
    assert at.peak_reserved % (2 * MiB) == 0 and at.peak_reserved >= at.peak_allocated
    assert at.peak_total == at.peak_reserved + CUDA_CONTEXT_BYTES
    assert at.peak_allocated + CUDA_CONTEXT_BYTES <= at.needed_total <= at.peak_total


def test_cuda_reserved_is_a_caching_allocator_replay_not_a_ratio():
    """Reserved on a GPU comes from replaying the batch's storages through the caching allocator model; on
    a CPU nothing is replayed."""
    from bigtune.plan.device.allocator import round_size, segment_size

    a10g = Target("cuda", find_gpu("a10g"))
    # tiny-opt: every storage is at most 1 MiB (the small pool) and at most 0.6 MiB are alive at once, so one
    # 2 MiB small-pool segment holds the whole batch
    w = Workload("generate", 4, 16, 8, torch.bfloat16)
    tiny = simulate(_config("tiny-opt"), "causal-lm", w, cuda=True)
    assert max(tiny.phases.values()) < 0.6 * MiB and tiny.reserved == tiny.needed == 2 * MiB
    cpu = simulate(_config("tiny-opt"), "causal-lm", w, cuda=False)
    assert cpu.reserved == cpu.needed == 0  # nothing replayed on a CPU
    # OPT-1.3b: its 8 MiB attention weights share 20 MiB segments two by two (the third does not fit the
    # 4 MiB left), so reserved is well above allocated; nf4 weights are replayed at their packed sizes
    r, cfg = _recipe("facebook/opt-1.3b"), _config("facebook/opt-1.3b")
    w = Workload("generate", 1, 16, 2, torch.float16)
    dense = plan_inference(r, a10g, w, config=cfg, search_batch=False)
    q = plan_inference(r, a10g, dataclasses.replace(w, quantize="nf4"), config=cfg, search_batch=False)
    ratios = []
    for p in (dense, q):
        assert p.peak_reserved % (2 * MiB) == 0 and p.peak_reserved >= p.peak_allocated
        assert p.peak_allocated + CUDA_CONTEXT_BYTES <= p.needed_total <= p.peak_total
        ratios.append(p.peak_reserved / p.peak_allocated)
    ratios.append(tiny.reserved / max(tiny.phases.values()))
    assert min(abs(x - y) for i, x in enumerate(ratios) for y in ratios[i + 1 :]) > 0.02, ratios  # no one ratio
    # the dequantized temporary (fc1/fc2: 2048 × 8192 fp16 = 32 MiB) is allocated and reserved as its own segment
    sim = simulate_full_depth(cfg, "causal-lm", dataclasses.replace(w, quantize="nf4"), True, "sdpa", (8, 6))
    temporary = 2048 * 8192 * 2
    assert q.peak_allocated == max(sim.phases.values()) + temporary
    assert q.peak_reserved == sim.reserved + segment_size(round_size(temporary)) == sim.reserved + 32 * MiB
    assert q.needed_total == sim.needed + 32 * MiB + CUDA_CONTEXT_BYTES
    # the packed weights free at least the bytes they save: the 2 MiB packed attention weights also pack
    # tighter into the 20 MiB segments than the 8 MiB dense ones did (a fixed ratio would free 1.05 × as much)
    saved = dense.weights - q.weights
    assert saved <= dense.peak_reserved - (q.peak_reserved - 32 * MiB) < 1.15 * saved


def test_replayed_bytes_extrapolate_over_depth_like_the_training_planner():
    """The rule (simulate.replayed_over_depth) on made-up replays, then against a deeper model replayed whole."""
    from bigtune.plan.serving import replayed_at_depth

    def sim(allocated: int, reserved: int, needed: int) -> dict:
        return {"phase:prefill": allocated * MiB, "phase:decode": 0, "reserved": reserved * MiB, "needed": needed * MiB}

    # the slope between the depths and the deeper ratio agree: 1.2 (reserved) and 1.1 (need) at 1000 MiB
    assert replayed_at_depth(sim(100, 120, 110), sim(150, 180, 165), sim(1000, 0, 0)) == (1200 * MiB, 1100 * MiB, 0)
    # a slope below 1 (cached blocks absorbed the deeper layer) counts as 1: 160 + 850 = 1010 by the slope,
    # 1000 × 160 / 150 = 1066.7 by the ratio; their mean, 1038.3, rounded up to whole 2 MiB
    assert replayed_at_depth(sim(100, 140, 140), sim(150, 160, 160), sim(1000, 0, 0))[:2] == (1040 * MiB, 1040 * MiB)
    # never below the full-depth allocated bytes (999 MiB, then whole segments), the need never above reserved
    assert replayed_at_depth(sim(100, 100, 100), sim(150, 150, 150), sim(999, 0, 0))[:2] == (1000 * MiB, 1000 * MiB)
    assert replayed_at_depth(sim(100, 120, 130), sim(150, 180, 200), sim(1000, 0, 0))[:2] == (1200 * MiB, 1200 * MiB)
    # a 7B model's shapes, 12 layers: extrapolated from 4 and 8 layers vs replayed at 12 (within 2 %)
    cfg = copy.deepcopy(resolve_config_name(load_recipe(str(ROOT / "recipes" / "open-llama-7b-full.yaml")).model))
    cfg.num_hidden_layers = 12
    w = Workload("generate", 2, 128, 16, torch.bfloat16)
    direct = simulate(cfg, "causal-lm", w, cuda=True)
    extrapolated = simulate_full_depth(cfg, "causal-lm", w, cuda=True)
    assert extrapolated.phases == direct.phases
    assert extrapolated.reserved % (2 * MiB) == 0 and extrapolated.needed <= extrapolated.reserved
    for k in ("reserved", "needed"):
        assert abs(getattr(extrapolated, k) - getattr(direct, k)) < 0.02 * getattr(direct, k), k


def test_decode_estimate_is_bandwidth_bound_and_kv_grows_it():
    gpu = find_gpu("a10g")
    r = _recipe("facebook/opt-1.3b")
    cfg = _config("facebook/opt-1.3b")
    w = Workload("generate", 1, 128, 64, torch.float16)
    p = plan_inference(r, Target("cuda", gpu), w, config=cfg, search_batch=False)
    read = p.weights + p.kv_cache
    assert p.decode_step_s == pytest.approx(read / (gpu.mem_bandwidth_gbs * 1e9 * ASSUMED_DECODE_BW_EFFICIENCY))
    assert p.tokens_per_s == pytest.approx(w.new_tokens / p.batch_s)
    # a bigger batch shares the weight reads: more tokens/s
    big = plan_inference(r, Target("cuda", gpu), dataclasses.replace(w, batch_size=16), config=cfg, search_batch=False)
    assert big.tokens_per_s > 4 * p.tokens_per_s
    assert big.kv_cache == 16 * p.kv_cache


def test_quantized_weights_shrink_by_the_bitsandbytes_sizes():
    r16 = _recipe("facebook/opt-1.3b")
    cfg = _config("facebook/opt-1.3b")
    w = Workload("generate", 1, 16, 2, torch.float16)
    dense = plan_inference(r16, Target("cpu"), w, config=cfg, search_batch=False)
    q = plan_inference(r16, Target("cpu"), dataclasses.replace(w, quantize="nf4"), config=cfg, search_batch=False)
    # every decoder linear (not the tied head / embeddings) drops from 2 bytes to ~0.5 bytes a weight
    linear = 24 * (4 * 2048 * 2048 + 2 * 2048 * 8192)
    saved = dense.weights - q.weights
    assert 1.45 * linear < saved < 1.5 * linear


def test_cli_plan_for_generate_text_and_json(tmp_path):
    r = run_cli(
        "plan",
        "--for",
        "generate",
        "--model",
        "tiny-llama",
        "--gpu",
        "a10g",
        "--batch-size",
        "4",
        "--prompt-tokens",
        "16",
        "--max-new-tokens",
        "8",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    for words in ("KV cache", "FITS", "largest batch that fits", "tokens/s (estimate)", "host: request"):
        assert words in r.stdout
    # a tiny model on a 24 GB card: the search stops at BATCH_SEARCH_LIMIT and says so
    assert "largest batch that fits: 4096 or more (the search stops there)" in r.stdout
    r = run_cli("plan", "--for", "predict", "--model", "tiny-opt", "--batch-size", "2", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["plan"]
    assert p["task"] == "predict" and p["kv_cache"] == 0 and list(p["phases"]) == ["forward"]
    assert p["fits"] is None and p["host_ram_bytes"] >= 2 * GIB
    bad = run_cli("plan", "--for", "caption", "--model", "tiny-llama", cwd=tmp_path)
    assert bad.returncode == 2 and "image-to-text" in bad.stderr


def test_launch_slurm_takes_mem_and_cpus_from_the_host_plan(tmp_path):
    import math

    from bigtune.models.build import weights_dtype
    from bigtune.plan.planner import count_parameters
    from bigtune.plan.serving import weight_bytes

    recipe = ROOT / "recipes" / "open-llama-7b-full.yaml"
    r = load_recipe(str(recipe), ["accelerator=cpu"])
    cfg = resolve_config_name(r.model)
    dtype = weights_dtype(r.precision)
    wb = weight_bytes(cfg, "causal-lm", dtype)
    params = count_parameters(cfg) * torch.empty((), dtype=dtype).element_size()
    assert params <= wb < params * 1.0001  # + the rotary buffers
    res = run_cli(
        "launch",
        "slurm",
        str(recipe),
        "--gpus-per-node",
        "4",
        "--set",
        "data.num_workers=3",
        "--out",
        str(tmp_path / "job.sbatch"),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "job.sbatch").read_text()
    mem_gib = math.ceil(4 * (int(wb * 1.25) + 2 * GIB) / GIB)
    assert f"#SBATCH --mem={mem_gib}G" in text
    assert "#SBATCH --cpus-per-task=4" in text  # 1 + 3 workers
    assert "# --mem / --cpus-per-task from bigtune's host plan" in text
    # what the user gives wins
    res = run_cli(
        "launch",
        "slurm",
        str(recipe),
        "--mem",
        "500G",
        "--cpus-per-task",
        "12",
        "--out",
        str(tmp_path / "own.sbatch"),
        cwd=tmp_path,
    )
    own = (tmp_path / "own.sbatch").read_text()
    assert "#SBATCH --mem=500G" in own and "#SBATCH --cpus-per-task=12" in own and "host plan" not in own


# --- chat vision-language models: plan --for caption against the batch `bigtune caption` generates from ---
CHAT_VLM_CASES = [
    # preset, batch, new tokens, dtype, --image-size, tokens in place of each image's placeholder: Qwen's M-RoPE
    # and dynamic grid, Qwen2.5-VL's windows, LLaVA's CLIP, PaliGemma's prefix LM, PaliGemma 2's Gemma-2 (eager
    # attention), SmolVLM's tiles (the photos upscaled to 2×2 tiles + the whole image, its worst case: 5 × 4
    # image tokens and the tile text), LLaVA-NeXT's anyres (1×2 tiles + the base image, unpadded, row newlines)
    ("tiny-qwen2-vl", 4, 8, torch.float32, (32, 32), 4),
    ("tiny-qwen2.5-vl", 2, 3, torch.bfloat16, (32, 32), 4),
    ("tiny-llava", 4, 8, torch.float32, None, 16),
    ("tiny-paligemma", 2, 6, torch.bfloat16, None, 16),
    ("tiny-paligemma2", 4, 8, torch.float32, None, 16),
    ("tiny-smolvlm", 4, 8, torch.float32, None, 34),
    ("tiny-smolvlm", 2, 5, torch.bfloat16, (32, 32), 34),
    ("tiny-llava-next", 4, 8, torch.float32, (32, 32), 36),
    ("tiny-llava-next", 2, 5, torch.bfloat16, (32, 32), 36),
]


@pytest.mark.parametrize("model, b, n, dtype, size, image_tokens", CHAT_VLM_CASES)
def test_chat_vlm_caption_plan_matches_the_measured_generate(model, b, n, dtype, size, image_tokens):
    """The plan (vision tower in the prefill, image tokens + chat template in the KV cache) against the
    generate call `bigtune caption` makes, on the batch it builds from the bundled photos (32×32; Qwen and
    LLaVA-NeXT planned at --image-size 32x32), greedy with every row generating ``n`` tokens (no early EOS)."""
    from bigtune.data.images import DEMO_IMAGES, open_image
    from bigtune.data.vlm import ChatImageLayout, generation_batch
    from bigtune.models.build import attention_for, load_processor
    from bigtune.plan.serving import caption_workload, make_inputs

    r = _recipe(model, **{"model.family": "image-to-text"})
    cfg = resolve_config_name(r.model)
    w = Workload("caption", b, 0, n, dtype, image_size=size)
    plan = plan_inference(r, Target("cpu"), w)
    proc = load_processor(r.model)
    photos = [open_image(p) for p in sorted((DEMO_IMAGES / "images").glob("*.png"))[:b]]
    real = generation_batch(ChatImageLayout.for_model(proc, cfg, r.data.prompt), proc.image_processor, photos)
    real["pixel_values"] = real["pixel_values"].to(dtype)  # as caption casts them to the model's dtype
    planned = make_inputs(cfg, caption_workload(r, cfg, w))
    assert {k: v.shape for k, v in planned.items()} == {k: v.shape for k, v in real.items()}
    assert torch.equal(planned["input_ids"], real["input_ids"])  # the same prompt and image tokens
    measured = measure_cpu(cfg, r.model.family, w, attention_for(r.model, cfg)[0], inputs=real)
    assert plan.weights == measured["weights"]
    assert plan.image_tokens == image_tokens and plan.lm_prompt_tokens == real["input_ids"].shape[1]
    assert plan.kv_cache == kv_cache_bytes(cfg, caption_workload(r, cfg, w))
    assert abs(plan.peak_allocated - measured["peak"]) / measured["peak"] < 0.02, (plan.peak_allocated, measured)


def test_chat_vlm_caption_plan_cli(tmp_path):
    """The worst case follows data.image_max_pixels; --image-size plans that size; a chat model's
    --prompt-tokens is refused with the fix."""
    demo = str(ROOT / "recipes" / "gourmetgram-qwen2-vl-demo.yaml")
    res = run_cli("plan", demo, "--for", "caption", "--batch-size", "2", "--max-new-tokens", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "16 image tokens" in res.stdout and "the worst case, the processor's max_pixels=12544" in res.stdout
    budget = ("--set", "data.image_max_pixels=3136", "--json")
    res = run_cli("plan", demo, "--for", "caption", "--batch-size", "2", "--max-new-tokens", "4", *budget, cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["plan"]["image_tokens"] == 4, res.stderr
    res = run_cli("plan", demo, "--for", "caption", "--image-size", "100x80", "--json", cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["plan"]["image_tokens"] == 12, res.stderr
    bad = run_cli("plan", demo, "--for", "caption", "--prompt-tokens", "8", cwd=tmp_path)
    assert bad.returncode == 2 and "data.prompt in its chat template" in bad.stderr, bad.stderr


def test_tiled_vlm_caption_plan_cli(tmp_path):
    """SmolVLM and LLaVA-NeXT: the worst case is their largest tile grid, --image-size plans the grid that
    size fits; a fixed-size model's --image-size is refused with the reason."""
    demo = str(ROOT / "recipes" / "gourmetgram-qwen2-vl-demo.yaml")
    # SmolVLM: the worst case is a square image at its longest edge (2×2 tiles + the whole image); a 30×90 photo
    # is 1×2 tiles + the whole image: 3 × 4 image tokens and the tile text around them
    res = run_cli("plan", demo, "--for", "caption", "--model", "tiny-smolvlm", "--batch-size", "2", cwd=tmp_path)
    assert res.returncode == 0 and "2×2 tiles of 32 px + the whole image (34 image tokens)" in res.stdout, res.stderr
    res = run_cli(
        "plan", demo, "--for", "caption", "--model", "tiny-smolvlm", "--image-size", "30x90", "--json", cwd=tmp_path
    )
    assert res.returncode == 0 and json.loads(res.stdout)["plan"]["image_tokens"] == _smolvlm_tokens(1, 2), res.stderr
    # LLaVA-NeXT: the worst case is its largest pinpoint (64×64: 2×2 tiles + the base image, 88 tokens); a 30×90
    # photo fits 1×3 tiles (68 tokens)
    res = run_cli("plan", demo, "--for", "caption", "--model", "tiny-llava-next", "--json", cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["plan"]["image_tokens"] == 88, res.stderr
    res = run_cli("plan", demo, "--for", "caption", "--model", "tiny-llava-next", "--image-size", "30x90", cwd=tmp_path)
    assert res.returncode == 0 and "30×90 px: 1×3 tiles of 32 px + the whole image (68 image tokens)" in res.stdout
    bad = run_cli("plan", demo, "--for", "caption", "--model", "tiny-llava", "--image-size", "30x90", cwd=tmp_path)
    assert bad.returncode == 2 and "sees images at a fixed size" in bad.stderr, bad.stderr


def _smolvlm_tokens(rows: int, cols: int) -> int:
    """Tokens in place of a tiny-smolvlm image split into rows × cols tiles, as its processor writes them."""
    from bigtune.data.vlm import ChatImageLayout
    from bigtune.models.build import load_processor

    r = _recipe("tiny-smolvlm", **{"model.family": "image-to-text"})
    layout = ChatImageLayout.for_model(load_processor(r.model), resolve_config_name(r.model), r.data.prompt)
    return len(layout.split.ids(rows, cols))


# --- the shortcuts that keep plans fast, each against the slow path it replaces ---
REPEAT_CASES = [
    # decoder-only (Llama: GQA, RoPE), OPT in bf16, BLIP-2 T5 (an encoder-decoder: self- and cross-attention caches),
    # a chat VLM (Qwen2-VL: M-RoPE positions from rope_deltas)
    ("tiny-llama", "generate", 3, 12, 20, torch.float32),
    ("tiny-opt", "generate", 5, 8, 16, torch.bfloat16),
    ("tiny-blip2-t5", "caption", 2, 0, 14, torch.float32),
    ("tiny-qwen2-vl", "caption", 2, 0, 14, torch.float32),
]


@pytest.mark.parametrize("model, task, b, p, n, dtype", REPEAT_CASES)
def test_decode_steps_that_repeat_are_written_not_run(model, task, b, p, n, dtype):
    """DecodeRepeat: once three decode steps repeat, the loop stops and the rest are written from the last one.
    Phase peaks, the cache at the end and the caching allocator's replay (reserved, least capacity) equal a
    simulation that runs every step, on a GPU target and on a CPU."""
    from unittest import mock

    from bigtune.plan.serving import DecodeRepeat, caption_workload

    r = _recipe(model, **({"model.family": "image-to-text"} if model.startswith("tiny-qwen") else {}))
    cfg = resolve_config_name(r.model)
    w = Workload(task, b, p, n, dtype, image_size=(32, 32) if model.startswith("tiny-qwen") else None)
    w = caption_workload(r, cfg, w) if task == "caption" else w
    for cuda in (True, False):
        with mock.patch.object(DecodeRepeat, "complete", autospec=True, side_effect=DecodeRepeat.complete) as spy:
            fast = simulate(cfg, r.model.family, w, cuda)
        slow = simulate(cfg, r.model.family, w, cuda, repeat=False)
        assert spy.call_count == 1 and spy.call_args.args[0].cut <= 6 < n - 1  # six forwards at most ran
        assert fast.scalars() == slow.scalars(), (cuda, fast.scalars(), slow.scalars())
        assert fast.cache == kv_cache_bytes(cfg, w)


def test_decode_steps_past_a_sliding_window_are_run():
    """Gemma-2's sliding window (16 tokens on alternate layers) stops its cache from growing mid-decode: the steps
    compared before it do not predict those after it, so they run until past it (and written blindly they would
    be wrong)."""
    from unittest import mock

    cfg = _config("tiny-gemma2")
    w = Workload("generate", 2, 6, 24, torch.float32)
    slow = simulate(cfg, "causal-lm", w, True, "eager", repeat=False)
    assert simulate(cfg, "causal-lm", w, True, "eager").scalars() == slow.scalars()
    with mock.patch("bigtune.plan.serving.length_thresholds", return_value=set()):
        blind = simulate(cfg, "causal-lm", w, True, "eager")
    assert blind.cache > slow.cache  # written blindly, the windowed layers would keep growing


def test_fake_model_kept_between_simulations_changes_nothing():
    """simulate keeps each fake model for the next simulation: after one at another batch size, the same
    simulation as on a freshly built model (BLIP-2; Qwen2-VL, which keeps its M-RoPE offsets on the model)."""
    from bigtune.plan import serving
    from bigtune.plan.serving import caption_workload

    for model in ("tiny-blip2-opt", "tiny-qwen2-vl"):
        r = _recipe(model, **{"model.family": "image-to-text"})
        cfg = resolve_config_name(r.model)

        def at(b: int) -> Workload:
            size = (32, 32) if model == "tiny-qwen2-vl" else None
            return caption_workload(r, cfg, Workload("caption", b, 0, 6, torch.float32, image_size=size))

        serving.FAKE_MODELS.clear()
        fresh = simulate(cfg, "image-to-text", at(5), True)
        serving.FAKE_MODELS.clear()
        simulate(cfg, "image-to-text", at(2), True)
        assert len(serving.FAKE_MODELS) == 1
        assert simulate(cfg, "image-to-text", at(5), True).scalars() == fresh.scalars(), model


WRITTEN_CASES = [
    # a decoder-only LM (GQA), BLIP-2 OPT captioning (vision tower, Q-Former), a classifier-style forward, nf4 weights
    ("tiny-llama", "generate", 16, 12, torch.float32, "none"),
    ("tiny-blip2-opt", "caption", 0, 8, torch.bfloat16, "none"),
    ("tiny-opt", "predict", 24, 0, torch.float32, "none"),
    ("tiny-llama", "generate", 8, 10, torch.bfloat16, "nf4"),
]


@pytest.mark.parametrize("model, task, p, n, dtype, quantize", WRITTEN_CASES)
def test_batch_written_from_two_traces_is_the_simulated_batch(model, task, p, n, dtype, quantize):
    """written_at: batch 11's trace written from those of batches 1 and 6 (every storage's size moved along
    the batch) against simulating batch 11: the same phase peaks, cache and caching-allocator replay. Each
    trace's own phase peaks, rebuilt from its events, are the tracker's."""
    from bigtune.plan.serving import phase_peaks, written_at

    r = _recipe(model)
    cfg = resolve_config_name(r.model)
    sims = {b: simulate(cfg, r.model.family, Workload(task, b, p, n, dtype, quantize), True) for b in (1, 6, 11)}
    for sim in sims.values():
        trace = sim.traces[2]
        assert [v + trace.delta for v in phase_peaks(trace.events, trace.resets, trace.round_to)] == list(
            sim.phases.values()
        )
    written = written_at(sims[1].traces[2], sims[6].traces[2], 11)
    assert written is not None and written.scalars() == sims[11].scalars()


def test_batch_traces_that_do_not_scale_are_not_written():
    """Qwen2-VL works out positions per image from its inputs' values: another batch size runs other
    operators, so its traces are not written (and the search simulates every batch size it tries)."""
    from bigtune.plan.serving import caption_workload, written_at

    r = _recipe("tiny-qwen2-vl", **{"model.family": "image-to-text"})
    cfg = resolve_config_name(r.model)
    traces = [
        simulate(
            cfg, "image-to-text", caption_workload(r, cfg, Workload("caption", b, 0, 4, torch.float32)), True
        ).traces[2]
        for b in (1, 3)
    ]
    assert written_at(*traces, 5) is None


def test_largest_batch_search_finds_the_edge_a_scan_finds():
    """The search against the slow path: every batch size from 1 up simulated until one does not fit. tiny-opt's
    need grows in whole 2 MiB segments (2 MiB up to batch 8, 4 MiB to 21, then 6): with 4 MiB above the context
    the scan stops at 22; the search, on needs written from batches 2 (the plan's) and 1 first, simulates 21
    and 22 only."""
    from unittest import mock

    from bigtune.plan import serving

    r, cfg = _recipe("tiny-opt"), _config("tiny-opt")
    w = Workload("generate", 2, 32, 16, torch.float32)
    target = Target("cuda", custom_gpu((CUDA_CONTEXT_BYTES + 4 * MiB) / GIB, find_gpu("a10g")))
    simulated = []
    real = serving.simulate_full_depth

    def counted(*args, **kwargs):
        simulated.append(args[2].batch_size)
        return real(*args, **kwargs)

    with mock.patch.object(serving, "simulate_full_depth", side_effect=counted):
        found = plan_inference(r, target, w, config=cfg).max_batch_size
    scan = 1
    while plan_inference(r, target, dataclasses.replace(w, batch_size=scan), config=cfg, search_batch=False).fits:
        scan += 1
    assert found == scan - 1 and sorted(set(simulated)) == [1, 2, 21, 22], (found, scan, simulated)


def test_largest_batch_search_proves_a_noisy_edge_in_few_simulations():
    """On needs shaped like BLIP-2 OPT-2.7B's (an affine line with segment noise of about one row, BLIP-2's
    52 MiB a row), the secant through the needs nearest the card proves the edge with one simulation each side
    once near it; the answer is an edge: it fits and one more does not."""
    from unittest import mock

    from bigtune.plan import serving

    def need(b: int) -> int:  # bytes the replay needs, + context
        return 16_000 * MiB + 52 * MiB * b + (37 * b % 61 - 30) * MiB

    def sim(b: int):  # allocated bytes affine in the batch, as simulated
        return serving.InferSim({"decode": 15_000 * MiB + 44 * MiB * b}, 0, 0, 0, 0, 0, 0, 0, need(b))

    asked = []

    def simulate_at(config, family, wb, *args):
        asked.append(wb.batch_size)
        return sim(wb.batch_size)

    target = Target("cuda", custom_gpu((need(146) + CUDA_CONTEXT_BYTES + 10 * MiB) / GIB, find_gpu("a10g")))
    cap = target.capacity_bytes
    for b2 in (1, 8, 64, 160):
        asked.clear()
        w = Workload("generate", b2, 16, 8, torch.float32)
        with mock.patch.object(serving, "simulate_full_depth", side_effect=simulate_at):
            m = serving.largest_batch(None, "causal-lm", w, target, "sdpa", sim(b2))
        assert need(m) + CUDA_CONTEXT_BYTES <= cap < need(m + 1) + CUDA_CONTEXT_BYTES, (b2, m)
        assert len(asked) <= 5, (b2, asked)
