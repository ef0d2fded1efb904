"""The caching-allocator model (reserved memory) and its use in the planner."""

from __future__ import annotations

import copy
import json
import os

import pytest

from bigtune.core.allocconf import AllocatorConfig, AllocatorConfigError
from bigtune.core.gpus import find_gpu
from bigtune.models.configs import resolve_config
from bigtune.plan.base.target import Target
from bigtune.plan.device.allocator import (
    AllocatorOOM,
    CachingAllocator,
    least_capacity,
    replay,
    round_size,
    segment_size,
)
from bigtune.plan.planner import plan
from bigtune.plan.step.simulate import estimate_reserved, simulate, simulate_full_depth
from bigtune.recipe import RecipeError, load_recipe
from conftest import ROOT

MiB = 1 << 20


def test_sizes_follow_the_cuda_allocator():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(512) == 2 * MiB  # small pool
    assert segment_size(MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment to carve
    assert segment_size(10 * MiB) == 10 * MiB  # larger: its own, rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_a_segment_and_merge_back():
    a = CachingAllocator()
    x, y = a.malloc(100), a.malloc(700)
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (512 + 1024, 2 * MiB, 1)
    a.free(y)
    a.free(x)  # merges with y and the segment's untouched rest: one free 2 MiB block again
    assert [size for size, _ in a._pools[True]] == [2 * MiB]
    z = a.malloc(MiB)
    assert a.stats.segments == 1 and z.size == MiB and a.stats.allocated == MiB


def test_best_fit_split_and_unsplit_remainder():
    a = CachingAllocator()
    b5 = a.malloc(5 * MiB)  # 20 MiB segment, 15 MiB remainder cached
    b12 = a.malloc(12 * MiB)  # served from the 15 MiB remainder, 3 MiB left
    assert a.stats.reserved == 20 * MiB and b12.size == 12 * MiB
    a.free(b5)
    a.free(b12)
    whole = a.malloc(int(19.5 * MiB))  # remainder 0.5 MiB <= 1 MiB: the whole block is handed out
    assert whole.size == 20 * MiB and a.stats.allocated == 20 * MiB and a.stats.reserved == 20 * MiB


def test_fragmentation_forces_a_new_segment():
    a = CachingAllocator()
    first, second = a.malloc(8 * MiB), a.malloc(8 * MiB)  # one 20 MiB segment: 8 + 8 + 4 free
    a.free(first)  # holes of 8 and 4 MiB, not adjacent
    nine = a.malloc(9 * MiB)
    assert a.stats.segments == 2 and a.stats.reserved == 40 * MiB
    assert a.stats.allocated == 17 * MiB and a.stats.peak_allocated == 17 * MiB
    a.free(second)  # the first segment holds nothing now: PyTorch could give it back under pressure
    assert a.stats.in_use == 20 * MiB and a.stats.peak_in_use == 40 * MiB and a.stats.reserved == 40 * MiB
    a.free(nine)
    assert a.stats.in_use == 0


def test_release_cached_blocks_gives_back_whole_segments_only():
    # release_cached_blocks -> release_blocks: a cached block with no neighbour is a whole segment and goes
    # back to the driver; a free piece of a segment that still holds a live block stays.
    a = CachingAllocator()
    whole = a.malloc(30 * MiB)  # its own 30 MiB segment
    small = a.malloc(4 * MiB)  # a 20 MiB segment, 16 MiB cached beside it
    tiny = a.malloc(100)  # a 2 MiB small-pool segment
    a.free(whole)
    a.free(tiny)
    assert a.stats.reserved == 52 * MiB
    assert a.release_cached_blocks() == 32 * MiB
    assert (a.stats.reserved, a.stats.segments, a.stats.allocated) == (20 * MiB, 1, 4 * MiB)
    a.free(small)
    assert a.release_cached_blocks() == 20 * MiB and a.stats.reserved == 0 and a.stats.segments == 0


def test_a_full_device_frees_its_cache_and_retries_before_failing():
    # malloc: alloc_block fails -> release_cached_blocks -> alloc_block again; only then an OOM.
    a = CachingAllocator(capacity=64 * MiB)
    big = a.malloc(40 * MiB)
    a.free(big)  # cached: 40 MiB reserved, nothing allocated
    x = a.malloc(24 * MiB)  # the cached 40 MiB block serves it (best fit), split: 16 MiB left cached
    assert (a.stats.reserved, a.stats.alloc_retries) == (40 * MiB, 0)
    a.free(x)
    y = a.malloc(50 * MiB)  # 40 + 50 > 64: the cached segment is given back, then 50 fits
    assert (a.stats.reserved, a.stats.alloc_retries, y.size) == (50 * MiB, 1, 50 * MiB)
    with pytest.raises(AllocatorOOM):  # 50 live + 16 > 64 even with an empty cache
        a.malloc(15 * MiB)
    assert a.stats.alloc_retries == 2


def test_best_fit_fragmentation_decides_a_verdict_a_naive_count_gets_wrong():
    # Two 8 MiB tensors share one 20 MiB segment; the first is freed, leaving holes of 8 and 4 MiB
    # around the live second. A 9 MiB request fits neither hole (get_free_block), and the segment
    # cannot be released (it holds a live block), so it needs a second 20 MiB segment: 40 MiB.
    events = [("alloc", 0, 8 * MiB), ("alloc", 1, 8 * MiB), ("free", 0), ("alloc", 2, 9 * MiB)]
    peak_allocated = replay(events).stats.peak_allocated
    assert peak_allocated == 17 * MiB  # a count of live bytes (or 1.05 times it) says 32 MiB is plenty
    with pytest.raises(AllocatorOOM):
        replay(events, CachingAllocator(capacity=32 * MiB))
    assert least_capacity(events) == 40 * MiB


def test_least_capacity_is_below_the_unbounded_segments_in_use():
    # Unbounded, the 150 MiB tensor gets a third segment and the 6 MiB one is then cut from a cached
    # 100 MiB segment, which counts as in use whole: 150 + 100. On a 200 MiB device the two cached
    # segments are given back for the 150 MiB request, and the 6 MiB one gets a 20 MiB segment of its own.
    events = [("alloc", 0, 100 * MiB), ("alloc", 1, 100 * MiB), ("free", 0), ("free", 1)]
    events += [("alloc", 2, 150 * MiB), ("alloc", 3, 6 * MiB)]
    unbounded = replay(events).stats
    assert (unbounded.peak_reserved, unbounded.peak_in_use) == (350 * MiB, 250 * MiB)
    assert least_capacity(events) == 200 * MiB  # the two 100 MiB tensors alive together
    bounded = replay(events, CachingAllocator(capacity=200 * MiB)).stats
    assert (bounded.alloc_retries, bounded.reserved, bounded.segments) == (1, 170 * MiB, 2)


def test_replay_of_events_and_zero_byte_storages():
    events = [
        ("alloc", 0, 3 * MiB),
        ("alloc", 1, 0),
        ("alloc", 2, 3 * MiB),
        ("free", 0),
        ("free", 1),
        ("alloc", 3, 3 * MiB),
    ]
    stats = replay(events).stats
    assert stats.segments == 1 and stats.peak_allocated == 6 * MiB and stats.allocated == 6 * MiB
    assert stats.in_use == stats.peak_in_use == 20 * MiB


def test_steady_replay_frees_what_crosses_the_step_boundary():
    # Gradients freed only in the next step (optim.zero_grad=before_backward): the repeated step must
    # free step 1's where step 1 freed step 0's, not keep both alive.
    from bigtune.plan.step.simulate import _replay_steady

    g, act = 64 * MiB, 32 * MiB
    events = [
        ("alloc", 0, 128 * MiB),  # weights
        ("alloc", 1, act),
        ("free", 1),
        ("alloc", 2, g),  # step 0: forward, backward leaves a gradient
        ("alloc", 3, act),
        ("free", 2),
        ("free", 3),
        ("alloc", 4, g),
    ]  # step 1: the same, one step later
    reserved, needed = _replay_steady(events, 4)
    three = events + [("alloc", 5, act), ("free", 4), ("free", 5), ("alloc", 6, g)]
    assert (reserved, needed) == (replay(three).stats.peak_reserved, least_capacity(three))
    assert replay(three).stats.peak_allocated == 128 * MiB + g + act


def _tinyllama(layers: int):
    r = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {"precision": "bf16-true", "train.micro_batch_size": 2, "data.max_seq_length": 256},
    )
    cfg = copy.deepcopy(resolve_config(r))
    cfg.num_hidden_layers = layers
    return r, cfg


