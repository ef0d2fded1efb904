"""Tensor parallelism (tensor_parallel > 1) on CPU gloo ranks: the same losses and weights as one process,
a 2-D mesh (data parallel × tensor parallel), exact resume from a sharded checkpoint, and the refusals.

Tolerances: the split projections sum their partial products across ranks in another order than one
process does (row-wise layers all-reduce two halves), so float32 results differ in the last bits; the
losses agree to rel 1e-5 and the exported weights to atol 1e-5 (measured: 1e-7 and 1e-8), the bounds
test_dist.py uses for DDP and FSDP. A resumed run repeats the same ranks' arithmetic: its losses are exact.
"""

from __future__ import annotations

import pytest
import transformers

from bigtune.recipe import RecipeError, load_recipe
from conftest import read_jsonl, resume_from_step_3, run_cli, run_losses, same_weights, set_args, train_cli
from test_dist import COMMON  # the same tiny-Llama run settings as the DDP / FSDP tests


def _train(tmp_path, name, **over):
    return train_cli(tmp_path, name, COMMON, **over)


# A clip that bites: the tiny Llama's first gradients have a norm above 1, so the global norm over DTensors
# on two meshes is exercised (a per-rank norm would clip differently and change the losses).
CLIPPED = {"optim.grad_clip": 0.5}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("single"), "run", **{"train.micro_batch_size": 8, **CLIPPED})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_two_ranks_equal_one_process(tmp_path, single, sequence_parallel):
    # TP=2 on 2 processes: one data-parallel rank, so each rank reads the whole micro-batch of 8. With sequence
    # parallelism each rank's norms and residual stream hold half of the (even-padded) sequence: the same
    # tolerances (measured: identical losses but for one step at rel 1e-7).
    sp = {"sequence_parallel": True} if sequence_parallel else {}
    run = _train(
        tmp_path, "tp2", devices=2, strategy="fsdp", tensor_parallel=2, **{"train.micro_batch_size": 8, **CLIPPED, **sp}
    )
    assert run_losses(run) == pytest.approx(run_losses(single), rel=1e-5)
    same_weights(run, single)  # gathered to a plain HF folder: full shapes, the same names
    metrics = read_jsonl(run / "metrics.jsonl")
    # tokens counted once per tensor-parallel group, not once per rank
    assert [m["tokens"] for m in metrics] == [m["tokens"] for m in read_jsonl(single / "metrics.jsonl")]
    if not sequence_parallel:  # once is enough
        unclipped = _train(tmp_path, "unclipped", **{"train.micro_batch_size": 8})
        assert run_losses(unclipped)[1:] != pytest.approx(run_losses(single)[1:], rel=1e-5), (
            "the clip must change the run"
        )


def test_sequence_parallel_pads_odd_lengths(tmp_path):
    # Unpacked demo rows at max_seq_length 512 give a first batch of 54 tokens, a second of 67: sequence
    # parallelism pads it to 68 (label -100, masked) so each rank holds half; the real tokens' losses stay.
    over = {"data.max_seq_length": 512, "train.micro_batch_size": 2, "train.max_steps": 2}
    one = _train(tmp_path, "one", **over)
    sp = _train(tmp_path, "sp", devices=2, strategy="fsdp", tensor_parallel=2, sequence_parallel=True, **over)
    lengths = sorted({m["batch_shape"][1] for m in read_jsonl(one / "memory.jsonl")})
    assert any(n % 2 for n in lengths), lengths
    assert [n + n % 2 for n in lengths] == sorted({m["batch_shape"][1] for m in read_jsonl(sp / "memory.jsonl")})
    assert run_losses(sp) == pytest.approx(run_losses(one), rel=1e-5)


def test_two_dimensional_mesh_equals_one_process(tmp_path, single):
    # 4 ranks: 2 data-parallel groups of 2 tensor-parallel ranks; micro-batch 4 per group = the single run's 8.
    run = _train(
        tmp_path, "dp2tp2", devices=4, strategy="fsdp", tensor_parallel=2, **{"train.micro_batch_size": 4, **CLIPPED}
    )
    assert run_losses(run) == pytest.approx(run_losses(single), rel=1e-5)
    same_weights(run, single)


