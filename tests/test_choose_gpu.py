"""Which GPU, how many, how long, what cost: plan --compare-gpus / --cluster, launch slurm's shape and --cluster."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from bigtune.core.gpus import CATALOG, compute_capability, custom_gpu, find_gpu
from bigtune.plan.base.target import Plan
from bigtune.plan.search.choose import (
    Choice,
    Comparison,
    compare,
    gpus_and_strategy,
    kernel_class,
    limits,
    pick_partition,
)
from bigtune.plan.search.offers import Offer, OfferError, format_slurm_time, load_cluster, load_prices, parse_slurm_time
from bigtune.plan.search.runlength import EVAL_SHARE_OF_TRAIN_SAMPLE, DataSize, RunLength, data_size, run_length
from bigtune.recipe import load_recipe
from conftest import ROOT, run_cli

GIB = 2**30
TINY = str(ROOT / "recipes" / "tiny-opt.yaml")
BIG = str(ROOT / "recipes" / "open-llama-7b-full.yaml")
EXAMPLE = ROOT / "examples" / "university-cluster.yaml"


def _plan(target: str, step_s: float, variant: str = "v", **over) -> Plan:
    return Plan("r", target, variant, {}, GIB, GIB, 0, GIB, 10 * GIB, True, 1, step_s, 1.0, 1, overrides=over)


def _choice(offer: Offer, gpus: int, step_s: float, steps: int = 3600) -> Choice:
    label = f"{gpus}× {offer.gpu.key}" + (" (fsdp)" if gpus > 1 else "")
    return Choice(offer, gpus, "fsdp", _plan(label, step_s), RunLength(steps, steps, 0, 0), steps * step_s, 0.0)


# ----------------------------------------------------------------------------------- ranking, known answer


def test_ranking_by_cost_and_by_time_on_a_synthetic_catalog():
    a = Offer("a", custom_gpu(40, CATALOG["a100-sxm-40gb"]), 8, 8, 2.0, "USD")
    b = Offer("b", custom_gpu(24, CATALOG["a10-24gb"]), 8, 8, 1.0, "USD")
    c = Offer("c", custom_gpu(80, CATALOG["h100-sxm-80gb"]), 8, 8, None, "USD")  # no price
    # 3600 steps: a on 1 GPU 1 h = 2.00, on 2 GPUs 0.6 h = 2.40; b 3 h = 3.00; c 0.5 h, no price
    rows = [_choice(a, 1, 1.0), _choice(a, 2, 0.6), _choice(b, 1, 3.0), _choice(c, 1, 0.5)]
    cmp = Comparison("r", DataSize(3600, 0, "test"), rows, {}, [a, b, c])
    by_cost = cmp.ranked("cost")
    assert [(x.offer.name, x.gpus) for x in by_cost] == [("a", 1), ("b", 1)]
    assert [x.cost for x in by_cost] == pytest.approx([2.0, 3.0])
    by_time = cmp.ranked("time")
    assert [(x.offer.name, x.gpus) for x in by_time] == [("c", 1), ("a", 2), ("b", 1)]
    assert [x.seconds / 3600 for x in by_time] == pytest.approx([0.5, 0.6, 3.0])
    # the filters: a budget of 2.5 leaves a's 2-GPU row out (2.40 fits, 3.00 does not), no price fails a budget
    for x in rows:
        x.excluded = limits(x, max_hours=2.0, budget=2.5)
    assert [(x.offer.name, x.gpus) for x in cmp.ranked("time")] == [("a", 2)]  # one row per GPU type
    assert [(x.offer.name, x.gpus) for x in cmp.ranked("cost")] == [("a", 1)]
    assert rows[2].excluded[0].startswith("over --max-hours")
    assert rows[3].excluded == ["no price (--budget needs one)"]
    assert set(cmp.not_ranked()) == {"b", "c"}


def test_gpu_count_and_strategy_come_from_the_plan():
    assert gpus_and_strategy(_plan("8× h100-sxm-80gb (fsdp)", 1)) == (8, "fsdp")
    assert gpus_and_strategy(_plan("1× a10-24gb", 1)) == (1, "single")
    assert gpus_and_strategy(_plan("1× a10-24gb", 1, "bf16-true, 1 GPU deepspeed_stage_2_offload, micro 2")) == (
        1,
        "deepspeed_stage_2_offload",
    )


def test_one_simulation_per_kernel_class_is_what_sdpa_would_choose():
    """compare() shares simulations between GPUs of one kernel_class: every catalog GPU of a class must get
    the same attention kernel as the class's stand-in for any query (kernels.sdpa_backend)."""
    from bigtune.plan.device.kernels import sdpa_backend

    cases = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for mask in (None, torch.ones(1, 1, 4, 4, dtype=torch.bool)):
            for head_dim in (64, 128, 320):
                for kv_heads, gqa in ((8, False), (2, True), (2, False)):
                    q, k = (
                        torch.empty(1, 8, 4, head_dim, dtype=dtype),
                        torch.empty(1, kv_heads, 4, head_dim, dtype=dtype),
                    )
                    cases.append((q, k, mask, gqa))
    for gpu in CATALOG.values():
        arch = compute_capability(gpu)
        assert [sdpa_backend(q, k, m, g, arch) for q, k, m, g in cases] == [
            sdpa_backend(q, k, m, g, kernel_class(arch)) for q, k, m, g in cases
        ], gpu.key


