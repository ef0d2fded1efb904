"""Built-in tiny model presets: real architectures, random init from a config, a local tokenizer.

They exercise exactly the code path of the real models (same classes, same attention, same
checkpointing hooks) in seconds on a CPU, so they double as test fixtures and the demo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ASSETS = Path(__file__).resolve().parents[1] / "assets"

TOKENIZER_FILE = ASSETS / "tiny_tokenizer.json"

DEMO_DATA = ASSETS / "demo_alpaca.jsonl"

DEMO_CLASSIFICATION_DATA = ASSETS / "demo_reviews.jsonl"  # made by scripts/make_reviews_demo.py

DEMO_CHAT_DATA = ASSETS / "demo_chat.jsonl"  # made by scripts/make_chat_demo.py

IMAGE_TOKEN = "<image>"  # BLIP-2's image placeholder

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
    # image-to-text: the processor (None: tiny_processor, BLIP-2's) and the config keys its special tokens fill
    processor: Optional[Callable[[], object]] = None
    tokens: tuple = (("image_token_id", IMAGE_TOKEN),)


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


# Chat vision-language models (issue #27): Qwen2-VL and Qwen2.5-VL. The image is cut into 14-pixel
# patches at (about) its own size, so the number of image tokens depends on the image; every 2×2 patches
# merge into one language-model token. Qwen2-VL-Instruct's published chat template (chat_template.json),
# which renders an image as <|vision_start|><|image_pad|><|vision_end|>; the processor repeats the pad
# token once per image token.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_VL_TOKENS = (
    ("image_token_id", "<|image_pad|>"),
    ("video_token_id", "<|video_pad|>"),
    ("vision_start_token_id", "<|vision_start|>"),
    ("vision_end_token_id", "<|vision_end|>"),
)

# The bundled photos are 32×32: at Qwen's smallest size (56×56 pixels, 4×4 patches) each is 4 image
# tokens; the cap (112×112, 16 tokens) keeps a large photo cheap on a CPU. Real checkpoints allow up to
# 28×28×1280 pixels (1280 tokens).
TINY_VL_MIN_PIXELS = 56 * 56
TINY_VL_MAX_PIXELS = 112 * 112


def tiny_qwen_vl_processor(class_name: str = "Qwen2VLProcessor"):
    """A Qwen2-VL processor built locally: Qwen's PIL image processor at small min/max pixels and the
    bundled tokenizer plus Qwen's chat and vision tokens (<|im_end|> ends a turn and is EOS, as in
    Qwen2-VL-Instruct's tokenizer)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from bigtune.core.processors import chat_vlm_processor

    tok = tiny_tokenizer()
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"] + [t for _, t in QWEN_VL_TOKENS]}
    )
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(
        min_pixels=TINY_VL_MIN_PIXELS, max_pixels=TINY_VL_MAX_PIXELS, patch_size=14, merge_size=2
    )
    return chat_vlm_processor(class_name, images, tok, QWEN2_VL_CHAT_TEMPLATE)


def _qwen_text(vocab: int, ids: dict) -> dict:
    # head_dim 16: M-RoPE splits its 8 rotary frequencies into temporal, height and width sections
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        use_cache=False,
        bos_token_id=None,
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )


def _vl_ids(ids: dict) -> dict:
    return {key: ids[key] for key, _ in QWEN_VL_TOKENS}


def _qwen2_vl(vocab: int, ids: dict):
    from transformers import Qwen2VLConfig

    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2)
    return Qwen2VLConfig(text_config=_qwen_text(vocab, ids), vision_config=vision, use_cache=False, **_vl_ids(ids))


def _qwen2_5_vl(vocab: int, ids: dict):
    from transformers import Qwen2_5_VLConfig

    # Qwen2.5-VL's vision encoder attends within windows (window_size pixels) except in the full-attention
    # blocks: two blocks, the first windowed, so both kinds run.
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VLConfig(text_config=_qwen_text(vocab, ids), vision_config=vision, use_cache=False, **_vl_ids(ids))


# Fixed-resolution vision-language models (issue #27): every image is resized to the vision tower's size,
# so it is always (image_size / patch)² image tokens. LLaVA-1.5: CLIP ViT + MLP projector + Llama, asked in
# a chat template; PaliGemma (SigLIP + Gemma) and PaliGemma 2 (+ Gemma 2): a prefix LM, no chat template.
# llava-hf/llava-1.5-7b-hf's published chat template (chat_template.json). It ends the answer with a space,
# not EOS: bigtune.data.vlm appends EOS, as LLaVA-1.5 was trained, so that the model learns to stop.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

