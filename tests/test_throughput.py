"""Throughput features: the FLOP count against a hand count, chunked cross-entropy, sequence packing."""

from __future__ import annotations

import pytest
import torch

from bigtune.core.stepmath import FlopShape, causal_pairs, flop_shape, model_flops_per_token, training_flops
from bigtune.models.build import build_model, load_tokenizer
from bigtune.recipe import load_recipe


def tiny_llama():
    r = load_recipe({}, {"model.name": "tiny-llama"})
    tok = load_tokenizer(r.model)
    return build_model(r.model, tok, "32-true", 0), tok


# -- FLOPs ----------------------------------------------------------------------------------------------


def test_flops_match_a_hand_count_for_the_tiny_llama():
    model, _ = tiny_llama()
    c = model.config
    assert (
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
    ) == (64, 176, 2, 4, 2, 512)
    h, ffn, layers, head_dim, vocab = 64, 176, 2, 16, 512
    q_width, kv_width = 4 * head_dim, 2 * head_dim  # GQA: 4 query heads, 2 key/value heads
    per_layer = (
        h * q_width  # q_proj
        + h * kv_width  # k_proj
        + h * kv_width  # v_proj
        + q_width * h  # o_proj
        + h * ffn  # gate_proj
        + h * ffn  # up_proj
        + ffn * h
    )  # down_proj
    matmul_weights = layers * per_layer + h * vocab  # + lm_head (untied); the embedding is a lookup
    assert matmul_weights == 2 * (4096 + 2048 + 2048 + 4096 + 3 * 11264) + 32768

    # One causal row of s tokens: token t attends t+1 keys (itself and the earlier ones).
    s = 10
    pairs = s * (s + 1) // 2
    forward = 2 * matmul_weights * s + layers * (2 * q_width + 2 * q_width) * pairs  # q·k and p·v per pair
    hand = 3 * forward  # backward: input and weight gradients, 2× forward
    shape = flop_shape(model)
    assert shape == FlopShape(layers, q_width, matmul_weights, 0)
    assert causal_pairs(torch.ones(1, s, dtype=torch.long)) == pairs
    assert training_flops(shape, s, pairs) == hand
    assert model_flops_per_token(model, s) * s == pytest.approx(hand, rel=1e-12)

    # The matmul part agrees with torch's own FLOP counter on a real forward.
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(3, vocab, (1, s)))
    counts = counter.get_flop_counts()["Global"]
    linear = sum(v for k, v in counts.items() if "mm" in str(k))
    assert linear == 2 * matmul_weights * s


def test_flops_of_packed_and_padded_rows_and_frozen_weights():
    # Two documents of 3 and 2 tokens packed in one row, then one padding token: 3·4/2 + 2·3/2 pairs.
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert causal_pairs(mask, pos) == 6 + 3
    # Right padding without position ids: only real tokens count.
    assert causal_pairs(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])) == 6 + 3
    # A frozen weight costs forward + input gradient (4 per weight per token), a trained one 6.
    shape = FlopShape(n_layers=1, attn_dim=8, trainable_matmul_params=10, frozen_matmul_params=100)
    assert training_flops(shape, tokens=1, causal_pairs=0) == 6 * 10 + 4 * 100
    assert training_flops(shape, tokens=0, causal_pairs=1) == 3 * 4 * 8


def test_flops_count_zero3_partitioned_weights_at_their_real_size():
    # Under ZeRO-3 a weight is an empty placeholder; DeepSpeed keeps its real size in ds_numel. The
    # MFU must not drop to zero because the weights are partitioned.
    model, _ = tiny_llama()
    full = flop_shape(model)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            n = mod.weight.numel()
            mod.weight = torch.nn.Parameter(torch.empty(0), requires_grad=mod.weight.requires_grad)
            mod.weight.ds_numel = n
    assert flop_shape(model) == full and full.trainable_matmul_params > 0


# -- chunked cross-entropy ------------------------------------------------------------------------------