# ----------------------------------------------------------------------------------------- run length


def test_whole_run_time_is_steps_times_step_time_plus_evaluation(tmp_path):
    """The bundled demo data (640 samples) read as train reads it: 10% held out, 2 epochs at 8 × 2 per step."""
    over = [
        "data.val_fraction=0.1",
        "eval.every_steps=10",
        "train.max_steps=null",
        "train.max_epochs=2",
        "precision=32-true",
    ]
    r = load_recipe(TINY, over + ["accelerator=cpu"])
    size = data_size(r)
    assert (size.train, size.validation) == (576, 64)
    length = run_length(r, size, world=1, micro=8, accumulate=2)
    assert (length.steps_per_epoch, length.steps) == (36, 72)  # ceil(576 / 8) = 72 micro-batches, 2 per step
    assert (length.evaluations, length.eval_batches) == (8, 8)  # steps 10..70 and the end; 64 / 8
    # --samples: the recipe's own split and selection rules on the given size
    assert data_size(r, samples=1000).train == 900 and data_size(r, samples=1000).validation == 100
    gpu = "rtx-4090"
    res = run_cli("plan", TINY, *sum((["--set", o] for o in over), []), "--compare-gpus", gpu, "--max-gpus", "1",
                  "--json", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    (row,) = out["rows"]
    assert row["gpus"] == 1 and row["steps"] == 72 and row["evaluations"] == 8
    micro = row["overrides"].get("train.micro_batch_size", 8)
    assert row["train_s"] == pytest.approx(72 * row["step_time_s"])
    per_sample = row["step_time_s"] / 16  # a step is 16 samples on one GPU
    assert row["eval_s"] == pytest.approx(8 * 8 * 8 * per_sample * EVAL_SHARE_OF_TRAIN_SAMPLE)
    assert row["hours"] == pytest.approx((row["train_s"] + row["eval_s"]) / 3600)
    assert row["cost"] == pytest.approx(row["hours"] * 0.74)  # the bundled RTX 4090 price
    assert micro * row["steps"] > 0 and out["by_time"][0]["offer"] == find_gpu(gpu).key


def test_prices_file_overrides_and_bad_files_are_one_clear_error(tmp_path):
    own = tmp_path / "prices.yaml"
    own.write_text("h100-80gb: 1.5\nrtx 4090: 0.2\n")
    table = load_prices(str(own))
    assert table.prices["h100-sxm-80gb"][0] == 1.5 and table.prices["rtx-4090-24gb"][0] == 0.2
    assert table.prices["a100-sxm-80gb"][0] == load_prices().prices["a100-sxm-80gb"][0]  # the rest stays
    eur = tmp_path / "eur.yaml"
    eur.write_text("currency: EUR\nprices: {h100-80gb: 2}\n")
    assert set(load_prices(str(eur)).prices) == {"h100-sxm-80gb"} and load_prices(str(eur)).unit == "EUR"
    bad = tmp_path / "bad.yaml"
    bad.write_text("h100-80gb: cheap\n")
    with pytest.raises(OfferError, match="h100-80gb.*number"):
        load_prices(str(bad))
    res = run_cli("plan", TINY, "--compare-gpus", "h100-80gb", "--prices", str(bad), cwd=tmp_path)
    assert res.returncode == 2 and "bad.yaml" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("plan", TINY, "--budget", "3", cwd=tmp_path)
    assert res.returncode == 2 and "--compare-gpus" in res.stderr


def test_bundled_prices_name_their_source_and_date():
    raw = yaml.safe_load((ROOT / "src" / "bigtune" / "assets" / "gpu_prices.yaml").read_text())
    assert raw["currency"] == "USD" and raw["taken"]
    for key, entry in raw["prices"].items():
        assert key in CATALOG and entry["price"] > 0 and entry["source"] and entry["date"] and entry["offer"]


def test_slurm_times():
    assert parse_slurm_time("2-00:00:00", "x") == 2 * 86400
    assert parse_slurm_time("48:00:00", "x") == 48 * 3600
    assert parse_slurm_time("90", "x") == 90 * 60 and parse_slurm_time("1-12", "x") == 36 * 3600
    assert parse_slurm_time("UNLIMITED", "x") is None
    assert format_slurm_time(3601) == "01:01:00" and format_slurm_time(86400 + 60) == "1-00:01:00"
    with pytest.raises(OfferError, match="max_time"):
        parse_slurm_time("two days", "x")


def test_the_example_cluster_profile_loads():
    name, offers = load_cluster(str(EXAMPLE))
    assert name == "example-university" and {o.gpu.key for o in offers} == {
        "a100-sxm-80gb",
        "a100-sxm-40gb",
        "rtx-a6000-48gb",
        "v100-sxm2-32gb",
        "rtx-2080-ti-11gb",
    }
    assert all(o.unit == "SU" and o.partition is not None for o in offers)


# ----------------------------------------------------------------------------------------- launch slurm


def test_launch_slurm_takes_devices_from_the_recipe(tmp_path):
    from bigtune.models.build import weights_dtype
    from bigtune.models.configs import resolve_config_name
    from bigtune.plan.serving import weight_bytes

    res = run_cli("launch", "slurm", BIG, "--set", "devices=4", "--set", "strategy=fsdp", "--out",
                  str(tmp_path / "job.sbatch"), cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "job.sbatch").read_text()
    r = load_recipe(BIG, ["accelerator=cpu"])
    wb = weight_bytes(resolve_config_name(r.model), "causal-lm", weights_dtype(r.precision))
    mem_gib = math.ceil(4 * (int(wb * 1.25) + 2 * GIB) / GIB)  # four tasks, each loading the weights once
    for line in ("#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4", f"#SBATCH --mem={mem_gib}G"):
        assert line in text, line
    srun = next(x for x in text.splitlines() if x.startswith("srun "))
    assert "devices=4" in srun and "strategy=fsdp" in srun and "num_nodes=1" in srun
    # a flag that contradicts the recipe is one clear error
    res = run_cli("launch", "slurm", BIG, "--set", "devices=4", "--gpus-per-node", "2", cwd=tmp_path)
    assert res.returncode == 2 and "--gpus-per-node 2 contradicts the recipe's devices=4" in res.stderr
    res = run_cli("launch", "slurm", BIG, "--set", "strategy=fsdp", "--strategy", "ddp", cwd=tmp_path)
    assert res.returncode == 2 and "strategy=fsdp" in res.stderr


def _cluster(tmp_path: Path, partitions: dict) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"name": "test", "units": "SU", "partitions": partitions}))
    return path