def test_traced_step_reserves_at_least_its_peak_and_counts_the_same_tensors():
    r, cfg = _tinyllama(2)
    traced = simulate(r, cfg, 2, cuda=True, trace=True)
    plain = simulate(r, cfg, 2, cuda=True)
    assert plain.reserved == 0 and traced.reserved >= traced.peak_allocated
    # tracing takes a real step 0 instead of the zero-gradient shortcut: same steady step
    assert traced.phases == plain.phases and traced.peak_allocated == plain.peak_allocated
    assert traced.peak_allocated <= traced.needed <= traced.reserved


def test_reserved_extrapolation_close_to_a_full_depth_replay():
    """Reserved from two shallower traced steps vs the replay of the whole 14-layer step."""
    r, cfg = _tinyllama(14)
    full = simulate(r, cfg, 14, cuda=True, trace=True)
    sim = simulate_full_depth(r, cfg, cuda=True)
    assert sim.peak_allocated == full.peak_allocated  # allocated extrapolates exactly
    estimate, needed, how, expandable = estimate_reserved(r, cfg, sim, (9, 0))
    assert abs(estimate - full.reserved) / full.reserved < 0.03, (estimate, full.reserved)
    assert abs(needed - full.needed) / full.needed < 0.03, (needed, full.needed)
    assert abs(expandable - full.needed_expandable) / full.needed_expandable < 0.03, (expandable, full)
    assert "8 blocks deep" in how[0]


