"""The caching-allocator model (reserved memory) and its use in the planner."""

from __future__ import annotations

import copy

from bigtune.models.configs import resolve_config
from bigtune.plan.allocator import CachingAllocator, replay, round_size, segment_size
from bigtune.plan.simulate import estimate_reserved, simulate, simulate_full_depth
from bigtune.recipe import load_recipe
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
    from bigtune.plan.simulate import _replay_steady

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
    reserved, in_use = _replay_steady(events, 4)
    three_steps = replay(events + [("alloc", 5, act), ("free", 4), ("free", 5), ("alloc", 6, g)]).stats
    assert (reserved, in_use) == (three_steps.peak_reserved, three_steps.peak_in_use)
    assert three_steps.peak_allocated == 128 * MiB + g + act


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
    assert traced.peak_allocated <= traced.in_use <= traced.reserved


def test_reserved_extrapolation_close_to_a_full_depth_replay():
    """Reserved from two shallower traced steps vs the replay of the whole 14-layer step."""
    r, cfg = _tinyllama(14)
    full = simulate(r, cfg, 14, cuda=True, trace=True)
    sim = simulate_full_depth(r, cfg, cuda=True)
    assert sim.peak_allocated == full.peak_allocated  # allocated extrapolates exactly
    estimate, in_use, how = estimate_reserved(r, cfg, sim, (9, 0))
    assert abs(estimate - full.reserved) / full.reserved < 0.03, (estimate, full.reserved)
    assert abs(in_use - full.in_use) / full.in_use < 0.03, (in_use, full.in_use)
    assert "8 blocks deep" in how[0]