def test_chunked_loss_equals_the_plain_loss_with_gradients():
    from bigtune.core.stepmath import IGNORE_INDEX, causal_lm_loss_sum, chunked_lm_loss_sum

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(97, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 97, (3, 11), generator=g)
    labels[0, 4:] = IGNORE_INDEX  # padding
    labels[2, :3] = IGNORE_INDEX  # a masked prompt
    plain = causal_lm_loss_sum(hidden @ weight.T, labels)
    grads = torch.autograd.grad(plain, (hidden, weight))
    for chunk in (1, 5, 7, 33, 1000):  # chunks that do and do not divide the 33 tokens
        chunked = chunked_lm_loss_sum(hidden, weight, labels, chunk)
        assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)  # both sum in fp32
        for a, b in zip(torch.autograd.grad(chunked, (hidden, weight)), grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # encoder-decoder labels are already aligned (no shift)
    plain = causal_lm_loss_sum(hidden @ weight.T, labels, shift=False)
    assert chunked_lm_loss_sum(hidden, weight, labels, 4, shift=False).item() == pytest.approx(plain.item(), rel=1e-6)


@pytest.fixture(scope="module")
def large_vocab_model(tmp_path_factory):
    """A tiny Llama with a 16k vocabulary (the logits dominate its activations, as in real models)."""
    from transformers import LlamaConfig

    from bigtune.core.presets import tiny_tokenizer

    d = tmp_path_factory.mktemp("large-vocab")
    tok = tiny_tokenizer()
    LlamaConfig(
        vocab_size=16384,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    ).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize("precision, rel", [("32-true", 1e-5), ("bf16-true", 2e-3)])
def test_chunked_loss_trains_identically_with_less_memory_and_the_planner_follows(
    tmp_path, large_vocab_model, precision, rel
):
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan
    from bigtune.run.training import train
    from conftest import read_jsonl, tiny_overrides

    runs = {}
    for chunk in (None, 128):
        over = tiny_overrides(
            tmp_path / f"run{chunk}",
            **{
                "model.name": str(large_vocab_model),
                "model.init": "random",
                "data.max_seq_length": 128,
                "train.micro_batch_size": 4,
                "train.accumulate_grad_batches": 2,
                "train.loss_chunk_tokens": chunk,
                "memory.plan": False,
                "optim.grad_clip": 1.0,
                "precision": precision,
            },
        )
        s = train({}, over, quiet_recipe=True)
        losses = [m["loss"] for m in read_jsonl(tmp_path / f"run{chunk}" / "metrics.jsonl")]
        snaps = read_jsonl(tmp_path / f"run{chunk}" / "memory.jsonl")
        shape = next(x["batch_shape"] for x in snaps if x["step"] == 2)
        padded = next(x["padded"] for x in snaps if x["step"] == 2)
        measured = max(x["peak_allocated"] for x in snaps if x["step"] == 2)
        like = load_recipe({}, {**over, "train.micro_batch_size": shape[0], "data.max_seq_length": shape[1]})
        predicted = plan(like, Target("cpu"), padded=padded).peak_allocated
        runs[chunk] = (losses, s["peak_allocated_bytes"], measured, predicted)
        print(
            f"loss_chunk_tokens={chunk}: losses {losses}, peak allocated {s['peak_allocated_bytes'] / 2**20:.1f} MiB"
            f" (step 2: measured {measured / 2**20:.2f} MiB, planned {predicted / 2**20:.2f} MiB)"
        )
    (plain, plain_peak, *_), (chunked, chunked_peak, measured, predicted) = runs[None], runs[128]
    assert chunked == pytest.approx(plain, rel=rel)
    assert chunked_peak < 0.8 * plain_peak  # the fp32 logits (tokens × 16k × 4 bytes) are never whole
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)


# -- packing and length grouping ------------------------------------------------------------------------