def test_logits_of_two_lengths_cannot_reuse_each_others_segments():
    """The loss of a large-vocabulary LoRA step, reasoned from the allocator's rules: where the shifted logits
    ((T-1) rows) are a copy a little smaller than the full fp32 logits (T rows), their 2 MiB-rounded segments
    (get_allocation_size) cannot serve a full-size request again (get_free_block: the smallest cached block
    >= the request), so the backward's full-size gradient needs one more logits-sized segment. This is what
    puts the planned reserved of bigtune's loss (causal_lm_loss_sum slices the logits) at 1.2-1.25 x peak
    allocated on Qwen-sized vocabularies, where a loss that shifts the labels instead (transformers'
    ForCausalLMLoss) keeps every logits-sized block one size."""
    row, t = int(2.5 * MiB), 64  # one row of fp32 logits, tokens
    full, shifted, half = t * row, (t - 1) * row, t * row // 2  # 160, 157.5 and 80 MiB
    sliced = [
        ("alloc", 1, half),  # bf16 logits: an 80 MiB segment
        ("alloc", 2, full),  # fp32 logits: 160 MiB segment
        ("free", 1),
        ("alloc", 3, shifted),  # the contiguous shifted copy: a 158 MiB segment, 0.5 MiB left unsplit
        ("alloc", 4, shifted),  # log_softmax: another 158 MiB segment (peak: 160 + 158 + 158)
        ("free", 3),
        ("free", 2),
        ("alloc", 5, shifted),  # nll backward: best fit is 3's 158 MiB block
        ("alloc", 6, shifted),  # log_softmax backward: 2's 160 MiB block, split (2.5 MiB > 1 MiB stays cached)
        ("free", 5),
        ("free", 4),
        ("alloc", 7, full),  # slice backward, full size: cached 80, 158, 158, 2.5 MiB: none fits, a new segment
        ("free", 6),
        ("alloc", 8, half),  # back to bf16: 1's 80 MiB block
        ("free", 7),
        ("free", 8),
    ]
    s = replay(sliced).stats
    assert (s.peak_reserved, s.peak_allocated, s.segments) == (716 * MiB, 476 * MiB, 5)
    shifted_labels = [  # the same step with the labels shifted: every fp32 logits-sized block is one size
        ("alloc", 1, half),
        ("alloc", 2, full),
        ("free", 1),
        ("alloc", 4, full),  # log_softmax: a second 160 MiB segment
        ("free", 2),
        ("alloc", 5, full),  # nll backward: 2's block
        ("alloc", 6, full),  # log_softmax backward: a third 160 MiB segment
        ("free", 5),
        ("free", 4),
        ("alloc", 8, half),  # 1's 80 MiB block
        ("free", 6),
        ("free", 8),
    ]
    s = replay(shifted_labels).stats
    assert (s.peak_reserved, s.peak_allocated, s.segments) == (560 * MiB, 480 * MiB, 4)


