"""Sweeps (ladders) and the comparison report, end to end on the tiny preset on the CPU.

One small sweep runs once for the module (each variant in its own process): two that train, one that
must run out of memory under ``memory.cap_gib``, one whose data is broken (a crash without a summary)
and one killed by its timeout. The other tests reuse its folder.
"""

from __future__ import annotations

import csv
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from bigtune.cli.sweep import main as sweep_cli
from bigtune.sweep.ladder import SweepError, expand_grid, load_sweep, read_sweep, run_sweep
from bigtune.sweep.report import CAT_COLORS, SERIES, ReportError, write_report
from conftest import CHROMIUM, NO_CHROMIUM, chromium, console_messages, page_ink

ROOT = Path(__file__).resolve().parents[1]
LADDER = ROOT / "ladders" / "llm-single.yaml"

BASE = {
    "model": {"name": "tiny-llama"},
    "data": {"source": "demo", "max_seq_length": 64},
    "train": {"micro_batch_size": 4, "max_steps": 3, "max_epochs": None, "log_every_steps": 1},
    "checkpoint": {"save_model": False},
    "accelerator": "cpu",
}


def write_sweep(folder: Path, variants: list, name: str = "tiny-check", **top) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "base": BASE, "variants": variants, **top}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    bad = d / "broken.jsonl"
    bad.write_text('{"instruction": "Name a fruit.", "output": "Apple."}\n{this is not json\n')
    path = write_sweep(
        d,
        [
            {"name": "base", "expect": "ok"},
            {
                "name": "act-ckpt",
                "overrides": {"train.activation_checkpointing": True},
                "note": "recompute activations in backward",
            },
            {"name": "capped", "overrides": {"memory.cap_gib": 0.004}, "expect": "oom", "note": "a 4 MiB device"},
            {"name": "broken-data", "overrides": {"data.source": str(bad)}},
            {"name": "slow", "timeout_s": 1},
        ],
    )
    out = d / "out"
    rows = run_sweep(path, out_dir=out, quiet=True)
    return path, out, rows


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["variant"]: r for r in rows}


def test_sweep_runs_every_variant_and_records_failures(swept):
    path, out, rows = swept
    r = by_name(rows)
    assert [x["variant"] for x in rows] == ["base", "act-ckpt", "capped", "broken-data", "slow"]
    assert r["base"]["status"] == "ok" and r["base"]["expect_met"] is True
    assert r["act-ckpt"]["status"] == "ok"
    for name in ("base", "act-ckpt"):
        assert r[name]["peak_allocated_bytes"] > 0 and r[name]["tokens_per_s"] > 0
        assert r[name]["final_loss"] is not None and r[name]["steps"] == 3
        assert r[name]["plan"]["predicted_peak_allocated"] > 0
    # activation checkpointing must show up in the measurement
    assert r["act-ckpt"]["peak_allocated_bytes"] < r["base"]["peak_allocated_bytes"]

    # the OOM is a result with its phase, and the sweep went on to the next variants
    capped = r["capped"]
    assert capped["status"] == "oom" and capped["expect_met"] is True and capped["exit_code"] == 3
    assert capped["oom"]["phase"] in ("forward", "backward", "optimizer") and capped["oom"]["step"] == 0
    assert capped["capacity_bytes"] == int(0.004 * 1024**3)

    crashed = r["broken-data"]
    assert crashed["status"] == "crashed" and crashed["exit_code"] == 2
    assert "broken.jsonl" in crashed["log_tail"]
    assert r["slow"]["status"] == "timeout" and r["slow"]["exit_code"] != 0

    for name in r:
        assert (out / name / "sweep.log").is_file(), name
        assert not (out / f".{name}.running.log").exists()
    assert "--set" in r["base"]["command"] and f"output_dir={out / 'base'}" in r["base"]["command"]

    doc = json.loads((out / "sweep.json").read_text())
    assert [x["variant"] for x in doc["rows"]] == list(r)
    assert doc["definition"]["name"] == "tiny-check" and doc["command"][:2] == ["bigtune", "sweep"]
    assert {x["status"] for x in doc["rows"]} == {"ok", "oom", "crashed", "timeout"}
    assert not list(out.glob(".*.tmp"))


