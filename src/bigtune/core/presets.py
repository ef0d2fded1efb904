"""Built-in tiny model presets: real architectures, random init from a config, a local tokenizer.

They exercise exactly the code path of the real models (same classes, same attention, same
checkpointing hooks) in seconds on a CPU, so they double as test fixtures and the demo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ASSETS = Path(__file__).resolve().parents[1] / "assets"

TOKENIZER_FILE = ASSETS / "tiny_tokenizer.json"

DEMO_DATA = ASSETS / "demo_alpaca.jsonl"

DEMO_CLASSIFICATION_DATA = ASSETS / "demo_reviews.jsonl"  # made by scripts/make_reviews_demo.py

DEMO_CHAT_DATA = ASSETS / "demo_chat.jsonl"  # made by scripts/make_chat_demo.py

# The tiny tokenizer's chat template: Zephyr's published layout (HuggingFaceH4/zephyr-7b-beta:
# "<|role|>\n" + content + EOS + "\n" per turn, "<|assistant|>\n" as the generation prompt). Zephyr ends
# every turn with the tokenizer's own EOS and writes its role markers as plain text, so the bundled
# tokenizer needs no new tokens: the vocabulary, and every non-chat run, stay exactly as they were, and
# generation stops at EOS as it always does.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    family: str
    make_config: Callable[[int, dict], object]
    doc: str


def tiny_tokenizer():
    """The byte-level BPE shipped with bigtune, wrapped as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
        padding_side="right",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def _llama(vocab: int, ids: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        use_cache=False,
        **ids,
    )


def _opt(vocab: int, ids: dict):
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=vocab,
        hidden_size=64,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=1024,
        use_cache=False,
        **ids,
    )


def _bert(vocab: int, ids: dict):
    from transformers import BertConfig

    # The bundled tokenizer has no [CLS]: classification samples start with BOS, which sits where BERT's
    # pooler reads (position 0), so it plays [CLS]'s part. Dropout 0.1 as in BERT.
    return BertConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        pad_token_id=ids["pad_token_id"],
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
    )


TINY_IMAGE_SIZE = 32  # pixels (square); patch 8 → 16 patches

TINY_QUERY_TOKENS = 4  # Q-Former queries = image tokens at the start of input_ids

IMAGE_TOKEN = "<image>"


def tiny_processor():
    """A Blip2Processor built locally: BLIP's PIL image processor (no torchvision) at 32 px and the
    bundled tokenizer, to which the processor adds the ``<image>`` special token (id 512)."""
    from transformers import Blip2Processor

    try:
        from transformers import BlipImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: the plain class works on PIL images
        from transformers import BlipImageProcessor as ImageProcessor
    images = ImageProcessor(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE})
    return Blip2Processor(image_processor=images, tokenizer=tiny_tokenizer(), num_query_tokens=TINY_QUERY_TOKENS)


def random_init_processor(config):
    """The processor of a random-init BLIP-2 of a real architecture (no hub download): BLIP's image
    processor at the model's own image size (images are resized to it, as the published processors do)
    and the bundled tokenizer (caption ids < 512; the image token id comes from the model config, see
    imagedata.TokenLayout), for memory and speed work where the weights are random anyway."""
    from transformers import Blip2Processor

    try:
        from transformers import BlipImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import BlipImageProcessor as ImageProcessor
    size = int(config.vision_config.image_size)
    images = ImageProcessor(size={"height": size, "width": size})
    return Blip2Processor(
        image_processor=images, tokenizer=tiny_tokenizer(), num_query_tokens=int(config.num_query_tokens)
    )


def _blip2(text_config: dict, ids: dict):
    from transformers import Blip2Config

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=TINY_IMAGE_SIZE,
        patch_size=8,
    )
    qformer = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        encoder_hidden_size=32,
        vocab_size=text_config["vocab_size"],
    )
    return Blip2Config(
        vision_config=vision,
        qformer_config=qformer,
        text_config=text_config,
        num_query_tokens=TINY_QUERY_TOKENS,
        image_token_index=ids["image_token_id"],
        use_cache=False,
    )


def _blip2_opt(vocab: int, ids: dict):
    from transformers import OPTConfig

    text = OPTConfig(
        vocab_size=vocab,
        hidden_size=64,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=512,
        use_cache=False,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    ).to_dict()
    return _blip2(text, ids)


