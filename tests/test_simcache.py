"""The simulation cache (plan/step/simcache.py): a second plan of the same step reads the first one's simulations
and gives the same plan, to the bit; any input or code change is another key; a bad file is simulated again."""

from __future__ import annotations

import pytest

from bigtune.models.configs import resolve_config
from bigtune.plan.base.target import Target
from bigtune.plan.planner import plan
from bigtune.plan.step import simcache
from bigtune.plan.step import simulate as sim_mod
from bigtune.plan.step.quantized import NF4Base
from bigtune.plan.step.simulate import Sim
from bigtune.recipe import load_recipe


def _recipe(**over):
    return load_recipe({}, {"model.name": "tiny-llama", "accelerator": "cpu", "data.max_seq_length": 32, **over})


def test_a_sim_survives_the_round_trip_through_json():
    nf4 = NF4Base(((64, 32), (32, 64)), 10, 20, 2, 30)
    sim = Sim(
        {"after_forward": {"activations": 5, "parameters": 7}},
        123,
        456,
        400,
        300,
        ("flash",),
        ops={("gemm", "forward", "mm", ((4, 8), (8, 2))): [1, 2.5, 3.25]},
        fsdp_upcast=(1, 2),
        nf4=nf4,
        segments={"after_forward": [(1, 2)]},
    )
    back = simcache.decode(simcache.encode(sim))
    assert back == sim and isinstance(back.nf4, NF4Base) and isinstance(back.attention, tuple)


def test_a_file_naming_another_class_is_refused():
    bad = {"__dataclass__": "os:system", "fields": {}}
    with pytest.raises(ValueError, match="never stores"):
        simcache.decode(bad)


def test_a_second_plan_reads_the_first_ones_simulations(tmp_path, monkeypatch):
    r = _recipe()
    monkeypatch.setenv(simcache.ENV, "off")
    fresh = plan(r, Target("cpu")).to_dict()
    monkeypatch.setenv(simcache.ENV, str(tmp_path))
    first = plan(r, Target("cpu")).to_dict()
    stored = sorted(tmp_path.glob("*.json"))
    assert stored, "the first plan stored its simulations"

    def no_simulation(*args, **kwargs):
        raise AssertionError("simulated again although the cache holds this step")

    monkeypatch.setattr(sim_mod, "_run_steps", no_simulation)  # every simulated step runs it
    second = plan(r, Target("cpu")).to_dict()
    assert sorted(tmp_path.glob("*.json")) == stored
    for p in (first, second):
        assert p | {"plan_seconds": 0} == fresh | {"plan_seconds": 0}


def test_every_input_and_the_code_are_in_the_key(monkeypatch):
    r = _recipe()
    cfg = resolve_config(r)
    k = simcache.key(r, cfg, depths=2, cuda=True)
    assert k == simcache.key(_recipe(), resolve_config(_recipe()), depths=2, cuda=True)
    assert k != simcache.key(_recipe(**{"train.micro_batch_size": 3}), cfg, depths=2, cuda=True)
    assert k != simcache.key(r, cfg, depths=3, cuda=True)
    assert k != simcache.key(r, cfg, depths=2, cuda=False)
    deeper = resolve_config(r)
    deeper.num_hidden_layers += 1
    assert k != simcache.key(r, deeper, depths=2, cuda=True)
    monkeypatch.setattr(simcache, "code_version", lambda: "another version of bigtune")
    assert k != simcache.key(r, cfg, depths=2, cuda=True)


def test_the_code_version_reads_the_whole_package():
    names = {p.relative_to(simcache.package_root()).as_posix() for p in simcache.source_files()}
    assert {"engine/loop.py", "recipe.py", "models/build.py", "plan/step/simulate.py"} <= names


def test_a_damaged_file_is_simulated_again(tmp_path, monkeypatch):
    monkeypatch.setenv(simcache.ENV, str(tmp_path))
    calls = []
    r, cfg = _recipe(), None

    def compute():
        calls.append(1)
        return Sim({}, 1, 2, 3)

    simcache.cached(compute, r, cfg, depths=1)
    (path,) = tmp_path.glob("*.json")
    path.write_text('{"__dataclass__": "bigtune.plan.step.simulate:Sim", "fie')
    assert simcache.cached(compute, r, cfg, depths=1) == Sim({}, 1, 2, 3)
    assert len(calls) == 2 and simcache.decode(__import__("json").loads(path.read_text())) == Sim({}, 1, 2, 3)


@pytest.mark.parametrize("value, folder", [("off", None), ("", None), ("0", None)])
def test_the_cache_is_off_when_asked(monkeypatch, value, folder):
    monkeypatch.setenv(simcache.ENV, value)
    assert simcache.folder() is folder


def test_on_means_the_users_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(simcache.ENV, "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert simcache.folder() == tmp_path / "bigtune" / "sims"