NS = {"s": "http://www.w3.org/2000/svg"}


def tagged(svg: ET.Element) -> dict[str, dict[str, ET.Element]]:
    """The groups of a plot's SVG that carry a variant's id (``variant-<name>:<part>``): {name: {part: group}}."""
    out: dict[str, dict[str, ET.Element]] = {}
    for g in svg.iterfind(".//s:g[@id]", NS):
        if g.get("id").startswith("variant-"):
            name, part = g.get("id").removeprefix("variant-").split(":", 1)
            out.setdefault(name, {})[part] = g
    return out


def height(group: ET.Element) -> float:
    """The vertical extent of the paths drawn in ``group``, in the SVG's units."""
    ys = [float(y) for p in group.iterfind(".//s:path", NS) for y in re.findall(r"[-\d.]+ ([-\d.]+)", p.get("d"))]
    return max(ys) - min(ys) if ys else 0.0


def shown(group: ET.Element) -> str:
    """The text ``group`` draws (its <title>, the hover text, left out)."""
    return "".join(t.text or "" for t in group.iterfind(".//s:text", NS))


def test_report_writes_markdown_csv_and_self_contained_html(swept, tmp_path):
    _, out, _ = swept
    res = write_report(out)
    for key in ("markdown", "csv", "html"):
        assert Path(res[key]).is_file()
    assert sorted(Path(p).name for p in res["svgs"]) == ["loss.svg", "memory.svg", "throughput.svg"]
    assert sorted(Path(p).name for p in res["pngs"]) == ["loss.png", "memory.png", "throughput.png"]
    for p in res["pngs"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(p).stat().st_size > 10_000, p

    rows = {r["variant"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert list(rows) == ["base", "act-ckpt", "capped", "broken-data", "slow"]
    assert rows["capped"]["status"] == "oom" and rows["capped"]["oom_phase"] in ("forward", "backward", "optimizer")
    base = rows["base"]
    assert float(base["peak_allocated_gib"]) > 0 and float(base["parameters_gib"]) > 0
    assert float(base["activations_gib"]) > 0 and float(base["predicted_peak_gib"]) > 0
    assert base["prediction_error_pct"] != "" and float(base["tokens_per_s"]) > 0
    assert rows["broken-data"]["status"] == "crashed"

    md = (out / "report.md").read_text()
    assert "| capped | oom" in md and "(memory.svg)" in md and "out of memory in" in md

    page = (out / "report.html").read_text()
    assert page.count("<svg") == 3 and page.count("</svg>") == 3
    assert not re.search(r"https?://", page), "the report must not refer to anything on the network"
    # the plots refer only to their own parts (a clip path, a tick mark), by an id the page holds, once
    assert not re.search(r"""(src|href)\s*=\s*(?!["']?#)|url\((?!#)|@import""", page, re.I)
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "ids repeat across the inline plots"
    assert set(re.findall(r'(?:href="|url\()#([^")]+)', page)) <= set(ids)

    # (a) memory: every variant has its marks; the ones that measured something a stacked bar of positive height
    mem = tagged(ET.parse(out / "memory.svg").getroot())
    assert set(mem) == {"base", "act-ckpt", "capped", "broken-data", "slow"}
    for name in ("base", "act-ckpt"):
        assert {"measured:parameters", "measured:activations", "plan:parameters", "name"} <= set(mem[name]), name
        assert all(height(mem[name][k]) > 0 for k in mem[name] if k.startswith(("measured:", "plan:"))), name
        assert mem[name]["measured:parameters"].findtext("s:title", namespaces=NS).startswith(f"{name}: parameters")
    capped = mem["capped"]
    assert any(height(g) > 0 for k, g in capped.items() if k.startswith("measured:") or k == "oom:nothing-measured")
    assert shown(capped["oom"]).startswith("OOM") and "capacity" in capped
    assert shown(mem["broken-data"]["status"]) == "crashed" and shown(mem["slow"]["status"]) == "timeout"
    # (b) throughput bars for the variants that trained
    tp = tagged(ET.parse(out / "throughput.svg").getroot())
    bars = [parts["tokens_per_s"] for parts in tp.values() if "tokens_per_s" in parts]
    assert len(bars) == 2 and all(height(b) > 0 for b in bars)
    # (c) one curve per variant that logged a loss, a marker per logged step
    loss = tagged(ET.parse(out / "loss.svg").getroot())
    curves = {name: parts["loss"] for name, parts in loss.items() if "loss" in parts}
    assert set(curves) == {"base", "act-ckpt"}
    for c in curves.values():
        assert len(c.findall(".//s:use", NS)) == 3
    # the inline copies carry the same content
    inline = page[page.index("<svg") : page.index("</svg>")]
    assert 'class="plot memory"' in inline and inline.count('id="variant-base:measured:parameters"') == 1
    assert "<path" in inline

    # the same results draw the same plots, byte for byte
    again = write_report(out, out_dir=tmp_path / "again")
    for first, second in zip(sorted(res["svgs"]), sorted(again["svgs"])):
        assert Path(first).read_bytes() == Path(second).read_bytes(), Path(first).name


def test_rerun_skips_finished_variants_and_rerun_runs_them(swept, capsys):
    path, out, _ = swept
    before = {n: (out / n / "summary.json").stat().st_mtime_ns for n in ("base", "act-ckpt", "capped")}
    rows = by_name(run_sweep(path, out_dir=out, only=["base", "act-ckpt", "capped", "slow"], quiet=True))
    for n in before:
        assert rows[n]["reused"] is True
        assert (out / n / "summary.json").stat().st_mtime_ns == before[n], f"{n} ran again"
    assert rows["slow"]["status"] == "timeout" and rows["slow"]["reused"] is False  # unfinished: runs again
    assert rows["broken-data"]["status"] == "crashed"  # not selected: its earlier row is kept

    log_before = (out / "base" / "sweep.log").stat().st_mtime_ns
    rc = sweep_cli(["sweep", str(path), "--out", str(out), "--rerun", "--only", "base", "--no-report"])
    assert rc == 0
    assert (out / "base" / "summary.json").stat().st_mtime_ns > before["base"]
    assert (out / "base" / "sweep.log").stat().st_mtime_ns > log_before
    assert (out / "capped" / "summary.json").stat().st_mtime_ns == before["capped"]
    assert not (out / "base-2").exists()
    doc = by_name(json.loads((out / "sweep.json").read_text())["rows"])
    assert doc["base"]["status"] == "ok" and doc["base"]["reused"] is False
    assert doc["capped"]["status"] == "oom"
    # a variant that failed (bad data: crashed) is the one thing that makes the exit status non-zero
    assert sweep_cli(["sweep", str(path), "--out", str(out), "--only", "broken-data", "--no-report"]) == 1
    assert "base" in capsys.readouterr().out


def test_misspelled_key_is_rejected_before_anything_runs(tmp_path, capsys):
    path = write_sweep(
        tmp_path,
        [
            {"name": "fine", "overrides": {"precision": "bf16-true"}},
            {"name": "typo", "overrides": {"train.micro_bach_size": 2}},
        ],
    )
    out = tmp_path / "out"
    with pytest.raises(SweepError) as e:
        run_sweep(path, out_dir=out, quiet=True)
    msg = str(e.value)
    assert str(path) in msg and "variant 'typo'" in msg and "train.micro_bach_size" in msg
    assert "did you mean train.micro_batch_size" in msg and "variants[1].overrides" in msg
    assert "'fine'" not in msg
    assert not out.exists()
    assert sweep_cli(["sweep", str(path), "--out", str(out)]) == 2
    assert "train.micro_bach_size" in capsys.readouterr().err
    assert not out.exists()


def test_bad_sweep_file_lists_every_problem_at_once(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "bad",
                "base": "missing-recipe.yaml",
                "varients": [],
                "variants": [{"name": "a", "expect": "maybe"}, {"name": "a"}, {"name": "b", "overides": {}}],
            }
        )
    )
    with pytest.raises(SweepError) as e:
        read_sweep(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "varients: unknown top-level key; did you mean variants?" in msg
    assert "missing-recipe.yaml not found" in msg
    assert "expect: 'maybe' is not allowed; use ok or oom" in msg
    assert "'a' is used 2 times" in msg
    assert "overides: unknown variant key; did you mean overrides?" in msg
    with pytest.raises(SweepError, match="no tiny: block"):
        load_sweep(write_sweep(tmp_path, [{"name": "x"}], name="no-tiny"), tiny=True)


def test_grid_expands_into_named_variants(tmp_path):
    grid = {"precision": ["32-true", "bf16-true"], "train.micro_batch_size": [1, 2]}
    names = [n for n, _ in expand_grid(grid)]
    assert names == [
        "precision-32-true_micro_batch_size-1",
        "precision-32-true_micro_batch_size-2",
        "precision-bf16-true_micro_batch_size-1",
        "precision-bf16-true_micro_batch_size-2",
    ]
    path = write_sweep(
        tmp_path, [{"name": "first"}], grid=grid, common={"train": {"max_steps": 2}}, tiny={"data.max_seq_length": 32}
    )
    s = load_sweep(path, tiny=True)
    assert [v.name for v in s.variants] == ["first"] + names
    over = s.overrides_for(s.variants[-1], tiny=True)
    assert over["precision"] == "bf16-true" and over["train.micro_batch_size"] == 2
    assert over["train.max_steps"] == 2 and over["data.max_seq_length"] == 32


def test_report_on_a_single_run(swept, tmp_path, capsys):
    _, out, _ = swept
    dest = tmp_path / "single"
    assert sweep_cli(["report", str(out / "act-ckpt"), "--out", str(dest), "--open"]) == 0
    text = capsys.readouterr().out
    assert "status ok" in text and "tokens/s" in text and "loss" in text
    assert "memory at step" in text and "after_backward" in text
    assert (dest / "report.html").resolve().as_uri() in text
    for f in (
        "report.md",
        "results.csv",
        "report.html",
        "memory.svg",
        "throughput.svg",
        "loss.svg",
        "memory.png",
        "throughput.png",
        "loss.png",
    ):
        assert (dest / f).stat().st_size > 0
    assert "## Memory per phase" in (dest / "report.md").read_text()

    assert sweep_cli(["report", str(out / "capped"), "--out", str(tmp_path / "oom")]) == 0
    assert "OUT OF MEMORY in" in capsys.readouterr().out

    with pytest.raises(ReportError, match="neither sweep.json"):
        write_report(tmp_path / "single")
    assert sweep_cli(["report", str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("tiny", [False, True])
def test_llm_single_ladder_validates(tiny):
    s = load_sweep(LADDER, tiny=tiny)
    names = [v.name for v in s.variants]
    assert len(names) == 13 and names[0] == "tinyllama-32-true"
    assert {"tinyllama-act-ckpt", "tinyllama-sgd", "open-llama-7b-bf16-true", "open-llama-13b-sgd"} <= set(names)
    for v in s.variants:
        over = s.overrides_for(v, tiny)
        if tiny:
            assert over["model.name"] == "tiny-llama" and over["accelerator"] == "cpu"
        else:
            assert over["model.init"] == "random" and "/" in over.get("model.name", "TinyLlama/")
    header = LADDER.read_text().split("\nname:")[0]
    assert "DeepSpeed" in header  # the rung still missing is named in the header
    assert {"tinyllama-adamw8bit", "tinyllama-cpu-offload-adamw", "open-llama-7b-lora", "open-llama-13b-qlora"} <= set(
        names
    )


def _has(colours: set, hex_color: str, tol: int = 10) -> bool:
    """``hex_color`` (give or take anti-aliasing) among ``colours``."""
    want = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return any(all(abs(a - b) <= tol for a, b in zip(c, want)) for c in colours)


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_report_renders_in_headlesschromium(swept, tmp_path):
    _, out, _ = swept
    res = write_report(out, out_dir=tmp_path / "r")
    html_path = Path(res["html"]).resolve()

    # 1) the whole page: loads without a console message and is drawn
    png = tmp_path / "report.png"
    run = chromium(f"--screenshot={png}", "--window-size=1400,3000", html_path.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    assert not console_messages(run.stderr), console_messages(run.stderr)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ink, _ = page_ink(png)
    assert ink > 0.03, f"the page screenshot is nearly blank ({ink:.3%} non-white)"

    # 2) the DOM Chromium built: three inline SVG plots, each with drawn content
    dom = chromium("--dump-dom", html_path.as_uri())
    assert dom.returncode == 0 and not console_messages(dom.stderr)
    plots = re.findall(r'<svg[^>]*class="plot (\w+)".*?</svg>', dom.stdout, re.S)
    assert plots == ["memory", "throughput", "loss"]
    marks = {"memory": ":measured:", "throughput": ':tokens_per_s"', "loss": ':loss"'}
    for kind, svg in zip(plots, re.findall(r'<svg[^>]*class="plot \w+".*?</svg>', dom.stdout, re.S)):
        assert svg.count(marks[kind]) >= 2, f"{kind}: too few data marks in the rendered DOM"

    # 3) each plot, rendered on its own from the page's markup, shows its marks in their colours
    page = html_path.read_text()
    style = re.search(r"<style>.*?</style>", page, re.S).group(0)
    expect = {
        "memory": [CAT_COLORS["parameters"], CAT_COLORS["activations"], CAT_COLORS["transient"]],
        "throughput": ["#4e79a7", "#f28e2b"],
        "loss": [SERIES[0], SERIES[1]],
    }
    found = list(re.finditer(r'(<svg class="plot (\w+)" width="([\d.]+)" height="([\d.]+)".*?</svg>)', page, re.S))
    assert [m.group(2) for m in found] == ["memory", "throughput", "loss"]
    for m in found:
        markup, kind, w, h = m.group(1), m.group(2), float(m.group(3)), float(m.group(4))
        one = tmp_path / f"{kind}.html"
        one.write_text(
            f"<!DOCTYPE html><html><head><meta charset=utf-8>{style}</head>"
            f"<body style='margin:0'>{markup}</body></html>"
        )
        shot = tmp_path / f"{kind}.png"
        run = chromium(f"--screenshot={shot}", f"--window-size={int(w) + 40},{int(h) + 40}", one.resolve().as_uri())
        assert run.returncode == 0 and not console_messages(run.stderr), kind
        ink, colours = page_ink(shot, (0, 0, int(w), int(h)))
        assert ink > 0.04, f"{kind} plot is nearly empty ({ink:.3%} non-white)"
        for c in expect[kind]:
            assert _has(colours, c), f"{kind} plot lacks {c}"
    # 4) the PNG copies of the plots are pictures too
    for f in res["pngs"]:
        ink, colours = page_ink(Path(f))
        assert ink > 0.04, f
    ink, colours = page_ink(Path(res["pngs"][0]))
    assert _has(colours, CAT_COLORS["parameters"]) and _has(colours, CAT_COLORS["activations"])
