"""Tensor parallelism (recipe ``tensor_parallel``) in the plan: what one rank of a tensor-parallel group
computes and holds, and the collectives between the group's ranks.

The engine (engine/strategies.py) splits every decoder block's projections across the ``tp`` ranks of a
group: q/k/v and the MLP's gate/up column-wise (each rank computes 1/tp of the heads and of the MLP's width),
o_proj and down_proj row-wise (each rank multiplies its slice; the partial outputs are all-reduced to the
whole hidden state). Embeddings, norms and the output layer stay whole on every rank of the group, and every
rank reads the same micro-batches. So one rank runs, physically, the same model with 1/tp of the attention
heads (key/value heads too) and 1/tp of the MLP's intermediate size at the same head size and hidden size:
its block weights, their gradients and optimizer state, and the head- and width-split activations (q, k, v,
attention scores and context, the MLP's intermediate) are 1/tp, every hidden-size tensor (block inputs,
norms, residuals, the row-wise outputs after their all-reduce, the logits) whole. The plan simulates that
model (``rank_config``); FSDP then shards its states over the data-parallel ranks only (Target.data_parallel),
and gathers each block's tensor-parallel shard.

With ``sequence_parallel`` the hidden-size tensors outside the split projections hold s / tp rows per rank:
the residual stream, the blocks' norms (inputs, intermediates, outputs) and the tensors passed from block to
block. Each sublayer's input is all-gathered to the whole sequence (that gathered copy is what the column-wise
projections save for their backward, as without sequence parallelism), and each row-wise output is
reduce-scattered back to s / tp rows. The simulated rank model gets the same layout from forward hooks
(``emulate_sequence_parallel``) whose collectives are local copies of the same sizes.
"""

from __future__ import annotations

import copy

from bigtune.plan.base.constants import PlanError
from bigtune.plan.base.target import Target
from bigtune.recipe import Recipe

# The config sizes the engine's plan splits (tensor_parallel_plan refuses a model where tp does not divide one).
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def planned_tensor_parallel(recipe: Recipe, target: Target) -> int:
    """The tensor-parallel size a plan of ``recipe`` on ``target`` models: the recipe's, where the target runs
    FSDP2's 2-D mesh (strategy fsdp) on a number of GPUs it divides; else 1 (the recipe's checks refuse the
    rest at train time)."""
    tp = recipe.tensor_parallel
    if tp <= 1 or target.strategy != "fsdp" or target.gpus % tp:
        return 1
    return tp


def with_tensor_parallel(recipe: Recipe, target: Target) -> Target:
    """``target`` with the tensor-parallel size the plan models for ``recipe`` (planned_tensor_parallel)."""
    import dataclasses

    tp = planned_tensor_parallel(recipe, target)
    return target if tp == target.tensor_parallel else dataclasses.replace(target, tensor_parallel=tp)


def tensor_parallel_layout(recipe: Recipe, target: Target, config) -> tuple[Target, object, Recipe]:
    """(``target`` with the planned tensor-parallel size, the model config one rank computes, the recipe its
    step is simulated as: simulation_recipe's, carrying that size, which its sim_key includes)."""
    from bigtune.plan.step.simulate import simulation_recipe

    target = with_tensor_parallel(recipe, target)
    sim_recipe = simulation_recipe(recipe, target.strategy)
    if sim_recipe.tensor_parallel != target.tensor_parallel:
        sim_recipe = copy.deepcopy(sim_recipe)
        sim_recipe.tensor_parallel = target.tensor_parallel
    return target, rank_config(config, target.tensor_parallel), sim_recipe


def tokens_per_step(recipe: Recipe, target: Target) -> int:
    """Tokens of one optimizer step over all GPUs: the ranks of a tensor-parallel group read the same ones."""
    return recipe.train.micro_batch_size * recipe.data.max_seq_length * recipe.accumulate * target.data_parallel


