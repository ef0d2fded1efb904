"""Chat data: the loss mask, token for token, against masks built by hand for every built-in template; bad
records, truncation and packing; templates that cannot give an exact mask; chat generation; the chat demo.

Everything runs offline on the bundled tiny tokenizer (with a template's special tokens added where it
has them) and files written under tmp_path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bigtune.core.presets import DEMO_CHAT_DATA, tiny_tokenizer
from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.chat import BUILTIN_TEMPLATES, chat_messages, encode_prompt, turn_end_ids
from bigtune.data.text import DataError, build_examples, pack_examples
from bigtune.recipe import DataConfig
from conftest import ROOT, read_jsonl, run_cli

SYSTEM = "Be brief."
CONV = [
    {"role": "user", "content": "What is in ramen?"},
    {"role": "assistant", "content": "Noodles and broth."},
    {"role": "user", "content": "What color is it?"},
    {"role": "assistant", "content": "It is brown."},
]
WITH_SYSTEM = [{"role": "system", "content": SYSTEM}] + CONV


# -- hand-built masks ---------------------------------------------------------------------------------
#
# Each template's rendering of WITH_SYSTEM (qwen: of CONV, to show its default system prompt), written out
# piece by piece: ("S", token) is one special token, ("T", text) ordinary text, and the piece lists under
# 0 and 1 are what assistant turns 0 and 1 must learn. Built from the published formats, not from bigtune.

SPECIALS = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "qwen": ["<|im_start|>", "<|im_end|>"],
    "llama-3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gemma": ["<start_of_turn>", "<end_of_turn>"],
    "mistral": [],
    "phi-3": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "zephyr": [],
}


def S(t):  # noqa: N802 - reads as a piece kind
    return ("S", t)


def T(t):  # noqa: N802
    return ("T", t)


def chatml_like(system: str) -> list:
    im, end = S("<|im_start|>"), S("<|im_end|>")
    return [
        im, T(f"system\n{system}"), end, T("\n"),
        im, T("user\nWhat is in ramen?"), end, T("\n"),
        im, T("assistant\n"), [T("Noodles and broth."), end, T("\n")],
        im, T("user\nWhat color is it?"), end, T("\n"),
        im, T("assistant\n"), [T("It is brown."), end, T("\n")],
    ]  # fmt: skip


def hand_built(name: str) -> list:
    """The pieces of ``name``'s rendering; a nested list is one assistant turn's learned tokens."""
    if name == "chatml":
        return chatml_like(SYSTEM)
    if name == "qwen":
        return chatml_like("You are a helpful assistant.")
    if name == "llama-3":
        sh, eh, eot = S("<|start_header_id|>"), S("<|end_header_id|>"), S("<|eot_id|>")
        return [
            S("<s>"), sh, T("system"), eh, T(f"\n\n{SYSTEM}"), eot,
            sh, T("user"), eh, T("\n\nWhat is in ramen?"), eot,
            sh, T("assistant"), eh, T("\n\n"), [T("Noodles and broth."), eot],
            sh, T("user"), eh, T("\n\nWhat color is it?"), eot,
            sh, T("assistant"), eh, T("\n\n"), [T("It is brown."), eot],
        ]  # fmt: skip
    if name == "gemma":
        so, eo = S("<start_of_turn>"), S("<end_of_turn>")
        return [
            S("<s>"), so, T(f"user\n{SYSTEM}\n\nWhat is in ramen?"), eo, T("\n"),
            so, T("model\n"), [T("Noodles and broth."), eo, T("\n")],
            so, T("user\nWhat color is it?"), eo, T("\n"),
            so, T("model\n"), [T("It is brown."), eo, T("\n")],
        ]  # fmt: skip
    if name == "mistral":
        return [
            S("<s>"), T(f"[INST] {SYSTEM}\n\nWhat is in ramen? [/INST]"), [T("Noodles and broth."), S("</s>")],
            T("[INST] What color is it? [/INST]"), [T("It is brown."), S("</s>")],
        ]  # fmt: skip
    if name == "phi-3":
        end = S("<|end|>")
        return [
            S("<|system|>"), T(f"\n{SYSTEM}"), end, T("\n"),
            S("<|user|>"), T("\nWhat is in ramen?"), end, T("\n"),
            S("<|assistant|>"), T("\n"), [T("Noodles and broth."), end, T("\n")],
            S("<|user|>"), T("\nWhat color is it?"), end, T("\n"),
            # a finished conversation ends with EOS: the last turn's, as nothing follows it
            S("<|assistant|>"), T("\n"), [T("It is brown."), end, T("\n"), S("</s>")],
        ]  # fmt: skip
    assert name == "zephyr"
    eos = S("</s>")
    return [
        T(f"<|system|>\n{SYSTEM}"), eos, T("\n"),
        T("<|user|>\nWhat is in ramen?"), eos, T("\n"),
        T("<|assistant|>\n"), [T("Noodles and broth."), eos, T("\n")],
        T("<|user|>\nWhat color is it?"), eos, T("\n"),
        T("<|assistant|>\n"), [T("It is brown."), eos, T("\n")],
    ]  # fmt: skip


def template_tokenizer(name: str):
    tok = tiny_tokenizer()
    if SPECIALS[name]:
        tok.add_special_tokens({"additional_special_tokens": SPECIALS[name]})
    return tok


def expected(tok, name: str, train_on: str) -> tuple[list[int], list[int]]:
    def ids(piece):
        kind, text = piece
        if kind == "S":
            return [tok.convert_tokens_to_ids(text)]
        return tok(text, add_special_tokens=False)["input_ids"]

    pieces = hand_built(name)
    turns = [i for i, p in enumerate(pieces) if isinstance(p, list)]
    learned = {"assistant": turns, "last_assistant": turns[-1:], "all": []}[train_on]
    input_ids, labels = [], []
    for i, p in enumerate(pieces):
        for piece in p if isinstance(p, list) else [p]:
            n = ids(piece)
            input_ids += n
            labels += n if (train_on == "all" or i in learned) else [IGNORE_INDEX] * len(n)
    return input_ids, labels


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def build(path: Path, tok, **cfg):
    return build_examples(DataConfig(source=str(path), **cfg), tok, seed=0)


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
@pytest.mark.parametrize("name", list(BUILTIN_TEMPLATES))
def test_mask_is_token_exact_against_the_hand_built_one(tmp_path, name, train_on):
    tok = template_tokenizer(name)
    conv = CONV if name == "qwen" else WITH_SYSTEM
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}])
    (ex,), report = build(src, tok, chat_template=name, train_on=train_on)
    want_ids, want_labels = expected(tok, name, train_on)
    assert report.format == "chat"
    assert ex.input_ids == want_ids
    assert ex.labels == want_labels
    learned = tok.decode([t for t in ex.labels if t != IGNORE_INDEX], skip_special_tokens=True)
    if train_on == "last_assistant":
        assert "It is brown." in learned and "Noodles" not in learned
    elif train_on == "assistant":
        assert "Noodles and broth." in learned and "ramen" not in learned


def test_the_tiny_presets_render_with_zephyr_by_default(tmp_path):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": WITH_SYSTEM}])
    (ex,), report = build(src, tok)  # format auto-detected, template: the tokenizer's own
    assert (ex.input_ids, ex.labels) == expected(tok, "zephyr", "assistant")
    assert "the tokenizer's template" in report.lines()[1]


def test_sharegpt_and_a_system_field_give_the_same_example(tmp_path):
    tok = tiny_tokenizer()
    turns = [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in CONV]
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": WITH_SYSTEM}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"conversations": turns, "system": SYSTEM}])
    c = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV, "system": SYSTEM}])
    (ea,), _ = build(a, tok)
    for path in (b, c):
        (e,), report = build(path, tok)
        assert report.format == "chat" and (e.input_ids, e.labels) == (ea.input_ids, ea.labels)


BAD = [
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello"}]}, "must alternate"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]}, "empty 'content'"),
    ({"messages": [{"role": "tool", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]}, "role 'tool'"),
    ({"conversations": [{"from": "bot", "value": "Hi"}]}, "from 'bot' is not one of"),
    ({"messages": CONV[:3]}, "ends with a user turn"),
    ({"messages": CONV[1:]}, "'assistant' where 'user' belongs"),
    ({"messages": CONV[:2] + [{"role": "system", "content": "x"}] + CONV[2:]}, "system turn can only be the first"),
    ({"messages": WITH_SYSTEM, "system": "Again."}, "both a 'system' field and a system turn"),
    ({"messages": [{"role": "user", "content": ["a", "list"]}, CONV[1]]}, "'content' is list, not text"),
    ({"messages": CONV[:1]}, "at least one user turn and one assistant turn"),
    ({"messages": "Hi"}, "no 'messages' or 'conversations' list"),
    ("just text", "not an object"),
]


def test_bad_conversations_are_counted_reported_and_skipped(tmp_path):
    tok = tiny_tokenizer()
    records = [{"messages": CONV}] + [r for r, _ in BAD]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    examples, report = build(src, tok)
    assert len(examples) == 1 and report.used == 1 and report.records == len(records)
    assert [i for i, _ in report.skipped] == list(range(1, len(records)))
    for (i, reason), (_, want) in zip(report.skipped, BAD):
        assert want in reason, (i, reason)
    assert "skipped record 1: turn 1: 'user' where 'assistant' belongs" in "\n".join(report.lines())


def test_skip_bad_records_false_names_the_record(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}, BAD[0][0]])
    with pytest.raises(DataError, match=r"c\.jsonl record 1: turn 1: 'user' where 'assistant' belongs"):
        build(src, tiny_tokenizer(), skip_bad_records=False)


def test_truncation_that_leaves_no_target_skips_the_sample_by_index(tmp_path):
    tok = tiny_tokenizer()
    long_question = {"role": "user", "content": "Tell me about ramen. " * 20}
    records = [
        {"messages": CONV},
        {"messages": [long_question, {"role": "assistant", "content": "Noodles."}]},  # answer cut away
        {"messages": [CONV[0], {"role": "assistant", "content": "Noodles and broth. " * 20}]},  # answer cut short
    ]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    examples, report = build(src, tok, max_seq_length=72)
    assert report.skipped == [(1, "no assistant tokens left within data.max_seq_length=72")]
    assert report.truncated == 1 and len(examples) == 2
    kept = examples[1]
    assert len(kept.input_ids) == 72 and kept.labels[-1] == kept.input_ids[-1]
    # with train_on=all the long question is itself the target, so nothing is skipped
    _, report = build(src, tok, max_seq_length=72, train_on="all")
    assert report.skipped == [] and report.truncated == 2


def test_last_assistant_skips_when_only_the_last_answer_is_cut_away(tmp_path):
    tok = tiny_tokenizer()
    rec = {"messages": [CONV[0], CONV[1], {"role": "user", "content": "And more? " * 20}, CONV[3]]}
    src = write_jsonl(tmp_path / "c.jsonl", [rec, {"messages": CONV[:2]}])
    _, report = build(src, tok, max_seq_length=40, train_on="last_assistant")
    assert report.skipped == [(0, "no last_assistant tokens left within data.max_seq_length=40")]
    _, report = build(src, tok, max_seq_length=40)  # its first answer still fits
    assert report.skipped == []


def test_packing_keeps_each_conversations_targets(tmp_path):
    tok = tiny_tokenizer()
    records = [{"messages": WITH_SYSTEM}, {"messages": CONV[:2]}, {"messages": CONV, "system": "Answer."}]
    examples, _ = build(write_jsonl(tmp_path / "c.jsonl", records), tok, max_seq_length=256)
    rows = pack_examples(examples, max_len=256, seed=0)
    assert len(rows) == 1 and rows[0].samples == 3
    targets = sorted(t for e in examples for t in e.labels[1:] if t != IGNORE_INDEX)
    assert sorted(t for t in rows[0].labels if t != IGNORE_INDEX) == targets


def test_packed_chat_training_runs(tmp_path):
    from bigtune.run.training import train
    from conftest import tiny_overrides

    over = tiny_overrides(
        tmp_path / "run",
        **{"data.format": "chat", "data.packing": True, "data.max_seq_length": 128, "memory.plan": False},
    )
    summary = train({}, over, quiet_recipe=True)
    assert summary["status"] == "ok" and summary["data"]["format"] == "chat"
    assert all(m["loss"] > 0 for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


# -- templates that cannot give an exact mask, and template errors ------------------------------------

# The system prompt goes in front of the *last* user turn (as Mistral's v0.3 template does): rendering the
# conversation up to the first answer puts it somewhere else than rendering the whole conversation.
SYSTEM_LAST = (
    "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + (system + ' ' if loop.last or loop.revindex == 2 else '') + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_a_template_that_rewrites_earlier_turns_is_one_clear_error(tmp_path):
    tpl = tmp_path / "system_last.jinja"
    tpl.write_text(SYSTEM_LAST)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": WITH_SYSTEM}])
    with pytest.raises(DataError, match=r"c\.jsonl record 0: template .*system_last\.jinja is not incremental") as e:
        build(src, tiny_tokenizer(), chat_template=str(tpl), skip_bad_records=True)
    assert "data.train_on=all" in str(e.value)
    (ex,), _ = build(src, tiny_tokenizer(), chat_template=str(tpl), train_on="all")  # no mask needed
    assert ex.labels == ex.input_ids


def test_a_template_that_writes_the_last_answer_differently_is_one_clear_error(tmp_path):
    # As Qwen3's template does: an empty reasoning block only in front of the last answer.
    tpl = tmp_path / "think.jinja"
    tpl.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV[:2]}, {"messages": CONV}])
    with pytest.raises(DataError, match=r"record 1: .*writes assistant turn 1 differently when it is the last turn"):
        build(src, tiny_tokenizer(), chat_template=str(tpl))
    examples, _ = build(src, tiny_tokenizer(), chat_template=str(tpl), train_on="last_assistant")
    # the last answer is learned as the template writes it, reasoning block included
    learned = tiny_tokenizer().decode([t for t in examples[1].labels if t != IGNORE_INDEX])
    assert learned == "<think>\n\n</think>\n\nIt is brown.<|im_end|>\n"


def test_a_record_whose_tokens_merge_across_the_turn_boundary_is_skipped(tmp_path):
    # No separator between turns: " th" + "e end" tokenizes as " the" + " end", so the answer's first token
    # starts inside the prompt's last one.
    tpl = tmp_path / "glued.jinja"
    tpl.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    records = [
        {"messages": [{"role": "user", "content": "Say th"}, {"role": "assistant", "content": "e end"}]},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": " Hi"}]},
    ]
    examples, report = build(write_jsonl(tmp_path / "c.jsonl", records), tiny_tokenizer(), chat_template=str(tpl))
    assert len(examples) == 1 and report.skipped[0][0] == 0
    assert "merges the assistant's first token" in report.skipped[0][1]


def test_template_errors_name_the_template(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    with pytest.raises(DataError, match=r"data.chat_template: 'chatm' is neither .* did you mean 'chatml'"):
        build(src, tiny_tokenizer(), chat_template="chatm")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(DataError, match=r"broken\.jinja: Jinja syntax error at line 2"):
        build(src, tiny_tokenizer(), chat_template=str(broken))
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="the tokenizer has no chat template.*set data.chat_template"):
        build(src, tok)


def test_a_record_the_template_refuses_is_skipped_with_its_message(tmp_path):
    tpl = tmp_path / "no_system.jinja"
    tpl.write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + BUILTIN_TEMPLATES["chatml"]
    )
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": WITH_SYSTEM}, {"messages": CONV}])
    examples, report = build(src, tiny_tokenizer(), chat_template=str(tpl))
    assert len(examples) == 1 and report.skipped == [(0, "the chat template refuses it: System role not supported")]


def test_a_named_template_is_kept_on_the_tokenizer_for_generation(tmp_path):
    tok = template_tokenizer("chatml")
    build(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}]), tok, chat_template="chatml")
    assert tok.chat_template == BUILTIN_TEMPLATES["chatml"]


def test_a_chat_demo_source_and_auto_detection(tmp_path):
    examples, report = build_examples(DataConfig(source="demo", format="chat"), tiny_tokenizer(), seed=0)
    assert report.source == str(DEMO_CHAT_DATA) and report.format == "chat"
    assert report.used == 400 and [i for i, _ in report.skipped] == [400, 401]
    _, auto = build(DEMO_CHAT_DATA, tiny_tokenizer())
    assert auto.format == "chat" and auto.used == 400


def test_chat_demo_data_is_reproducible():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_chat_demo
    finally:
        sys.path.pop(0)
    expected_text = "".join(json.dumps(r) + "\n" for r in make_chat_demo.conversations())
    assert DEMO_CHAT_DATA.read_text(encoding="utf-8") == expected_text


# -- generation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, end", [("chatml", "<|im_end|>"), ("llama-3", "<|eot_id|>"), ("phi-3", "<|end|>"), ("zephyr", "</s>")]
)
def test_turn_end_is_the_special_token_after_the_answer(name, end):
    tok = template_tokenizer(name)
    assert turn_end_ids(tok, BUILTIN_TEMPLATES[name]) == [tok.convert_tokens_to_ids(end)]


def test_chat_prompts_render_with_the_generation_prompt():
    tok = tiny_tokenizer()
    tpl = BUILTIN_TEMPLATES["zephyr"]
    ids = encode_prompt(tok, tpl, chat_messages("What is in ramen?", system=SYSTEM))
    assert tok.decode(ids) == f"<|system|>\n{SYSTEM}</s>\n<|user|>\nWhat is in ramen?</s>\n<|assistant|>\n"
    conv = chat_messages(CONV[:3])
    assert (
        encode_prompt(tok, tpl, conv)
        == tok(tok.apply_chat_template(CONV[:3], tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
    )
    with pytest.raises(DataError, match="conversation: ends with an assistant turn"):
        chat_messages(CONV)  # a prompt ends with the user's turn


def test_generate_chat_answers_from_the_rendered_prompt(tmp_path):
    from bigtune.models.build import build_model
    from bigtune.recipe import ModelConfig
    from bigtune.use.generate import generate, generate_ids
    from bigtune.use.loading import InferError

    tok = tiny_tokenizer()
    model = build_model(ModelConfig(name="tiny-llama"), tok, "32-true", seed=0).eval()
    chat = generate_ids(model, tok, ["What is in ramen?"], max_new_tokens=6, chat=True)
    # the same ids as continuing the rendered prompt as plain text (which adds BOS: the template does not)
    rendered = tok.apply_chat_template(CONV[:1], tokenize=False, add_generation_prompt=True)
    import torch

    prompt = torch.tensor([tok(rendered, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True)
    new = out[0, prompt.shape[1] :].tolist()
    assert chat[0] == new[: len(chat[0])]
    with pytest.raises(InferError, match="exclude each other"):
        generate(model, tok, ["x"], chat=True, instruction_format=True)
    with pytest.raises(InferError, match="prompt 0 is list"):
        generate(model, tok, [CONV[:1]])
    tok.chat_template = None
    with pytest.raises(InferError, match="no chat template.*chat_template"):
        generate(model, tok, ["x"], chat=True)


# -- the chat demo end to end -------------------------------------------------------------------------


def test_chat_demo_trains_and_answers_in_the_template_format(tmp_path):
    recipe = ROOT / "recipes" / "chat-demo.yaml"
    res = run_cli("train", str(recipe), "--set", f"output_dir={tmp_path / 'chat-demo'}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [m["loss"] for m in read_jsonl(tmp_path / "chat-demo" / "metrics.jsonl")]
    assert losses[0] > 4 and losses[-1] < 0.3, losses
    res = run_cli("generate", "--model", str(tmp_path / "chat-demo"), "--chat", "What is in ramen?", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "Ramen is made with wheat noodles, broth, egg and scallions."
    res = run_cli("generate", "--model", str(tmp_path / "chat-demo"), "--system", "x", "hi", cwd=tmp_path)
    assert res.returncode == 2 and "add --chat" in res.stderr
