"""Throughput features: the FLOP count against a hand count, chunked cross-entropy, sequence packing."""

from __future__ import annotations

import pytest
import torch

from bigtune.models import build_model, load_tokenizer
from bigtune.recipe import load_recipe
from bigtune.stepmath import FlopShape, causal_pairs, flop_shape, model_flops_per_token, training_flops


def tiny_llama():
    r = load_recipe({}, {"model.name": "tiny-llama"})
    tok = load_tokenizer(r.model)
    return build_model(r.model, tok, "32-true", 0), tok


# -- FLOPs ----------------------------------------------------------------------------------------------

def test_flops_match_a_hand_count_for_the_tiny_llama():
    model, _ = tiny_llama()
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size) == (64, 176, 2, 4, 2, 512)
    h, ffn, layers, head_dim, vocab = 64, 176, 2, 16, 512
    q_width, kv_width = 4 * head_dim, 2 * head_dim           # GQA: 4 query heads, 2 key/value heads
    per_layer = (h * q_width          # q_proj
                 + h * kv_width       # k_proj
                 + h * kv_width       # v_proj
                 + q_width * h        # o_proj
                 + h * ffn            # gate_proj
                 + h * ffn            # up_proj
                 + ffn * h)           # down_proj
    matmul_weights = layers * per_layer + h * vocab          # + lm_head (untied); the embedding is a lookup
    assert matmul_weights == 2 * (4096 + 2048 + 2048 + 4096 + 3 * 11264) + 32768

    # One causal row of s tokens: token t attends t+1 keys (itself and the earlier ones).
    s = 10
    pairs = s * (s + 1) // 2
    forward = 2 * matmul_weights * s + layers * (2 * q_width + 2 * q_width) * pairs  # q·k and p·v per pair
    hand = 3 * forward                                         # backward: input and weight gradients, 2× forward
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