def rank_config(config, tp: int):
    """A copy of ``config`` for the model one tensor-parallel rank computes: the attention's query and
    key/value heads and the MLP's intermediate size divided by ``tp``, the head size and hidden size kept."""
    if tp <= 1:
        return config
    cfg = copy.deepcopy(config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if getattr(cfg, "num_key_value_heads", None) is None:
        cfg.num_key_value_heads = heads
    for key in SPLIT_SIZES:
        size = getattr(cfg, key)
        if size % tp:
            raise PlanError(f"tensor_parallel={tp} does not divide the model's {key}={size}")
        setattr(cfg, key, size // tp)
    cfg.head_dim = head_dim  # the per-head size stays; Llama-style models read it from the config
    return cfg


def hidden_bytes_per_layer(recipe: Recipe, config) -> int:
    """Bytes of one micro-batch's hidden state (b × s × h) in the dtype the blocks compute in: what each
    row-wise projection's all-reduce carries (and each column-wise input gradient's in the backward)."""
    es = 4 if recipe.precision == "32-true" else 2
    return recipe.train.micro_batch_size * recipe.data.max_seq_length * config.hidden_size * es


# Sequence parallelism replaces each all-reduce by an all-gather (the sublayer's input) and a reduce-scatter
# (its output): a ring moves (tp - 1) / tp of the bytes in each, 2 (tp - 1) / tp together, the all-reduce's
# bytes. The time below holds for both layouts.
ALL_REDUCES_PER_BLOCK = 2  # forward: after o_proj and after down_proj (backward: the inputs of q/k/v and gate/up)


def tensor_parallel_seconds(recipe: Recipe, target: Target, config, n_blocks: int) -> float:
    """Seconds per optimizer step of the tensor-parallel all-reduces, which compute does not hide: each is
    synchronous in eager mode, between two kernels of the same stream that need its result.

    Per block and micro-batch: two all-reduces of b × s × h in the forward (the row-wise outputs) and two in
    the backward (the column-wise layers' input gradients), two more where activation checkpointing runs the
    forward again. A ring all-reduce moves 2 (tp−1)/tp of the bytes per GPU, at one direction of the catalog's
    intra-node link (a tensor-parallel group sits on one node: the GPUs' NVLink/PCIe figure, as FSDP's
    collectives are priced)."""
    tp = target.tensor_parallel
    if tp <= 1 or target.gpu is None or not target.gpu.interconnect_gbs:
        return 0.0
    bw = target.gpu.interconnect_gbs / 2 * 1e9
    passes = 3 if recipe.train.activation_checkpointing else 2  # forward, backward (+ recomputed forward)
    per_window = recipe.accumulate * n_blocks * passes * ALL_REDUCES_PER_BLOCK
    return per_window * 2 * (tp - 1) / tp * hidden_bytes_per_layer(recipe, config) / bw


def tensor_parallel_note(target: Target) -> str:
    tp, dp = target.tensor_parallel, target.data_parallel
    return (
        f"tensor_parallel={tp}: each rank computes 1/{tp} of every block's attention heads and MLP width, "
        f"simulated as the model with heads, key/value heads and intermediate size / {tp} (block weights, "
        f"gradients, optimizer state and the head/width-split activations / {tp}; embeddings, norms, output layer "
        f"and hidden-size activations whole on every rank), FSDP over the {dp} data-parallel rank(s); the {tp} "
        "ranks of a group read the same micro-batches"
    )


def sequence_parallel_note(tp: int) -> str:
    return (
        f"sequence_parallel: the residual stream, the blocks' norms and the activations between blocks hold 1/{tp} "
        f"of the sequence per rank (each sublayer's input all-gathered to the whole sequence, o_proj / down_proj "
        "reduce-scattered back; the same bytes as the two all-reduces); embeddings, final norm and output layer whole"
    )


# The Llama block's row-wise projections, whose outputs sequence parallelism reduce-scatters (the engine's
# sequence_parallel_block_plan refuses a block laid out otherwise).