def test_tensor_parallel_resume_continues_exactly(tmp_path):
    over = {
        "devices": 2,
        "strategy": "fsdp",
        "tensor_parallel": 2,
        "train.micro_batch_size": 4,
        "train.max_steps": 6,
        "checkpoint.enabled": True,
        "checkpoint.every_steps": 3,
        "checkpoint.keep_last": 5,
        "optim.name": "adamw",
        "optim.lr": 1e-3,
    }
    ref = _train(tmp_path, "ref", **over)
    assert (ref / "checkpoints" / "step-000003.ckpt").is_dir(), "a distributed checkpoint of DTensor shards"
    cut = resume_from_step_3(tmp_path, ref, COMMON, over)
    assert run_losses(cut) == run_losses(ref)
    same_weights(cut, ref, atol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["devices=3", "strategy=fsdp", "tensor_parallel=2"], "tensor_parallel: 2 does not divide devices × num_nodes"),
        (["devices=2", "strategy=ddp", "tensor_parallel=2"], "set strategy=fsdp"),
        (["devices=2", "strategy=fsdp", "tensor_parallel=2", "peft.method=lora"], "with peft.method=lora"),
        (["devices=2", "strategy=fsdp", "tensor_parallel=2", "fsdp_wrap=none"], "with fsdp_wrap=none"),
        (["devices=2", "strategy=fsdp", "tensor_parallel=2", "model.quantize=nf4"], "with model.quantize=nf4"),
        (["devices=2", "strategy=fsdp", "sequence_parallel=true"], "sequence_parallel=true needs tensor_parallel > 1"),
        (
            ["devices=2", "strategy=fsdp", "tensor_parallel=2", "sequence_parallel=true", "data.max_seq_length=63"],
            "data.max_seq_length=63 is not a multiple of tensor_parallel=2",
        ),
    ],
)
def test_unsupported_recipes_are_refused(overrides, message):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["accelerator=cpu", *overrides])
    assert message in str(e.value)


def test_batch_sizes_count_data_parallel_ranks():
    r = load_recipe(
        None, ["accelerator=cpu", "devices=4", "strategy=fsdp", "tensor_parallel=2", "train.micro_batch_size=2"]
    )
    assert r.data_parallel_size == 2
    assert r.global_batch_size == 2 * r.accumulate * 2


def _tiny(config_class, **kw):
    config = getattr(transformers, config_class)(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, **kw
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def test_plan_is_read_from_the_config_and_checked_against_the_model():
    from bigtune.engine.strategies import tensor_parallel_plan

    llama = _tiny("LlamaConfig", num_key_value_heads=2, intermediate_size=176)
    plan_names = {k: type(v).__name__ for k, v in tensor_parallel_plan(llama, 2).items()}
    assert plan_names == {
        "self_attn.q_proj": "ColwiseParallel",
        "self_attn.k_proj": "ColwiseParallel",
        "self_attn.v_proj": "ColwiseParallel",
        "self_attn.o_proj": "RowwiseParallel",
        "mlp.gate_proj": "ColwiseParallel",
        "mlp.up_proj": "ColwiseParallel",
        "mlp.down_proj": "RowwiseParallel",
    }
    sp = {k: type(v).__name__ for k, v in tensor_parallel_plan(llama, 2, sequence_parallel=True).items()}
    assert sp == {
        "input_layernorm": "SequenceParallel",
        "post_attention_layernorm": "SequenceParallel",
        "self_attn": "PrepareModuleInput",  # Shard(1) → Replicate: the all-gather
        "mlp": "PrepareModuleInput",
        **plan_names,  # the same projection styles; the row-wise ones reduce-scatter to Shard(1)
    }
    with pytest.raises(RecipeError) as e:  # 4 heads, 2 KV heads, width 176: none divides by 3
        tensor_parallel_plan(llama, 3)
    for key in ("num_attention_heads=4", "num_key_value_heads=2", "intermediate_size=176"):
        assert key in str(e.value)
    # Qwen3's per-head q/k norms need their gradients summed across the group: refused, not silently wrong
    with pytest.raises(RecipeError, match="'replicated_with_grad_allreduce' for self_attn.q_norm"):
        tensor_parallel_plan(_tiny("Qwen3Config", num_key_value_heads=2, head_dim=16), 2)
    # OPT has no plan in its config, and its out_proj / fc1 / fc2 are not Llama's names
    with pytest.raises(RecipeError, match="has no nn.Linear self_attn.o_proj, mlp.gate_proj"):
        tensor_parallel_plan(_tiny("OPTConfig", ffn_dim=128), 2)


def test_plan_names_the_tensor_parallel_layout(tmp_path):
    """`bigtune plan` of a TP recipe plans one tensor-parallel rank (tests/test_plan_tensor_parallel.py checks
    the numbers against a run) and says how the ranks are laid out."""
    res = run_cli("plan", *set_args({"devices": 2, "strategy": "fsdp", "tensor_parallel": 2}), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 data-parallel × 2 tensor-parallel ranks" in res.stdout
    assert "NOT planned" not in res.stdout