def _blip2_t5(vocab: int, ids: dict):
    from transformers import T5Config

    # Flan-T5 style (gated GELU, separate output layer); the decoder starts from the pad token as T5 does.
    text = T5Config(
        vocab_size=vocab,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        use_cache=False,
        # T5 initialises its untied lm_head with std 1: at hidden 64 the first loss is ~25
        initializer_factor=0.05,
        decoder_start_token_id=ids["pad_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    ).to_dict()
    config = _blip2(text, ids)
    # transformers 5 forces tying on T5 configs; Flan-T5 (and BLIP-2 Flan-T5) keep a separate lm_head.
    config.text_config.tie_word_embeddings = False
    return config


# Model families (issue #26): one tiny random-init model per architecture, 2 layers and hidden 64, so a
# family's real code path (its attention, norms, rotary variant, MoE routing) trains, plans and exports in
# seconds. Each keeps the family's defining traits; the rest is the config class's defaults.
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, use_cache=False)


def _family(config_class: str, **shape) -> Callable[[int, dict], object]:
    """A preset's make_config: ``transformers.<config_class>`` at the tiny shape with ``shape`` on top."""

    def make(vocab: int, ids: dict):
        import transformers

        kw = {k: v for k, v in {**_TINY, **shape}.items() if v is not None}  # None: the class has no such key
        return getattr(transformers, config_class)(vocab_size=vocab, **kw, **ids)

    return make


_GQA = dict(num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
_MOE_DOC = "2 layers, hidden 64, 4 experts of width 64, top-2 routing; router aux loss in training"


PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("causal-lm", _llama, "Llama architecture, 2 layers, hidden 64, GQA 4/2 heads."),
    "tiny-opt": Preset("causal-lm", _opt, "OPT architecture, 2 layers, hidden 64, dropout 0.1."),
    "tiny-bert": Preset(
        "sequence-classification",
        _bert,
        "BERT encoder with a classification head, 2 layers, hidden 64, 4 heads (labels set from the data).",
    ),
    "tiny-blip2-opt": Preset(
        "image-to-text",
        _blip2_opt,
        "BLIP-2: ViT 32 px/patch 8, 1 layer, hidden 32; Q-Former 1 layer, 4 queries; OPT 2 layers, hidden 64.",
    ),
    "tiny-blip2-t5": Preset(
        "image-to-text",
        _blip2_t5,
        "BLIP-2 with a Flan-T5-style text model (2+2 layers, hidden 64); vision and Q-Former as tiny-blip2-opt.",
    ),
    # model families: see _family above
    "tiny-llama3": Preset(
        "causal-lm",
        _family("LlamaConfig", rope_theta=500000.0, **_GQA),
        "Llama 3 style: GQA 4/2 heads, rope_theta 500000, 2 layers, hidden 64.",
    ),
    "tiny-qwen2": Preset(
        "causal-lm",
        _family("Qwen2Config", rope_theta=1000000.0, **_GQA),
        "Qwen2 architecture (q/k/v biases), GQA 4/2 heads, 2 layers, hidden 64.",
    ),
    "tiny-qwen3": Preset(
        "causal-lm",
        _family("Qwen3Config", head_dim=16, rope_theta=1000000.0, **_GQA),
        "Qwen3 architecture (RMS-norm on queries and keys), GQA 4/2 heads, 2 layers, hidden 64.",
    ),
    "tiny-gemma2": Preset(
        "causal-lm",
        _family("Gemma2Config", head_dim=16, query_pre_attn_scalar=16, sliding_window=16, **_GQA),
        "Gemma-2: logit soft-capping, sliding window 16 on alternate layers (eager attention), 2 layers, hidden 64.",
    ),
    "tiny-mistral": Preset(
        "causal-lm",
        _family("MistralConfig", sliding_window=None, **_GQA),
        "Mistral architecture, GQA 4/2 heads, 2 layers, hidden 64.",
    ),
    "tiny-phi3": Preset(
        "causal-lm",
        _family("Phi3Config", original_max_position_embeddings=1024, **_GQA),
        "Phi-3 architecture (fused qkv and gate-up projections), GQA 4/2 heads, 2 layers, hidden 64.",
    ),
    "tiny-gpt-neox": Preset(
        "causal-lm",
        _family("GPTNeoXConfig", rotary_pct=0.25, max_position_embeddings=1024),
        "GPT-NeoX (Pythia) architecture: parallel residual, partial rotary 25 %, 2 layers, hidden 64.",
    ),
    "tiny-stablelm": Preset(
        "causal-lm",
        _family("StableLmConfig", partial_rotary_factor=0.25, **_GQA),
        "StableLM architecture: LayerNorm, partial rotary 25 %, GQA 4/2 heads, 2 layers, hidden 64.",
    ),
    "tiny-falcon": Preset(
        "causal-lm",
        _family("FalconConfig", intermediate_size=None, max_position_embeddings=1024),
        "Falcon architecture: multi-query attention, parallel attention and MLP, 2 layers, hidden 64.",
    ),
    "tiny-bloom": Preset(
        "causal-lm",
        _family("BloomConfig", intermediate_size=None),
        "BLOOM architecture: ALiBi positions (eager attention), 2 layers, hidden 64.",
    ),
    "tiny-mixtral": Preset(
        "causal-lm",
        _family("MixtralConfig", intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **_GQA),
        "Mixtral (sparse MoE): " + _MOE_DOC + ".",
    ),
    "tiny-qwen3-moe": Preset(
        "causal-lm",
        _family("Qwen3MoeConfig", head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **_GQA),
        "Qwen3-MoE: QK-norm, " + _MOE_DOC + ".",
    ),
}


def preset_config(name: str, tokenizer) -> object:
    """The preset's config sized to ``tokenizer`` (a tokenizer, or a processor holding one)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if PRESETS[name].family == "image-to-text":
        ids["image_token_id"] = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    return PRESETS[name].make_config(len(tok), ids)