def test_lora_adapters_pack_into_small_segments():
    """LoRA's adapter weights, their gradients and AdamW's two states (each r x 4096 bf16 = 128 KiB: the
    small pool, requests <= 1 MiB) pack 16 to a 2 MiB segment (kSmallBuffer, split while >= 512 bytes remain);
    the frozen base weights get no gradient. The per-step LoRA temporaries (tokens x r) reuse freed small
    blocks, so reserved is the packed size and does not grow from step to step."""
    adapter = 16 * 4096 * 2
    events, key = [], 0
    for _ in range(4 * 64):  # 64 adapters: weights, gradients, exp_avg, exp_avg_sq
        events.append(("alloc", key, adapter))
        key += 1
    for _step in range(3):  # each step: a few adapter activations born and freed
        born = list(range(key, key + 8))
        events += [("alloc", k, adapter) for k in born] + [("free", k) for k in born]
        key += 8
    s = replay(events).stats
    assert s.peak_allocated == (256 + 8) * adapter
    assert s.peak_reserved == -(-(256 + 8) * adapter // (2 * MiB)) * 2 * MiB == 34 * MiB
    assert s.segments == 17


# -- PYTORCH_CUDA_ALLOC_CONF (train.cuda_alloc_conf) ------------------------------------------------------


def test_alloc_conf_parses_pytorchs_grammar_and_refuses_what_the_replay_does_not_model():
    # AcceleratorAllocatorConfig::parseArgs / ConfigTokenizer: whitespace dropped, a trailing comma allowed, the
    # last of a repeated key wins, True/False spelled so, *_mb at least kLargeBuffer / 1 MiB = 20.
    assert AllocatorConfig.parse("").is_default
    conf = AllocatorConfig.parse(" expandable_segments : True , max_split_size_mb:128,")
    assert (conf.expandable_segments, conf.max_split_size) == (True, 128 * MiB)
    assert str(conf) == "expandable_segments:True,max_split_size_mb:128"
    assert AllocatorConfig.parse(str(conf)) == conf
    assert not AllocatorConfig.parse("expandable_segments:True,expandable_segments:False").expandable_segments
    assert AllocatorConfig.parse("max_non_split_rounding_mb:64").max_non_split_rounding == 64 * MiB
    for bad, says in [
        ("expandable_segments:true", "True or False"),
        ("max_split_size_mb:19", ">= 20"),
        ("max_split_size_mb:1.5e2", ">= 20"),
        ("garbage_collection_threshold:1.0", r"\(0.0, 1.0\)"),
        ("expandible_segments:True", "did you mean expandable_segments"),
        ("roundup_power2_divisions:[256:1,>:4]", "does not model"),
        ("backend:cudaMallocAsync", "does not model"),
        ("expandable_segments", "has no value"),
        ("expandable_segments:True;max_split_size_mb:40", "expected ','"),
    ]:
        with pytest.raises(AllocatorConfigError, match=says):
            AllocatorConfig.parse(bad)


def test_max_split_size_keeps_oversize_blocks_whole():
    # get_free_block: a cached block >= max_split_size serves no smaller request, and an oversize request only
    # if it is less than max_non_split_rounding_mb (20 MiB) larger; should_split: a block handed to an oversize
    # request is never split.
    conf = AllocatorConfig.parse("max_split_size_mb:40")
    a = CachingAllocator(config=conf)
    a.free(a.malloc(100 * MiB))  # a cached oversize 100 MiB segment
    a.malloc(30 * MiB)  # not cut from it: a 30 MiB segment of its own
    assert (a.stats.reserved, a.stats.segments) == (130 * MiB, 2)
    z = a.malloc(70 * MiB)  # 100 >= 70 + 20: too much larger, a 70 MiB segment
    assert (a.stats.reserved, a.stats.segments) == (200 * MiB, 3)
    a.free(z)
    w = a.malloc(90 * MiB)  # best fit is the 100 MiB block (100 < 90 + 20), handed out whole
    assert (w.size, a.stats.allocated, a.stats.reserved) == (100 * MiB, 130 * MiB, 200 * MiB)
    default = CachingAllocator()
    default.free(default.malloc(100 * MiB))
    default.malloc(30 * MiB)  # without the setting the 30 MiB are cut from the cached 100 MiB
    assert default.stats.reserved == 100 * MiB
    wider = CachingAllocator(config=AllocatorConfig.parse("max_split_size_mb:40,max_non_split_rounding_mb:40"))
    wider.free(wider.malloc(100 * MiB))
    assert wider.malloc(70 * MiB).size == 100 * MiB and wider.stats.segments == 1  # 100 < 70 + 40


def test_max_split_size_frees_oversize_blocks_before_the_full_retry():
    # malloc: alloc_block fails -> release_available_cached_blocks (the smallest cached oversize block >= the
    # request; else oversize blocks from the largest down, freed even when they fall short) -> alloc_block;
    # only then release_cached_blocks and a counted retry.
    conf = AllocatorConfig.parse("max_split_size_mb:40")
    a = CachingAllocator(capacity=200 * MiB, config=conf)
    for b in [a.malloc(100 * MiB), a.malloc(60 * MiB), a.malloc(30 * MiB)]:
        a.free(b)  # three cached whole segments, 190 MiB reserved
    a.malloc(70 * MiB)  # the 100 MiB block is too much larger to serve it; 190 + 70 > 200: the 100 MiB goes
    assert (a.stats.reserved, a.stats.alloc_retries) == (160 * MiB, 0)
    assert sorted(size for size, _ in a._pools[False]) == [30 * MiB, 60 * MiB]
    a.malloc(120 * MiB)  # no cached block >= 120: the 60 MiB goes (short of 120), then the full retry frees 30
    assert (a.stats.reserved, a.stats.alloc_retries, a.stats.segments) == (190 * MiB, 1, 2)
    events = [("alloc", 0, 100 * MiB), ("alloc", 1, 60 * MiB), ("alloc", 2, 30 * MiB), ("free", 0), ("free", 1)]
    events += [("free", 2), ("alloc", 3, 70 * MiB), ("alloc", 4, 120 * MiB)]
    with pytest.raises(AllocatorOOM):  # default: the 70 MiB is cut from the 100 MiB segment, which then stays
        replay(events, CachingAllocator(capacity=200 * MiB))
    assert replay(events, CachingAllocator(capacity=200 * MiB, config=conf)).stats.reserved == 190 * MiB


def test_expandable_segments_map_pages_and_unmap_them_on_release():
    # find_expandable_block / map_block: the large pool's one segment is mapped in 20 MiB pages (kLargeBuffer),
    # a request the cache cannot serve maps what the free block before the unmapped tail lacks; every block is
    # split while 512 bytes remain (should_split). release_cached_blocks -> unmap_block gives back whole free
    # pages only; release_expandable_segment drops a segment with nothing mapped. Reserved = mapped bytes;
    # torch.cuda.memory_stats counts no segments for it.
    a = CachingAllocator(config=AllocatorConfig.parse("expandable_segments:True"))
    pinned = a.malloc(2 * MiB)  # one 20 MiB page: 2 MiB live, 18 MiB free after it
    a.free(a.malloc(16 * MiB))  # cut from the 18 MiB and merged back
    c = a.malloc(30 * MiB)  # the free 18 MiB plus one more page: 38 MiB, of which 30 are handed out
    assert (a.stats.reserved, a.stats.segments, a.stats.allocated) == (40 * MiB, 0, 32 * MiB)
    assert c.addr - pinned.addr == 2 * MiB and c.size == 30 * MiB
    a.free(c)  # free 2-40 MiB: the page 20-40 is whole, the page 0-20 holds the live 2 MiB
    assert a.release_cached_blocks() == 20 * MiB and a.stats.reserved == 20 * MiB
    a.free(pinned)
    assert a.release_cached_blocks() == 20 * MiB and a.stats.reserved == 0 and not a._unmapped[False]
    a.malloc(100)  # the small pool's segment maps 2 MiB pages (kSmallBuffer)
    assert a.stats.reserved == 2 * MiB


def test_expandable_best_fit_prefers_a_block_away_from_the_unmapped_tail():
    # get_free_block: a free block next to the unmapped tail counts at the size it could grow to
    # (expandable_size), so a larger block elsewhere that fits is taken first.
    def fifth_request_at(conf: str) -> int:
        a = CachingAllocator(config=AllocatorConfig.parse(conf))
        first = a.malloc(4 * MiB)  # one 20 MiB segment (page) either way
        middle = a.malloc(8 * MiB)
        a.malloc(2 * MiB)  # 6 MiB left free at the end
        a.free(middle)  # free: 8 MiB at 4 MiB, 6 MiB at 14 MiB
        return a.malloc(5 * MiB).addr - first.addr

    assert fifth_request_at("") == 14 * MiB  # best fit: the 6 MiB block
    assert fifth_request_at("expandable_segments:True") == 4 * MiB  # the 6 MiB block could grow: the 8 MiB one


def test_expandable_segments_lower_the_least_capacity_of_a_pinned_segment():
    # A live 2 MiB block pins its 20 MiB segment (default): the 18 MiB freed beside it cannot serve 30 MiB, and
    # release_cached_blocks cannot free a split segment, so 30 MiB more is needed: 50 MiB. With one expandable
    # segment the free 18 MiB sits before the unmapped tail and one more 20 MiB page makes room: 40 MiB.
    events = [("alloc", 0, 2 * MiB), ("alloc", 1, 16 * MiB), ("free", 1), ("alloc", 2, 30 * MiB)]
    expandable = AllocatorConfig.parse("expandable_segments:True")
    assert replay(events).stats.peak_reserved == least_capacity(events) == 50 * MiB
    assert replay(events, config=expandable).stats.peak_reserved == 40 * MiB
    assert least_capacity(events, expandable) == 40 * MiB


def test_cuda_alloc_conf_in_the_recipe_is_checked_and_garbage_collection_refused():
    # garbage_collect_cached_blocks runs only under a per-process memory fraction (set_fraction /
    # allowed_memory_maximum), which bigtune never sets: the key would do nothing, so the recipe refuses it.
    path = ROOT / "recipes" / "tinyllama-full.yaml"
    assert load_recipe(path, {"train.cuda_alloc_conf": "expandable_segments:True"}).train.cuda_alloc_conf
    assert AllocatorConfig.parse("garbage_collection_threshold:0.6").garbage_collection_threshold == 0.6
    for conf, says in [("max_split_size_mb:10", ">= 20"), ("garbage_collection_threshold:0.6", "per-process")]:
        with pytest.raises(RecipeError) as e:
            load_recipe(path, {"train.cuda_alloc_conf": conf})
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith("train.cuda_alloc_conf:")
        assert says in e.value.problems[0]


def test_traced_step_replayed_with_expandable_segments():
    # The same traced TinyLlama step (2 layers) replayed under each setting: expandable segments reserve and
    # need no more than the defaults here, and the plan says which settings it replayed.
    r, cfg = _tinyllama(2)
    default = simulate(r, cfg, 2, cuda=True, trace=True)
    r_exp = load_recipe(r, {"train.cuda_alloc_conf": "expandable_segments:True"})
    expandable = simulate(r_exp, cfg, 2, cuda=True, trace=True)
    assert expandable.peak_allocated == default.peak_allocated
    assert expandable.peak_allocated <= expandable.reserved <= default.reserved
    assert expandable.peak_allocated <= expandable.needed <= default.needed
    notes = plan(r_exp, Target("cuda", find_gpu("a100-80gb"), 1), config=cfg).notes
    assert "caching allocator replayed with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in "\n".join(notes)


def test_engine_exports_the_recipes_alloc_conf_and_refuses_another_one(monkeypatch):
    # PyTorch reads PYTORCH_CUDA_ALLOC_CONF when its allocator starts: the engine sets it before Fabric, and
    # a different value already in the environment would make the run differ from the recipe and the plan.
    from bigtune.engine.build import set_cuda_alloc_conf

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(var, "")  # recorded, so what set_cuda_alloc_conf sets is undone after the test
        monkeypatch.delenv(var)
    path = ROOT / "recipes" / "tinyllama-full.yaml"
    set_cuda_alloc_conf(load_recipe(path))  # '': the environment is left alone
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    set_cuda_alloc_conf(load_recipe(path, {"train.cuda_alloc_conf": "expandable_segments:True"}))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    with pytest.raises(RecipeError, match="environment sets PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:64'"):
        set_cuda_alloc_conf(load_recipe(path, {"train.cuda_alloc_conf": "expandable_segments:True"}))


def test_an_oom_plan_says_when_expandable_segments_would_fit():
    """Default allocator settings, a card just too small for the replayed step: the plan names the setting
    that fits, and the plan with that setting agrees (same replay, same bytes)."""
    import dataclasses
    import re

    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.constants import GIB
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan

    r = load_recipe(ROOT / "recipes" / "tinyllama-full.yaml", {"train.micro_batch_size": 4})
    roomy = plan(r, Target("cuda", find_gpu("a100-80gb"), 1))
    assert not any("expandable" in n for n in roomy.notes)  # it fits: nothing to say
    card = dataclasses.replace(find_gpu("a100-80gb"), memory_gib=(roomy.needed_total - 1) / GIB)
    tight = plan(r, Target("cuda", card, 1))
    (note,) = [n for n in tight.notes if "expandable_segments:True" in n]
    assert tight.fits is False and note.startswith("FITS with train.cuda_alloc_conf")
    said = float(re.search(r"needs ([\d.]+) GiB", note).group(1))
    r_x = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {"train.micro_batch_size": 4, "train.cuda_alloc_conf": "expandable_segments:True"},
    )
    with_it = plan(r_x, Target("cuda", card, 1))
    assert with_it.fits is True
    assert abs(with_it.needed_total - with_it.overhead - said * GIB) < 0.01 * GIB


