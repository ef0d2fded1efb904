"""Chat data: conversations rendered with a chat template, the loss on the assistant's tokens.

Records hold ``messages: [{role, content}]`` (roles system / user / assistant) or ShareGPT
``conversations: [{from, value}]`` (from system / human / gpt), and optionally a ``system`` field. A
conversation is an optional system turn, then user and assistant turns alternating, starting with the
user and ending with the assistant; anything else is a bad record (skipped, counted, reported).

The text comes from the chat template (the tokenizer's, a built-in one or a Jinja file), rendered by the
tokenizer's own ``apply_chat_template``. Which tokens are the assistant's is found by rendering, never by
looking for marker strings: for assistant turn k the conversation before it is rendered with the
generation prompt (what the model sees when it is asked to answer) and the conversation up to and
including it without; the tokens the turn adds are the ones after the first rendering that the second
shares with the whole conversation. That is exact for any template whose earlier turns do not change
when later ones are added (the prefix property, checked on every record): a template without it is an
error, a record whose tokens merge across a turn boundary is skipped with the reason.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Optional

from bigtune.core.presets import TINY_CHAT_TEMPLATE
from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.records import DataError, Example
from bigtune.recipe import DataConfig

ROLES = ("system", "user", "assistant")

# ShareGPT's speaker names; "user"/"assistant" also appear in converted sets.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}

# Built-in templates in the Hugging Face chat-template dialect (Jinja; `messages`, `add_generation_prompt`,
# `bos_token`, `eos_token`). Each follows a published format, named beside it. The special tokens a template
# writes (<|im_start|>, <|eot_id|>, ...) must be tokens of the model's tokenizer to be single tokens; a
# tokenizer without them still works, spelling them out as ordinary text.
BUILTIN_TEMPLATES = {
    # ChatML, as published with OpenAI's chat format and used by many fine-tunes.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Qwen2-Instruct's template: ChatML with a default system prompt when the conversation has none.
    "qwen": (
        "{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
        "{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Meta-Llama-3-8B-Instruct's template (bos_token is <|begin_of_text|> there).
    "llama-3": (
        "{% for message in messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # Gemma's turn format (<start_of_turn>user / model ... <end_of_turn>); a system prompt goes in front of the
    # first user turn, as Gemma 3's published template does (Gemma 1/2 refuse one).
    "gemma": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}"
        "{% set first_user_prefix = messages[0]['content'] | trim + '\n\n' %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
        "{% endif %}"
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')"
        " + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    # Mistral-7B-Instruct-v0.1/v0.2's template ([INST] ... [/INST] answer</s>); the published one refuses a
    # system message, here it goes in front of the first user message, separated by a blank line.
    "mistral": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + (system if loop.first else '') + message['content']"
        " + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    # Phi-3-mini-4k-instruct's template (with its system turn), EOS after a finished conversation.
    "phi-3": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
    # Zephyr's (HuggingFaceH4/zephyr-7b-beta); the tiny presets' template.
    "zephyr": TINY_CHAT_TEMPLATE,
}


class ChatError(DataError):
    """The chat template or tokenizer cannot give an exact loss mask; the message says why and the fix."""


def resolve_template(tok, name: Optional[str], key: str = "data.chat_template") -> tuple[str, str]:
    """(Jinja source, label) of a built-in name, a Jinja file, or (``name`` None) the tokenizer's own."""
    if name is None:
        own = getattr(tok, "chat_template", None)
        if isinstance(own, dict):  # several named templates: transformers' convention is "default"
            own = own.get("default")
        if not own:
            raise ChatError(
                f"the tokenizer has no chat template (no chat_template in its tokenizer_config.json or "
                f"chat_template.jinja); set {key} to a built-in ({', '.join(BUILTIN_TEMPLATES)}) or a Jinja file"
            )
        return own, "the tokenizer's template"
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name], f"built-in template {name}"
    path = Path(name).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8"), f"template {path}"
    close = difflib.get_close_matches(name, list(BUILTIN_TEMPLATES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ChatError(
        f"{key}: {name!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor an existing "
        f"Jinja file{hint}"
    )


def render(tok, template: str, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def encode(tok, text: str) -> list[int]:
    """Rendered text to ids as ``apply_chat_template(tokenize=True)`` does: the template writes BOS itself."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


def check_template(tok, template: str, label: str) -> None:
    """Render a probe conversation once, so a broken template is one error before any record is read."""
    from jinja2 import TemplateError, TemplateSyntaxError

    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        render(tok, template, probe, False)
    except TemplateSyntaxError as e:
        raise ChatError(f"{label}: Jinja syntax error at line {e.lineno}: {e.message}; fix the template") from None
    except TemplateError as e:
        raise ChatError(f"{label}: cannot render a plain user/assistant exchange ({e}); fix the template") from None


def normalize(rec: Any) -> tuple[Optional[list[dict]], str]:
    """(messages as [{role, content}], "") for a usable record, else (None, the reason it is not)."""
    if not isinstance(rec, dict):
        return None, f"not an object ({type(rec).__name__})"
    if isinstance(rec.get("messages"), list):
        turns, role_key, text_key, names = rec["messages"], "role", "content", {r: r for r in ROLES}
    elif isinstance(rec.get("conversations"), list):
        turns, role_key, text_key, names = rec["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        return None, "no 'messages' or 'conversations' list"
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None, f"turn {i} is {type(turn).__name__}, not an object with {role_key!r} and {text_key!r}"
        role, content = turn.get(role_key), turn.get(text_key)
        if role not in names:
            allowed = ", ".join(names)
            return None, f"turn {i}: {role_key} {role!r} is not one of {allowed}"
        if not isinstance(content, str):
            return None, f"turn {i}: {text_key!r} is {type(content).__name__}, not text"
        if not content.strip():
            return None, f"turn {i}: empty {text_key!r}"
        messages.append({"role": names[role], "content": content})
    system = rec.get("system")
    if system is not None:
        if not isinstance(system, str) or not system.strip():
            return None, "'system' is not a non-empty text"
        if messages and messages[0]["role"] == "system":
            return None, "both a 'system' field and a system turn; keep one"
        messages.insert(0, {"role": "system", "content": system})
    return messages, check_turn_order(messages)


def check_turn_order(messages: list[dict]) -> str:
    """'' when the turns are [system], user, assistant, user, ..., assistant; else what is wrong."""
    start = 1 if messages and messages[0]["role"] == "system" else 0
    if len(messages) - start < 2:
        return "needs at least one user turn and one assistant turn"
    for i in range(start, len(messages)):
        want = "user" if (i - start) % 2 == 0 else "assistant"
        role = messages[i]["role"]
        if role != want:
            if role == "system":
                return f"turn {i}: a system turn can only be the first"
            return f"turn {i}: {role!r} where {want!r} belongs; turns must alternate user, assistant, user, ..."
    if messages[-1]["role"] != "assistant":
        return "ends with a user turn; a conversation must end with the assistant's answer"
    return ""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatFormatter:
    """Turns chat records into (input_ids, labels) with ``cfg.train_on``'s tokens as targets."""

    def __init__(self, cfg: DataConfig, tok):
        self.cfg, self.tok = cfg, tok
        self.template, self.label = resolve_template(tok, cfg.chat_template)
        check_template(tok, self.template, self.label)
        if cfg.chat_template is not None:
            # The run saves this tokenizer with the model: carrying the template it was trained with makes
            # `generate --chat` and `eval` render prompts exactly as training did.
            tok.chat_template = self.template

    def assistant_span(self, messages: list[dict], k: int, full_text: str, full: list[int]) -> tuple[int, int]:
        """Token positions [start, end) that assistant turn ``k`` adds to the whole conversation ``full``.

        Raises ChatError when the template rewrites earlier turns (no exact answer exists for any record);
        returns (-1, position) when only this record's tokens merge across the turn's start.
        """
        before = render(self.tok, self.template, messages[:k], True)
        through = render(self.tok, self.template, messages[: k + 1], False)
        if not (full_text.startswith(before) and through.startswith(before)):
            raise ChatError(
                f"{self.label} is not incremental: the conversation rendered up to assistant turn {k} with the "
                "generation prompt is not the start of the whole conversation's rendering (the template rewrites "
                "earlier turns, or its generation prompt differs from how it writes an assistant turn), so the "
                "assistant's tokens cannot be found exactly. Use data.train_on=all, or another data.chat_template"
            )
        shared = len(os.path.commonprefix([through, full_text]))
        if messages[k]["content"].strip() not in full_text[len(before) : shared]:
            raise ChatError(
                f"{self.label} is not incremental: it writes assistant turn {k} differently when it is the last "
                "turn than when more turns follow (as templates that drop earlier reasoning do), so the "
                "assistant's tokens cannot be found exactly. Use data.train_on=last_assistant or all, or another "
                "data.chat_template"
            )
        prompt, upto = encode(self.tok, before), encode(self.tok, through)
        start = len(prompt)
        if full[:start] != prompt or upto[:start] != prompt:
            return -1, common_prefix(prompt, full)
        # Where rendering only this far and rendering the rest part ways: a template may close a finished
        # conversation differently (Phi-3 adds EOS), which is not this turn's.
        return start, common_prefix(upto, full)

    def __call__(self, rec: Any, tok, cfg: DataConfig) -> tuple[Optional[Example], str, bool]:
        """(Example or None, reason, truncated): the per-record contract of data.text's formats."""
        from jinja2 import TemplateError

        messages, reason = normalize(rec)
        if reason:
            return None, reason, False
        try:
            full_text = render(tok, self.template, messages, False)
        except TemplateError as e:  # e.g. a template that refuses a system turn (raise_exception)
            return None, f"the chat template refuses it: {e}", False
        ids = encode(tok, full_text)
        if cfg.train_on == "all":
            labels = list(ids)
        else:
            labels = [IGNORE_INDEX] * len(ids)
            turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
            for k in turns[-1:] if cfg.train_on == "last_assistant" else turns:
                start, end = self.assistant_span(messages, k, full_text, ids)
                if start < 0:
                    return (
                        None,
                        f"turn {k}: the tokenizer merges the assistant's first token with the text before it "
                        f"(token {end}), so its tokens cannot be separated exactly",
                        False,
                    )
                labels[start:end] = ids[start:end]
        n = cfg.max_seq_length
        truncated = len(ids) > n
        ids, labels = ids[:n], labels[:n]
        # labels[0] is never predicted (nothing comes before it), so it does not count as a target.
        if all(t == IGNORE_INDEX for t in labels[1:]):
            return None, f"no {cfg.train_on} tokens left within data.max_seq_length={n}", truncated
        return Example(ids, labels), "", truncated


def chat_messages(prompt: Any, system: Optional[str] = None) -> list[dict]:
    """A generation prompt as messages: a string is one user turn; a list of {role, content} (or ShareGPT
    {from, value}) is a conversation that ends with the user's turn. Raises ChatError on a bad one."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ChatError("empty prompt; give some text")
        messages = [{"role": "user", "content": prompt}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return messages
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ChatError(f"a prompt is text or a non-empty list of messages, not {prompt!r:.60}")
    prompt = list(prompt)
    sharegpt = isinstance(prompt[0], dict) and "from" in prompt[0]
    rec = {"conversations": prompt} if sharegpt else {"messages": prompt}
    if system:
        rec["system"] = system
    messages, reason = normalize(rec)
    if messages is not None and messages[-1]["role"] == "assistant":
        reason = "ends with an assistant turn; a prompt ends with the user's turn, the model writes the answer"
    elif messages is not None:
        # A prompt is a training conversation without its final answer.
        reason = check_turn_order(messages + [{"role": "assistant", "content": "(answer)"}])
    if reason:
        raise ChatError(f"conversation: {reason}")
    return messages


def encode_prompt(tok, template: str, messages: list[dict]) -> list[int]:
    """The ids a chat model answers from: the conversation rendered with the generation prompt."""
    return encode(tok, render(tok, template, messages, True))


def turn_end_ids(tok, template: str) -> list[int]:
    """The special token that closes an assistant turn in ``template`` (ChatML's <|im_end|>, Llama-3's
    <|eot_id|>, ...), found by rendering a probe answer: generation stops there as it does at EOS."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    prompt = encode(tok, render(tok, template, probe[:1], True))
    turn = encode(tok, render(tok, template, probe, False))
    answer = encode(tok, "Hello")
    if turn[: len(prompt)] != prompt:
        return []
    added = turn[len(prompt) :]
    if added[: len(answer)] != answer or len(added) == len(answer):
        return []
    after = added[len(answer)]
    return [after] if after in set(tok.all_special_ids) else []