TINY_FIXED_PATCH = 8  # 32 px / 8 → 4×4 patches: 16 image tokens per photo


def tiny_llava_processor():
    """A LlavaProcessor built locally: CLIP's PIL image processor (resize + centre crop to 32 px; no
    torchvision) and the bundled tokenizer plus ``<image>``, with llava-hf's chat template. CLIP adds a
    class token that LLaVA-1.5 drops ("default" feature selection): 16 image tokens."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    images = CLIPImageProcessorPil(
        size={"shortest_edge": TINY_IMAGE_SIZE}, crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=TINY_FIXED_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )


def _tiny_clip_vision() -> dict:
    # LLaVA-1.5 and -NeXT read the second-to-last CLIP layer (vision_feature_layer -2), so the tower has 2 layers
    return dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_FIXED_PATCH,
        projection_dim=32,
    )


def _llava(vocab: int, ids: dict):
    from transformers import LlavaConfig

    vision = _tiny_clip_vision()
    text = _llama(vocab, {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}).to_dict()
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["image_token_id"],
        image_seq_length=(TINY_IMAGE_SIZE // TINY_FIXED_PATCH) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        use_cache=False,
    )


# LLaVA-NeXT (LLaVA-1.6, issue #27): LLaVA-1.5's CLIP + projector, "anyres" images. The processor fits each
# image into the best of ``image_grid_pinpoints`` (resolutions in multiples of the tower's image size), cuts
# that into tiles of the tower's size and adds the whole image at that size (the base image). The model drops
# the padding the fit added (unpad) and ends each row of tile features with the learned ``image_newline``, so
# the image-token count follows the photo's size and aspect. Tiny: the published pinpoints (336, 672, 1008 px
# on a side) scaled to 32 px tiles; a 32×32 photo is 1×2 tiles + the base image, 36 tokens.
TINY_LLAVA_NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]

# The prompt layout documented for llava-hf/llava-v1.6-mistral-7b-hf ("[INST] <image>\n{prompt} [/INST]",
# transformers' LlavaNextForConditionalGeneration docstring), Mistral's instruct format, written here as a
# chat template (the published chat_template.json is not readable offline); the answer follows after a space.
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}"
    "{% endfor %}{{ ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ ' ' + content['text'] }}"
    "{% endfor %}{% endif %}{% endfor %}"
)


def tiny_llava_next_processor():
    """A LlavaNextProcessor built locally: LLaVA-NeXT's PIL image processor (no torchvision; tiles of 32 px,
    the pinpoints in TINY_LLAVA_NEXT_PINPOINTS) and the bundled tokenizer plus ``<image>``; CLIP's class token
    dropped ("default" feature selection), as in LLaVA-1.6."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = LLAVA_NEXT_CHAT_TEMPLATE
    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": TINY_IMAGE_SIZE},
        crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
        image_grid_pinpoints=TINY_LLAVA_NEXT_PINPOINTS,
    )
    return LlavaNextProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=TINY_FIXED_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_NEXT_CHAT_TEMPLATE,
    )