def test_an_oom_with_much_cached_but_unusable_memory_advises_expandable_segments():
    """PyTorch's CUDA OOM message states the bytes reserved but unallocated at the failing request
    (CUDACachingAllocator.cpp); a run records them and, from 1 GiB on, advises the allocator setting."""
    import torch

    from bigtune.memory.monitor import unallocated_at_oom
    from bigtune.run.advice import oom_advice

    err = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
        "1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
        "allocated memory 70.12 GiB is allocated by PyTorch, and 3.45 GiB is reserved by PyTorch but unallocated."
    )
    assert unallocated_at_oom(err) == int(3.45 * 2**30)
    assert unallocated_at_oom(RuntimeError("CUDA error: out of memory")) is None
    r = load_recipe(ROOT / "recipes" / "tinyllama-full.yaml")
    advice = oom_advice(r, {"cached_unallocated_bytes": unallocated_at_oom(err)})
    assert advice[0].startswith("train.cuda_alloc_conf=expandable_segments:True (3.45 GiB")
    assert not any("expandable" in a for a in oom_advice(r, {"cached_unallocated_bytes": 200 * MiB}))
    set_already = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml", {"train.cuda_alloc_conf": "expandable_segments:True"}
    )
    assert not any("expandable" in a for a in oom_advice(set_already, {"cached_unallocated_bytes": 4 << 30}))
    assert oom_advice(r) == oom_advice(r, {"cached_unallocated_bytes": None})  # unchanged where not said