def _loss_sum(model, batch):
    from bigtune.core.stepmath import causal_lm_loss_sum, target_token_count
    from bigtune.models.build import forward_inputs

    logits = model(**forward_inputs(batch, batch["padded"])).logits
    return causal_lm_loss_sum(logits, batch["labels"]).double(), int(target_token_count(batch["labels"]))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batch_has_the_loss_of_the_same_samples_unpacked(attn):
    from bigtune.data.text import Collator, build_examples, pack_examples

    r = load_recipe(
        {},
        {
            "model.name": "tiny-llama",
            "data.max_seq_length": 200,
            "model.attn_implementation": attn,
            "data.mask_prompt": False,
        },
    )
    tok = load_tokenizer(r.model)
    examples, _ = build_examples(r.data, tok, r.seed)
    examples = examples[:12]
    model = build_model(r.model, tok, "32-true", 0).eval()
    collate = Collator(tok.pad_token_id)
    rows = pack_examples(examples, 200, seed=0)
    assert sum(x.samples for x in rows) == 12 and len(rows) < 12 and max(len(x.input_ids) for x in rows) <= 200
    assert any(x.samples > 1 for x in rows)
    with torch.no_grad():
        # unpacked: every sample alone (no padding at all), summed and weighted by its target tokens
        alone = [_loss_sum(model, collate([e])) for e in examples]
        packed_batch = collate(rows)
        assert packed_batch["padded"] is False and packed_batch["samples"] == 12
        packed = _loss_sum(model, packed_batch)
        # the same samples in padded rows, as the engine batches them without packing
        padded = _loss_sum(model, collate(examples))
    unpacked_sum, unpacked_tokens = sum(x[0] for x in alone), sum(x[1] for x in alone)
    assert packed[1] == unpacked_tokens == padded[1]
    assert float(packed[0] / packed[1]) == pytest.approx(float(unpacked_sum / unpacked_tokens), rel=1e-5)
    assert float(padded[0] / padded[1]) == pytest.approx(float(unpacked_sum / unpacked_tokens), rel=1e-5)
    # Without the position ids the rows would attend across samples: the loss differs (the check has teeth).
    cross = {k: v for k, v in packed_batch.items() if k != "position_ids"}
    with torch.no_grad():
        leaked = _loss_sum(model, cross)
    # (random weights attend almost uniformly, so the leak is small, but far above the 1e-5 agreement above)
    assert abs(float(leaked[0] - packed[0])) / float(packed[0]) > 2e-4


def test_packing_and_grouping_train_with_the_engine(tmp_path):
    from bigtune.data.text import EpochSampler
    from bigtune.run.training import train
    from conftest import read_jsonl, tiny_overrides

    sums = {}
    for mode in ("plain", "packing", "group_by_length"):
        over = tiny_overrides(
            tmp_path / mode,
            **{
                "data.max_seq_length": 128,
                "train.max_steps": None,
                "train.max_epochs": 1,
                "memory.enabled": False,
                "memory.plan": False,
                "train.micro_batch_size": 4,
            },
        )
        if mode != "plain":
            over[f"data.{mode}"] = True
        s = train({}, over, quiet_recipe=True)
        m = read_jsonl(tmp_path / mode / "metrics.jsonl")
        sums[mode] = s
        assert s["status"] == "ok" and all(torch.isfinite(torch.tensor(x["loss"])) for x in m)
    # One epoch sees every sample and every token once, whatever the batching.
    assert sums["packing"]["samples"] == sums["plain"]["samples"] == sums["group_by_length"]["samples"]
    assert sums["packing"]["tokens"] == sums["plain"]["tokens"] == sums["group_by_length"]["tokens"]
    assert sums["packing"]["steps"] < sums["plain"]["steps"]
    # Grouping: a permutation whose groups run longest first.
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    s = EpochSampler(8, seed=0, lengths=lengths, group_size=4)
    order = s.order()
    assert sorted(order) == list(range(8))
    for i in (0, 4):
        assert [lengths[j] for j in order[i : i + 4]] == sorted((lengths[j] for j in order[i : i + 4]), reverse=True)
