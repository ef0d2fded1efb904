"""Use a trained model: batched text generation and held-out loss / perplexity.

``load_for_inference`` takes whatever a user is likely to point at: a Hugging Face model folder, a
bigtune run directory (its ``model/`` for a full fine-tune; for an adapter run the base weights plus
``adapter/``, attached with peft and left unmerged) or a peft adapter folder on its own. Weights load
from safetensors only and no remote code runs.

``generate`` left-pads each batch so every prompt's last token sits next to its first new token, and
returns only the new text, in the order the prompts came. ``evaluate`` computes the loss exactly as
training does (``bigtune.stepmath``: summed next-token cross-entropy over target tokens divided by the
number of target tokens), so the numbers are directly comparable with a run's training loss.

Heavy libraries (torch, transformers, peft) are imported inside the functions that need them, so
``bigtune --help`` stays quick.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from bigtune.use.loading import InferError, device_of


def check_generate_args(max_new_tokens, batch_size, do_sample, temperature, top_p, top_k) -> None:
    problems = []
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        problems.append(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        problems.append(f"batch_size must be a positive integer, got {batch_size!r}")
    if do_sample:
        if not temperature > 0:
            problems.append(f"temperature must be > 0 when sampling, got {temperature!r}")
        if not 0 < top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {top_p!r}")
        if top_k < 0:
            problems.append(f"top_k must be >= 0 (0 turns it off), got {top_k!r}")
    if problems:
        raise InferError("; ".join(problems))


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids the way bigtune's training data starts a sample: BOS (if the tokenizer has one), then the text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(ids)


def _encode_prompts(tokenizer, prompts, instruction_format: bool, chat: bool, system, chat_template):
    """(token ids per prompt, extra stop ids): plain text after BOS, the instruction template, or the chat template."""
    if chat and instruction_format:
        raise InferError("chat and instruction_format exclude each other: a prompt gets one template")
    if chat:
        from bigtune.data.chat import ChatError, chat_messages, encode_prompt, resolve_template, turn_end_ids

        try:
            template, _ = resolve_template(tokenizer, chat_template, key="chat_template")
            encoded = []
            for i, p in enumerate(prompts):
                try:
                    encoded.append(encode_prompt(tokenizer, template, chat_messages(p, system)))
                except ChatError as e:
                    raise ChatError(f"prompt {i}: {e}") from None
        except ChatError as e:
            raise InferError(str(e)) from None
        return encoded, turn_end_ids(tokenizer, template)
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise InferError(f"prompt {i} is {type(p).__name__}, not text (a conversation needs chat=True)")
    if instruction_format:
        from bigtune.data.text import format_prompt

        prompts = [format_prompt(p) for p in prompts]
    return [_encode(tokenizer, p) for p in prompts], []


def _left_pad(rows: list[list[int]], pad_id: int):
    import torch

    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, n - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, n - len(r) :] = 1
    return ids, mask


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def generate_ids(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    instruction_format: bool = False,
    chat: bool = False,
    system: Optional[str] = None,
    chat_template: Optional[str] = None,
) -> list[list[int]]:
    """The new token ids per prompt (stopping at, and without, the end-of-sequence token), in input order.

    ``generate`` is this plus decoding; see there for the arguments.

    Long because the decode loop (left padding, the KV cache, stopping per row, sampling) is one unit;
    split, its state would travel through several functions' arguments.
    """
    import copy

    import torch

    if isinstance(prompts, str):
        raise InferError("prompts must be a list of strings, not one string; wrap it: [prompt]")
    prompts = list(prompts)
    check_generate_args(max_new_tokens, batch_size, do_sample, temperature, top_p, top_k)
    if not prompts:
        return []
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    encoded, turn_end = _encode_prompts(tokenizer, prompts, instruction_format, chat, system, chat_template)
    eos = _eos_ids(model, tokenizer)
    # A chat template's end-of-turn token (ChatML's <|im_end|>, ...) ends an answer as EOS does.
    eos += [t for t in turn_end if t not in eos]
    for i, e in enumerate(encoded):
        if not e:
            raise InferError(f"prompt {i} is empty and the tokenizer has no BOS token to start from; give some text")

    base_cfg = getattr(model, "generation_config", None)
    cfg = copy.deepcopy(base_cfg) if base_cfg is not None else None
    if cfg is None:
        from transformers import GenerationConfig

        cfg = GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.max_length = None
    cfg.min_new_tokens = None
    cfg.min_length = 0
    cfg.do_sample = bool(do_sample)
    cfg.num_beams = 1
    cfg.num_return_sequences = 1
    cfg.use_cache = True  # bigtune saves models with use_cache=False (training); generation wants the KV cache
    cfg.pad_token_id = pad_id
    cfg.eos_token_id = eos or None
    if do_sample:
        cfg.temperature, cfg.top_p, cfg.top_k = float(temperature), float(top_p), int(top_k)
    else:  # neutral values: no "sampling flag set without do_sample" warnings from transformers
        cfg.temperature, cfg.top_p, cfg.top_k = None, None, None

    device = device_of(model)
    n_batches = -(-len(prompts) // batch_size)
    # Longest first keeps padding small; results go back to input order at the end.
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i])) if not do_sample else list(range(len(prompts)))
    results: list[Optional[list[int]]] = [None] * len(prompts)
    t0 = time.perf_counter()
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        for b in range(n_batches):
            idx = order[b * batch_size : (b + 1) * batch_size]
            ids, mask = _left_pad([encoded[i] for i in idx], pad_id)
            ids, mask = ids.to(device), mask.to(device)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            new = out[:, ids.shape[1] :].tolist()
            for i, row in zip(idx, new):
                cut = len(row)
                for j, t in enumerate(row):
                    if t in eos:
                        cut = j
                        break
                results[i] = row[:cut]
            if n_batches > 1:
                done = min((b + 1) * batch_size, len(prompts))
                print(
                    f"generate: batch {b + 1}/{n_batches} ({done}/{len(prompts)} prompts, "
                    f"{time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return [r if r is not None else [] for r in results]


def generate(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    instruction_format: bool = False,
    chat: bool = False,
    system: Optional[str] = None,
    chat_template: Optional[str] = None,
) -> list[str]:
    """Generate a continuation of each prompt; return only the new text, one string per prompt, in order.

    Prompts are batched ``batch_size`` at a time, left-padded. Greedy by default (``do_sample=False``:
    the same output whatever the batch size); with ``do_sample`` the ``temperature`` / ``top_p`` /
    ``top_k`` (0: off) filters apply and ``seed`` makes the draw repeatable without touching the
    caller's global RNG. ``instruction_format`` wraps each prompt in the template bigtune trains
    instruction data with (``bigtune.data.format_prompt``). ``chat`` renders each prompt with the chat
    template instead (``chat_template``: a built-in name or Jinja file; None: the tokenizer's own) and its
    generation prompt: a string is one user turn (after ``system``, if given), a list of
    ``{"role", "content"}`` dicts a conversation ending with the user's turn; the answer stops at the
    template's end-of-turn token. A progress line per batch goes to stderr when there is more than one batch.
    """
    ids = generate_ids(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        instruction_format=instruction_format,
        chat=chat,
        system=system,
        chat_template=chat_template,
    )
    return [tokenizer.decode(r, skip_special_tokens=True) for r in ids]


def evaluate(
    model, tokenizer, data_source: str, max_seq_length: int = 512, batch_size: int = 8, mask_prompt: bool = True
) -> dict:
    """Token-weighted mean causal-LM loss and perplexity of ``model`` on ``data_source``.

    The data is read and tokenized exactly as for training (``bigtune.data.build_examples``; alpaca
    prompts masked out unless ``mask_prompt=False``; malformed records skipped and counted). The loss
    is the sum of per-token cross-entropies over every target token divided by their number, so long
    samples weigh more than short ones, as in training; perplexity is exp(loss).
    """
    import torch

    from bigtune.core.stepmath import causal_lm_loss_sum, target_token_count
    from bigtune.data.text import Collator, build_examples
    from bigtune.recipe import DataConfig

    if not isinstance(batch_size, int) or batch_size < 1:
        raise InferError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(max_seq_length, int) or max_seq_length < 2:
        raise InferError(f"max_seq_length must be an integer >= 2, got {max_seq_length!r}")
    examples, report = build_examples(
        DataConfig(source=data_source, max_seq_length=max_seq_length, mask_prompt=mask_prompt), tokenizer, seed=0
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    collate = Collator(pad_id)
    device = device_of(model)
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    n_batches = -(-len(examples) // batch_size)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            for b in range(n_batches):
                batch = collate(examples[b * batch_size : (b + 1) * batch_size])
                ids = batch["input_ids"].to(device)
                mask = batch["attention_mask"].to(device)
                labels = batch["labels"].to(device)
                logits = model(input_ids=ids, attention_mask=mask).logits
                loss_sum += float(causal_lm_loss_sum(logits, labels))
                tokens += int(target_token_count(labels))
                del logits
                if n_batches > 1:
                    print(
                        f"eval: batch {b + 1}/{n_batches} ({tokens} target tokens, {time.perf_counter() - t0:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if was_training:
            model.train()
    if tokens == 0:
        raise InferError(
            f"{report.source}: no target tokens to score (every label is masked); use longer samples "
            "or mask_prompt=False"
        )
    loss = loss_sum / tokens
    try:
        ppl = math.exp(loss)
    except OverflowError:
        ppl = float("inf")
    return {
        "loss": loss,
        "perplexity": ppl,
        "tokens": tokens,
        "samples": len(examples),
        "skipped": len(report.skipped),
        "source": report.source,
    }


def read_prompt_file(path: str, instruction: bool = False, chat: bool = False) -> list[tuple[str, Any]]:
    """[(prompt as shown, text to generate from)] from a .jsonl (``instruction``/``prompt`` field, optional
    ``input``) or a text file (one prompt per non-empty line).

    With ``instruction`` the text is already wrapped in the training template (so a record's ``input``
    lands in its own section); without it, ``input`` is appended to the instruction after a blank line.
    With ``chat`` a .jsonl line may instead hold a conversation (``messages`` or ShareGPT ``conversations``,
    ending with the user's turn), returned as that list for the chat template.
    """
    from bigtune.data.text import format_prompt

    p = Path(path).expanduser()
    if not p.is_file():
        raise InferError(f"--file {path}: no such file; give a text file (one prompt per line) or a .jsonl")
    out: list[tuple[str, str]] = []
    if p.suffix.lower() == ".jsonl":
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InferError(
                        f"{p} line {lineno} column {e.colno}: not valid JSON ({e.msg}); each line must be one JSON "
                        'object with an "instruction" or "prompt" field'
                    ) from None
                text = None
                if isinstance(rec, dict):
                    text = rec.get("instruction", rec.get("prompt"))
                    turns = rec.get("messages", rec.get("conversations"))
                    if chat and text is None and isinstance(turns, list) and turns:
                        last = turns[-1] if isinstance(turns[-1], dict) else {}
                        out.append((str(last.get("content", last.get("value", ""))), turns))
                        continue
                if not isinstance(text, str):
                    raise InferError(f'{p} line {lineno}: no text "instruction" or "prompt" field; add one')
                inp = rec.get("input") or ""
                if not isinstance(inp, str):
                    raise InferError(f'{p} line {lineno}: "input" is {type(inp).__name__}, not text')
                if instruction:
                    out.append((text, format_prompt(text, inp)))
                else:
                    out.append((text, f"{text}\n\n{inp}" if inp else text))
    else:
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append((line, format_prompt(line) if instruction else line))
    if not out:
        raise InferError(f"--file {path}: holds no prompts")
    return out


def format_eval(result: dict[str, Any]) -> str:
    return (
        f"eval: {result['source']}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} over "
        f"{result['tokens']} target tokens in {result['samples']} samples ({result['skipped']} skipped)"
    )