def test_shallow_traced_steps_extrapolate_reserved_for_plans_without_their_own_replay():
    """--alternatives and pipeline stages replay their own steps one and two blocks deep (simulate_full_depth
    with trace) instead of assuming a ratio: on the 14-layer step, reserved and the least capacity land
    within 8 % of the replay of the whole step, never below its allocated peak."""
    r, cfg = _tinyllama(14)
    full = simulate(r, cfg, 14, cuda=True, trace=True)
    shallow = simulate_full_depth(r, cfg, cuda=True, trace=True)
    assert shallow.peak_allocated == full.peak_allocated
    assert shallow.peak_allocated <= shallow.needed <= shallow.reserved
    assert abs(shallow.reserved - full.reserved) / full.reserved < 0.08, (shallow.reserved, full.reserved)
    assert abs(shallow.needed - full.needed) / full.needed < 0.08, (shallow.needed, full.needed)
    assert "one and two blocks deep" in shallow.replay
    assert simulate_full_depth(r, cfg, cuda=True).reserved == 0  # untraced: nothing replayed


def test_replayed_figures_extrapolate_over_depth_never_below_allocated():
    from bigtune.plan.step.simulate import replayed_over_depth

    # reserved affine in allocated (10 % on top): both extrapolations give the line, zero apart
    assert replayed_over_depth((110, 100), (220, 200), 1000) == (1100, 0.0)
    # grew slower than allocated between the two depths (cached blocks absorbed it): rate clamped at 1,
    # averaged with the deeper step's ratio: ((230 + 800) + 1000 × 1.15) / 2, the two 120 apart
    assert replayed_over_depth((150, 100), (230, 200), 1000) == (1090, pytest.approx(120 / 1090))
    assert replayed_over_depth((0, 100), (0, 200), 1000)[0] == 1000  # never below the allocated peak


def test_a_cpu_offloaded_optimizers_host_state_stays_out_of_the_replay():
    """cpu_offload_adamw keeps fp32 masters and moments in host RAM and steps there: the trace leaves every
    storage born in its host-side step out of the replay (LiveTensorTracker.untraced), so the plan replays
    the device's own step instead of assuming a ratio, and reserved is not inflated by the host state."""
    import torch

    from bigtune.memory.tracker import LiveTensorTracker

    events: list = []
    with LiveTensorTracker(events=events) as t:
        a = torch.empty(1000)
        with t.untraced():
            h = torch.empty(5000)
        assert t.live_bytes == 24000  # still counted live
        del a, h
    assert events == [("alloc", 0, 4000), ("free", 0)]

    r = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {"precision": "bf16-true", "train.micro_batch_size": 2, "data.max_seq_length": 256},
    )
    off = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {
            "precision": "bf16-true",
            "train.micro_batch_size": 2,
            "data.max_seq_length": 256,
            "optim.name": "cpu_offload_adamw",
        },
    )
    p = plan(off, Target("cuda", find_gpu("a100-80gb"), 1))
    assert any(n.startswith("reserved from a caching-allocator replay") for n in p.notes), p.notes
    host = max(ph.get("optimizer_cpu", 0) for ph in simulate_full_depth(off, resolve_config(off), True).phases.values())
    assert host > 0 and p.peak_allocated <= p.peak_reserved < p.peak_allocated + host / 2
    on_device = plan(r, Target("cuda", find_gpu("a100-80gb"), 1))
    assert p.peak_reserved < on_device.peak_reserved  # the moments left the device