def _partition(memory: float, units: float, **extra) -> dict:
    return {
        "gpu": "h100-80gb",
        "gpu_memory_gib": memory,
        "gpus_per_node": 4,
        "cpus_per_node": 32,
        "mem_per_node_gib": 256,
        "max_time": "1-00:00:00",
        "units_per_gpu_hour": units,
        **extra,
    }


def test_launch_slurm_cluster_picks_the_cheapest_partition_or_refuses(tmp_path):
    # The same card twice at two rates: the cheaper partition wins; a third is too small to hold anything.
    path = _cluster(
        tmp_path,
        {
            "dear": _partition(79.11, 3.0),
            "cheap": _partition(79.11, 1.0, gres="gpu:h100"),
            "tiny": _partition(0.05, 0.1),
        },
    )
    res = run_cli("launch", "slurm", TINY, "--cluster", str(path), "--out", str(tmp_path / "job.sbatch"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "job.sbatch").read_text()
    directives = {
        x.split("=")[0]: x.split("=", 1)[1].split()[0]
        for x in text.splitlines()
        if x.startswith("#SBATCH") and "=" in x
    }
    assert directives["#SBATCH --partition"] == "cheap"
    n = int(directives["#SBATCH --ntasks-per-node"])
    assert directives["#SBATCH --gres"] == f"gpu:h100:{n}" and directives["#SBATCH --nodes"] == "1"
    assert directives["#SBATCH --mem"].endswith("G") and int(directives["#SBATCH --cpus-per-task"]) >= 2
    assert parse_slurm_time(directives["#SBATCH --time"], "") >= 15 * 60  # the estimate + the stated margin
    assert "estimate x 1.5 + 15 min" in text and "--gpus-per-node" not in text
    # plan --cluster ranks the same partitions (the table docs/how-to/choose-gpu.md shows): the cheaper first,
    # the one too small to hold anything not ranked
    res = run_cli("plan", TINY, "--cluster", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ranked = [line.split()[1] for line in res.stdout.splitlines() if re.match(r"\s+\d+\s+\S+", line)]
    assert ranked and ranked[0] == "cheap" and "dear" in ranked and "tiny" not in ranked, res.stdout
    # flags the profile fills are refused with it
    res = run_cli("launch", "slurm", TINY, "--cluster", str(path), "--partition", "dear", cwd=tmp_path)
    assert res.returncode == 2 and "--partition" in res.stderr
    # nothing fits: refused with the largest partition's shortfall
    small = _cluster(tmp_path, {"tiny": _partition(0.05, 0.1), "tinier": _partition(0.04, 0.1)})
    res = run_cli("launch", "slurm", TINY, "--cluster", str(small), "--out", str(tmp_path / "no.sbatch"), cwd=tmp_path)
    assert res.returncode == 2 and not (tmp_path / "no.sbatch").exists()
    assert "no partition of the cluster fits" in res.stderr and "On the largest, tiny" in res.stderr
    assert "short by" in res.stderr


def test_compare_and_launch_the_7b_recipe_on_the_example_cluster(tmp_path):
    """The README's answer: the 7B full fine-tune on the example university cluster (the command
    docs/how-to/choose-gpu.md shows, run in this process so its one comparison is also the one checked)."""
    from unittest import mock

    from bigtune.cli.app import main
    from bigtune.plan.search import choose

    seen = []

    def kept(*args, **kwargs):
        seen.append(compare(*args, **kwargs))
        return seen[-1]

    argv = [
        "launch",
        "slurm",
        BIG,
        "--cluster",
        str(EXAMPLE),
        "--samples",
        "2000",
        "--out",
        str(tmp_path / "job.sbatch"),
    ]
    with mock.patch.object(choose, "compare", kept):
        assert main(argv) == 0
    (cmp,) = seen
    best = pick_partition(cmp, load_recipe(BIG, ["accelerator=cpu"], check=False))
    assert best.offer.gpu.key not in ("v100-sxm2-32gb", "rtx-2080-ti-11gb")  # no bf16 there
    assert {"gpu-v100", "gpu-2080ti"} <= set(cmp.not_ranked())
    text = (tmp_path / "job.sbatch").read_text()
    tasks = best.gpus // best.nodes
    for line in (
        f"#SBATCH --partition={best.offer.name}",
        f"#SBATCH --nodes={best.nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --gres={best.offer.partition.gres}:{tasks}",
        f"#SBATCH --cpus-per-task={best.cpus_per_task}",
        f"#SBATCH --mem={best.host_mem_bytes // GIB}G",
        f"#SBATCH --time={format_slurm_time(best.slurm_time_s)}",
    ):
        assert line in text, line