def _llava_next(vocab: int, ids: dict):
    from transformers import LlavaNextConfig, MistralConfig

    # tiny-llava's CLIP tower; a Mistral text model, as in llava-v1.6-mistral-7b (no sliding window at this length)
    text = MistralConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        sliding_window=None,
        tie_word_embeddings=False,
        use_cache=False,
        **{k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    ).to_dict()
    return LlavaNextConfig(
        vision_config=_tiny_clip_vision(),
        text_config=text,
        image_token_index=ids["image_token_id"],
        image_grid_pinpoints=TINY_LLAVA_NEXT_PINPOINTS,
        image_seq_length=(TINY_IMAGE_SIZE // TINY_FIXED_PATCH) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        use_cache=False,
    )


def tiny_paligemma_processor():
    """A PaliGemmaProcessor built locally: SigLIP's PIL image processor at 32 px (16 image tokens) and the
    bundled tokenizer; the processor adds ``<image>`` and PaliGemma's 1024 location and 128 segmentation
    tokens, as the published tokenizer has them."""
    from transformers import PaliGemmaProcessor, SiglipImageProcessorPil

    images = SiglipImageProcessorPil(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE})
    images.image_seq_length = (TINY_IMAGE_SIZE // TINY_FIXED_PATCH) ** 2  # PaliGemmaProcessor reads it from here
    tok = tiny_tokenizer()
    tok.chat_template = None  # PaliGemma is prompted with plain text (a prefix), not a conversation
    return PaliGemmaProcessor(image_processor=images, tokenizer=tok)


def _paligemma(text_type: str, **text_shape):
    def make(vocab: int, ids: dict):
        from transformers import PaliGemmaConfig

        vision = dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=TINY_IMAGE_SIZE,
            patch_size=TINY_FIXED_PATCH,
            vision_use_head=False,  # PaliGemma reads the patch features; SigLIP's pooling head is not built
        )
        text = dict(
            model_type=text_type,
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            use_cache=False,
            bos_token_id=ids["bos_token_id"],
            eos_token_id=ids["eos_token_id"],
            pad_token_id=ids["pad_token_id"],
            **text_shape,
        )
        return PaliGemmaConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=ids["image_token_id"],
            vocab_size=vocab,
            projection_dim=64,
            hidden_size=64,
            use_cache=False,
        )

    return make


# SmolVLM (issue #27), the Idefics3 architecture of HuggingFaceTB/SmolVLM-Instruct: SigLIP + pixel-shuffle
# connector + Llama. Its processor upscales an image to ``size`` on its longest side and splits it into tiles
# of ``max_image_size`` plus the whole image at that size, each tile (image_size / patch)² / scale_factor²
# tokens. Tiny: 64 px images, 32 px tiles of 4 tokens; a square photo is 2×2 tiles + the global image.
# SmolVLM-Instruct's published chat template; its turns end with <end_of_utterance>, its EOS.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TINY_SMOLVLM_SCALE = 2  # the connector's pixel shuffle: 4×4 patches of a 32 px tile → 2×2 = 4 tokens


