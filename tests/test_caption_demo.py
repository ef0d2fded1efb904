"""`bigtune caption` on a BLIP-2 run asks no chat question (issue #42: the demo wrote "eggs in a bowl on a
wooden table" for every photo).

A run's recipe.yaml always holds data.prompt (its default, "Write alt text for this photo."); the caption CLI
used it as the text every caption continues, for BLIP-2 too, which trains on the caption alone. Led by words
it never saw, the demo model continued them the same way for every photo. data.prompt is the question a chat
VLM is trained to answer; BLIP-2 captions from the image tokens and BOS alone, as in training.
"""

from __future__ import annotations

import pytest
import torch

from bigtune.cli.app import main as cli_main
from bigtune.data.images import DEMO_IMAGES
from bigtune.run.training import train
from conftest import ROOT

DEMO = ROOT / "recipes" / "gourmetgram-demo.yaml"


@pytest.fixture(scope="module")
def blip2_run(tmp_path_factory):
    torch.set_num_threads(1)  # tiny model: threads only add contention on a shared machine
    run = tmp_path_factory.mktemp("cap") / "run"
    s = train(
        str(DEMO),
        {
            "output_dir": str(run),
            "train.max_steps": 1,
            "train.max_epochs": None,
            "data.val_fraction": 0.0,
            "data.num_train_samples": 16,
            "memory.plan": False,
            "memory.enabled": False,
        },
        quiet_recipe=True,
    )
    assert s["status"] == "ok"
    assert "prompt: Write alt text" in (run / "recipe.yaml").read_text()  # the default the CLI must not use
    return run


def _prompt_passed(monkeypatch, argv: list[str]) -> str:
    """The prompt `bigtune caption argv` hands to caption_images."""
    import bigtune.cli.caption as cli_caption

    seen = []

    def fake(model, processor, paths, batch_size, max_new_tokens, prompt, **kw):
        seen.append(prompt)
        return [{"image": p, "caption": "x"} for p in paths], []

    monkeypatch.setattr(cli_caption, "caption_images", fake)
    assert cli_main(argv) == 0
    return seen[0]


def test_blip2_run_is_captioned_without_the_chat_prompt(blip2_run, monkeypatch, capsys):
    image = str(sorted((DEMO_IMAGES / "images").glob("*.png"))[0])
    assert _prompt_passed(monkeypatch, ["caption", image, "--model", str(blip2_run)]) == ""
    assert _prompt_passed(monkeypatch, ["caption", image, "--model", str(blip2_run / "model")]) == ""
    # a prompt the user gives is still the text the caption continues
    given = ["caption", image, "--model", str(blip2_run), "--prompt", "a photo of"]
    assert _prompt_passed(monkeypatch, given) == "a photo of"