def test_a_certain_oom_gets_no_made_up_reserved_figure():
    """Where the allocated peak alone exceeds the card no replay can change the verdict: the plan gives no
    reserved figure (instead of a ratio) and judges by peak allocated plus the context."""
    r = load_recipe(ROOT / "recipes" / "tinyllama-full.yaml", {"precision": "32-true", "train.micro_batch_size": 8})
    p = plan(r, Target("cuda", find_gpu("t4"), 1))
    assert p.fits is False and p.peak_reserved is None
    assert p.needed_total == p.peak_total == p.peak_allocated + p.overhead
    assert any("the peak allocated alone exceeds the card" in n for n in p.notes)
    # --json still carries a reserved figure, and says it is the lower bound, not a replay's
    d = json.loads(json.dumps(p.to_dict()))
    assert (d["peak_reserved"], d["peak_reserved_basis"]) == (p.peak_allocated, "at least")


def test_every_alternative_on_a_cuda_target_comes_with_its_own_replay():
    from bigtune.plan.search.alternatives import alternatives

    r = load_recipe(ROOT / "recipes" / "tiny-opt.yaml", {"train.accumulate_grad_batches": 2})
    target = Target("cuda", find_gpu("a100-80gb"), 1)
    alts = alternatives(r, target, max_gpus=2, workers=1)
    assert alts
    for p in alts:
        assert p.peak_allocated <= p.peak_reserved, p.variant
        assert any("caching-allocator replay" in n or "replayed step" in n for n in p.notes), (p.variant, p.notes)
        assert not any("× peak allocated (assumed" in n for n in p.notes)
    # tiny-opt is simulated at full depth: a single-GPU variant's own replay is the one its own plan makes
    one = next(p for p in alts if "GPUs" not in p.variant and "interpolated" not in p.variant)
    own = plan(load_recipe(r.to_dict(), one.overrides), target)
    assert (one.peak_allocated, one.peak_reserved, one.needed_total) == (
        own.peak_allocated,
        own.peak_reserved,
        own.needed_total,
    ), one.variant


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"train.activation_checkpointing": True},
        {"optim.zero_grad": "before_backward"},
        {"precision": "bf16-mixed"},
        "kept gradients",
    ],
    ids=["plain", "ckpt", "before_backward", "bf16-mixed", "kept-gradients"],
)
def test_a_spliced_step0_replays_like_a_real_one(monkeypatch, over, no_sim_cache):
    """Traced simulations take step 0's events from step 1's instead of running it (a forward and backward
    less per traced simulation): the replay sees the same sequence as after a real step 0, up to which
    same-size gradient block each free releases. Reserved is the same; the least capacity within 1 %. Also
    where gradients are zeroed in place and never allocated again (``zero_grad(set_to_none=False)``, as
    transformers' Trainer did before PyTorch 2.0; bench/published.py plans such rows)."""
    import torch

    import bigtune.plan.step.simulate as simulate_module

    r, cfg = _tinyllama(2)
    if over == "kept gradients":
        zero_grad = torch.optim.Optimizer.zero_grad
        monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", lambda self, set_to_none=True: zero_grad(self, False))
        over = {}
    r = load_recipe(r.to_dict(), over)
    spliced = simulate(r, cfg, 2, cuda=True, trace=True)
    monkeypatch.setattr(simulate_module, "splices_step0", lambda *a: False)
    real = simulate(r, cfg, 2, cuda=True, trace=True)
    assert spliced.phases == real.phases and spliced.reserved == real.reserved
    assert abs(spliced.needed - real.needed) <= 0.01 * real.needed
    assert abs(spliced.needed_expandable - real.needed_expandable) <= 0.01 * real.needed_expandable


def _fsdp_sim(zero_grad: str):
    from bigtune.models.configs import resolve_config
    from bigtune.plan.step.simulate import simulate_full_depth, simulation_recipe, total_blocks

    r = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {
            "precision": "bf16-true",
            "strategy": "fsdp",
            "devices": 4,
            "train.micro_batch_size": 8,
            "train.global_batch_size": 32,
            "data.max_seq_length": 512,
            "optim.zero_grad": zero_grad,
        },
    )
    config = resolve_config(r)
    return r, config, simulate_full_depth(simulation_recipe(r, "fsdp"), config, True), total_blocks(config)


