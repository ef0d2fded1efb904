"""Built-in tiny model presets: real architectures, random init from a config, a local tokenizer.

They exercise exactly the code path of the real models (same classes, same attention, same
checkpointing hooks) in seconds on a CPU, so they double as test fixtures and the demo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_FILE = ASSETS / "tiny_tokenizer.json"
DEMO_DATA = ASSETS / "demo_alpaca.jsonl"


@dataclass(frozen=True)
class Preset:
    family: str
    make_config: Callable[[int, dict], object]
    doc: str


def tiny_tokenizer():
    """The byte-level BPE shipped with bigtune, wrapped as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_FILE), bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=2048, padding_side="right")


def _llama(vocab: int, ids: dict):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       tie_word_embeddings=False, use_cache=False, **ids)


def _opt(vocab: int, ids: dict):
    from transformers import OPTConfig

    return OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=64, max_position_embeddings=1024, use_cache=False, **ids)


PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("causal-lm", _llama, "Llama architecture, 2 layers, hidden 64, GQA 4/2 heads."),
    "tiny-opt": Preset("causal-lm", _opt, "OPT architecture, 2 layers, hidden 64, dropout 0.1."),
}


def preset_config(name: str, tokenizer) -> object:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    return PRESETS[name].make_config(len(tokenizer), ids)