def tiny_smolvlm_processor():
    """An Idefics3Processor built locally (SmolVLM-Instruct's layout): Idefics3's PIL image processor (no
    torchvision) resizing to 64 px and splitting into 32 px tiles, and the bundled tokenizer plus SmolVLM's
    image, tile-position and end-of-utterance tokens (EOS, as in SmolVLM-Instruct)."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tok = tiny_tokenizer()
    tiles = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    special = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>", *tiles]
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.eos_token = "<end_of_utterance>"
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * TINY_IMAGE_SIZE}, max_image_size={"longest_edge": TINY_IMAGE_SIZE}
    )
    tile_tokens = (TINY_IMAGE_SIZE // TINY_FIXED_PATCH) ** 2 // TINY_SMOLVLM_SCALE**2
    return Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=tile_tokens, chat_template=SMOLVLM_CHAT_TEMPLATE
    )


def _smolvlm(vocab: int, ids: dict):
    from transformers import Idefics3Config

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_FIXED_PATCH,
    )
    text = _llama(vocab, {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}).to_dict()
    return Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["image_token_id"],
        scale_factor=TINY_SMOLVLM_SCALE,
        pad_token_id=ids["pad_token_id"],
        use_cache=False,
    )


# Model families (issue #26): one tiny random-init model per architecture, 2 layers and hidden 64, so a
# family's real code path (its attention, norms, rotary variant, MoE routing) trains, plans and exports in
# seconds. Each keeps the family's defining traits; the rest is the config class's defaults.
def _generic_vlm(model_type: str) -> tuple[Callable[[int, dict], object], Callable[[], object]]:
    """(make_config, processor) of a tiny ``model_type`` vision-language model of the generic chat-VLM path,
    both from core.tiny_vlm (which sizes the config to its own processor's tokenizer and special tokens)."""

    def make_config(vocab: int, ids: dict):
        from bigtune.core.tiny_vlm import tiny_vlm

        return tiny_vlm(model_type)[1]

    def processor():
        from bigtune.core.tiny_vlm import tiny_vlm

        return tiny_vlm(model_type)[0]

    return make_config, processor


_QWEN3_VL, _GEMMA3_VL = _generic_vlm("qwen3_vl"), _generic_vlm("gemma3")


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
    "tiny-qwen2-vl": Preset(
        "image-to-text",
        _qwen2_vl,
        "Qwen2-VL (chat vision-language, dynamic resolution): ViT patch 14, 1 layer, width 32, 2×2 patch merger; "
        "Qwen2 text model 2 layers, hidden 64, M-RoPE.",
        processor=tiny_qwen_vl_processor,
        tokens=QWEN_VL_TOKENS,
    ),
    "tiny-qwen2.5-vl": Preset(
        "image-to-text",
        _qwen2_5_vl,
        "Qwen2.5-VL: windowed + full-attention ViT (2 layers, width 32, SwiGLU, RMS-norm), 2×2 patch merger; "
        "Qwen2 text model 2 layers, hidden 64, M-RoPE.",
        processor=lambda: tiny_qwen_vl_processor("Qwen2_5_VLProcessor"),
        tokens=QWEN_VL_TOKENS,
    ),
    "tiny-llava": Preset(
        "image-to-text",
        _llava,
        "LLaVA-1.5: CLIP ViT 32 px/patch 8 (2 layers, width 32; the second-to-last layer's 16 patch features), "
        "2-layer MLP projector, Llama 2 layers, hidden 64; llava-hf's chat template.",
        processor=tiny_llava_processor,
    ),
    "tiny-llava-next": Preset(
        "image-to-text",
        _llava_next,
        "LLaVA-NeXT (LLaVA-1.6, anyres): tiny-llava's CLIP ViT and projector; each image fitted to one of 5 "
        "tile grids (32 px tiles, the published pinpoints scaled) plus the whole image, unpadded, a learned "
        "newline per row (36 image tokens for a square photo); Mistral 2 layers, hidden 64; [INST] prompts.",
        processor=tiny_llava_next_processor,
    ),
    "tiny-paligemma": Preset(
        "image-to-text",
        _paligemma("gemma"),
        "PaliGemma: SigLIP ViT 32 px/patch 8 (1 layer, width 32; 16 image tokens), linear projector, Gemma 2 "
        "layers, hidden 64; prefix LM (image and prompt attend both ways, the caption causally).",
        processor=tiny_paligemma_processor,
    ),
    "tiny-paligemma2": Preset(
        "image-to-text",
        _paligemma("gemma2", query_pre_attn_scalar=16, sliding_window=16),
        "PaliGemma 2: as tiny-paligemma with a Gemma-2 text model (logit soft-capping, sliding window 16 on "
        "alternate layers; eager attention).",
        processor=tiny_paligemma_processor,
    ),
    "tiny-smolvlm": Preset(
        "image-to-text",
        _smolvlm,
        "SmolVLM (Idefics3): SigLIP ViT 32 px/patch 8 (1 layer, width 32), pixel-shuffle connector (4 tokens a "
        "tile), Llama 2 layers, hidden 64; images upscaled to 64 px and split into 32 px tiles + the whole image.",
        processor=tiny_smolvlm_processor,
    ),
    # the generic chat-VLM path (data.vlm, issue #46): any image-text-to-text family, built by core.tiny_vlm
    "tiny-qwen3-vl": Preset(
        "image-to-text",
        _QWEN3_VL[0],
        "Qwen3-VL: ViT 2 layers, width 32, patch 16, 2×2 merger and DeepStack mergers; Qwen3 text model 2 layers, "
        "hidden 64, interleaved M-RoPE; the generic chat-VLM path (its processor lays out every photo).",
        processor=_QWEN3_VL[1],
        tokens=(),
    ),
    "tiny-gemma3-vl": Preset(
        "image-to-text",
        _GEMMA3_VL[0],
        "Gemma 3 (vision-language): SigLIP 64 px/patch 16 (2 layers, width 32) pooled to 4 image tokens, Gemma 3 "
        "text model 2 layers, hidden 64; the generic chat-VLM path.",
        processor=_GEMMA3_VL[1],
        tokens=(),
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
    "tiny-gemma3": Preset(
        "causal-lm",
        _family(
            "Gemma3TextConfig",
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            **_GQA,
        ),
        "Gemma-3 (text): QK-norm, sliding window 16 then global attention, local and global RoPE, 2 layers, hidden 64.",
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
        ids.update({key: tok.convert_tokens_to_ids(token) for key, token in PRESETS[name].tokens})
    return PRESETS[name].make_config(len(tok), ids)


def preset_processor(name: str):
    """An image-to-text preset's processor, built locally (BLIP-2's or Qwen2-VL's)."""
    make = PRESETS[name].processor
    return make() if make is not None else tiny_processor()