def test_fsdp2_side_stream_pools_add_to_reserved_and_not_to_what_must_fit(monkeypatch):
    """FSDP2 allocates all-gather buffers in its copy-in stream and gradient shards in its reduce-scatter
    stream; the caching allocator serves a stream only from its own pool (CUDACachingAllocator.cpp:
    get_free_block), so what those pools hold cached, free, at the step's peak is reserved beside the
    default stream's replayed pool, while the retry path (release_cached_blocks) would free it: the plan's
    reserved grows by it, its need does not."""
    import copy

    from bigtune.core.gpus import find_gpu
    from bigtune.plan import planner
    from bigtune.plan.base.target import Target
    from bigtune.plan.layout.sharding import side_stream_cache
    from bigtune.plan.planner import plan

    four = Target("cuda", find_gpu("a100-80gb"), 4, "fsdp")
    r, config, sim, n = _fsdp_sim("after_step")
    assert side_stream_cache(sim, r, Target("cuda", find_gpu("a100-80gb"), 4, "ddp"), n)[0] == 0
    assert side_stream_cache(sim, r, Target("cuda", find_gpu("a100-80gb"), 1, "fsdp"), n)[0] == 0

    # One unit (fsdp_wrap=none): the whole model's all-gather output and this rank's input stay cached in the
    # copy-in stream's pool once copied out into the unsharded weights.
    flat = copy.deepcopy(r)
    flat.fsdp_wrap = "none"
    model = sim.numel * 2  # bf16
    with_buffers, note = side_stream_cache(sim, flat, four, n)
    assert with_buffers - side_stream_cache(sim, flat, four, n, gather_buffers=False)[0] == int(model * 1.25)
    assert "side streams" in note
    # Gradient shards freed by zero_grad after the step stay cached in the reduce-scatter stream's pool
    # through the forward; zeroed before the backward, they are still in use at the forward's high.
    rb, _, sim_b, _ = _fsdp_sim("before_backward")
    flat_b = copy.deepcopy(rb)
    flat_b.fsdp_wrap = "none"
    shards = -(-sim.phases["after_backward"]["gradients"] // 4)
    assert with_buffers - side_stream_cache(sim_b, flat_b, four, n)[0] == pytest.approx(shards, rel=0.01)

    # In the plan: reserved = the default stream's replayed ratio × the peak + the side pools; the need
    # (least capacity) is unchanged. (A replay stood in for: 10 % over the unsharded peak, needing it all.)
    sim.reserved, sim.needed = sim.peak_allocated * 11 // 10, sim.peak_allocated
    p = plan(r, four, config=config, sim=sim)
    monkeypatch.setattr(planner, "side_stream_cache", lambda *a, **k: (0, ""))
    q = plan(r, four, config=config, sim=sim)
    extra = side_stream_cache(sim, r, four, n)[0]
    assert extra > 0.5 * shards  # blocks: the last step's shards, mostly not yet replaced at the backward's high
    assert p.peak_reserved - q.peak_reserved == extra
    assert p.needed_total == q.needed_total


def _gpu_of(gib: float):
    import dataclasses

    return dataclasses.replace(find_gpu("a100-80gb"), memory_gib=gib)


def test_extrapolations_far_apart_give_way_to_the_full_depth_replay():
    """Qwen3-0.6B full fine-tune, bf16, checkpointed, 2 x 1024: its 4- and 8-block replays extrapolate 6 % apart
    (the logits' fixed-size segments are a large share of a shallow step), so the plan replays the whole step;
    its reserved is that replay's (plus the cuBLAS workspaces), below what the extrapolation gave."""
    from bigtune.core.gpus import cublas_workspace_bytes
    from bigtune.plan.base.constants import CUBLAS_HANDLES
    from bigtune.plan.step.simulate import FULL_DEPTH_REPLAY, replay_full_depth

    r = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {
            "model.name": "Qwen/Qwen3-0.6B",
            "precision": "bf16-true",
            "train.activation_checkpointing": True,
            "train.micro_batch_size": 2,
            "data.max_seq_length": 1024,
        },
    )
    cfg = resolve_config(r)
    p = plan(r, Target("cuda", find_gpu("a100-80gb"), 1), config=cfg)
    note = next(n for n in p.notes if n.startswith(FULL_DEPTH_REPLAY))
    assert "apart" in note, p.notes
    full_reserved = replay_full_depth(r, cfg, (8, 0))[0]
    # the plan adds the cuBLAS workspaces; its own traced step may differ from this call's by a block or so
    workspaces = CUBLAS_HANDLES * cublas_workspace_bytes(find_gpu("a100-80gb"))
    assert abs(p.peak_reserved - workspaces - full_reserved) <= 2**20
    shallow = estimate_reserved(r, cfg, simulate_full_depth(r, cfg, True), (8, 0))[0]
    assert full_reserved < shallow  # the extrapolation overshot


def test_a_verdict_the_extrapolation_decides_is_replayed_at_full_depth():
    """TinyLlama full fine-tune, bf16, 2 x 256 (extrapolations 2 % apart): on a card whose size the extrapolated
    need just reaches, the verdict is the full-depth replay's, with a note saying why; on a roomy card the
    extrapolation stands."""
    from bigtune.core.gpus import cublas_workspace_bytes
    from bigtune.plan.base.constants import CUBLAS_HANDLES, CUDA_CONTEXT_BYTES, GIB
    from bigtune.plan.step.simulate import FULL_DEPTH_REPLAY, replay_full_depth

    r = load_recipe(
        ROOT / "recipes" / "tinyllama-full.yaml",
        {"precision": "bf16-true", "train.micro_batch_size": 2, "data.max_seq_length": 256},
    )
    cfg = resolve_config(r)
    roomy = plan(r, Target("cuda", find_gpu("a100-80gb"), 1), config=cfg)
    assert not any(n.startswith(FULL_DEPTH_REPLAY) for n in roomy.notes)
    tight = plan(r, Target("cuda", _gpu_of(roomy.needed_total / GIB), 1), config=cfg)
    assert any(n.startswith("replayed at full depth because") for n in tight.notes), tight.notes
    full_needed = replay_full_depth(r, cfg, (8, 0))[1]
    workspaces = CUBLAS_HANDLES * cublas_workspace_bytes(find_gpu("a100-80gb"))
    assert abs(tight.needed_total - (full_needed + workspaces + CUDA_CONTEXT_BYTES)) <= 2**20
