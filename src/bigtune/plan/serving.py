"""bigtune plan --for generate|caption|predict: memory, the largest batch and tokens/s for serving.

Method (the training planner's, applied to inference). The model's own forward code runs on *fake*
tensors (shapes and dtypes, no data, no memory) under the ``LiveTensorTracker`` that measures real
CPU runs, inside a greedy decoding loop that mirrors transformers' ``generate`` step by step:

* prefill: the prompt through the model with an empty ``DynamicCache`` (only the last position's
  logits are computed, ``logits_to_keep=1``, where the model supports it), then the float32 copy of
  those logits that ``generate`` takes before picking the token;
* decode: one token per step through the growing cache (each layer's cache grows by ``torch.cat``,
  so the old and the new copy of one layer's cache briefly coexist), ``max_new_tokens - 1`` steps; once
  three steps repeat event for event, the rest are written from them, not run (DecodeRepeat).

``caption`` runs BLIP-2's own ``generate`` (vision tower, Q-Former, projection, the image tokens
put in the prompt) with the language model's ``generate`` replaced by that loop; a chat
vision-language model (Qwen2-VL, LLaVA, LLaVA-NeXT, PaliGemma, SmolVLM) runs that loop itself on the batch ``bigtune
caption`` builds (chatvlm.caption_images: the chat template, each image's tokens, its pixels), the
vision tower inside the prefill forward; ``predict`` is one
forward without a cache (a classification head's, or a causal LM's full logits). Only the language
model's first two and three layers are simulated (four and eight for a CUDA target, see below);
every byte count is then extrapolated linearly to the real depth, per phase, so a phase that peaks
only on a deep model is still seen. On a CPU the plan therefore matches a measurement (tests:
within 5 %); the KV-cache term is also given in closed form, 2·layers·kv_heads·head_dim·tokens·
batch·bytes, and the two agree exactly.

For a CUDA target the tracker also records every storage's birth and death (the weights first, as
loaded, then the inputs and every step), and that sequence is replayed through the model of PyTorch's
CUDA caching allocator (``allocator.py``, PyTorch's default settings): its peak reserved, and the least
device memory it runs in (the allocator frees its cache and retries when full), which is what FITS is
judged by. Both are extrapolated over depth like the training planner's (``simulate.replayed_over_depth``).
The CUDA context is the training planner's assumption (``planner.py``). Times are
roofline *estimates*, stated with their assumptions: decode is bandwidth bound (each step reads
every weight and the whole cache once), prefill is compute bound.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional
from unittest import mock

import torch

from bigtune.models.configs import resolve_config_name
from bigtune.plan.base.constants import CUDA_CONTEXT_BYTES, FIT_UNCERTAINTY, GIB, HOST_BASE_BYTES, PlanError
from bigtune.plan.base.target import Target, target_arch
from bigtune.recipe import Recipe

TASKS = ("generate", "caption", "predict")

# --- assumptions for time estimates (uncalibrated until GPU measurements are committed) ---
ASSUMED_PREFILL_MFU = 0.45  # prefill is a large batched forward: as the training planner's MFU

ASSUMED_DECODE_BW_EFFICIENCY = 0.7  # decode streams weights + cache: the training planner's bandwidth fraction

# --- host resources (rules, stated in the plan) ---
LOAD_HEADROOM = 1.25  # host RAM while loading: the weights once in the load dtype, + 25 %


IMAGES_PER_CORE_S = 50.0  # assumed images/s one core decodes and resizes (JPEG, 224 px)


@dataclass
class Workload:
    """One batch of one inference task."""

    task: str  # generate | caption | predict
    batch_size: int
    prompt_tokens: int  # text tokens of the prompt (caption: after the image tokens; 0 = none)
    new_tokens: int  # max_new_tokens (predict: 0)
    dtype: torch.dtype  # weights / compute dtype
    quantize: str = "none"  # none | nf4 | fp4 | int8 (linear weights of the base)
    double_quant: bool = True
    image_size: Optional[tuple[int, int]] = None  # caption, Qwen2-VL: --image-size (None: the worst case)
    images: Any = None  # caption, chat vision-language models: chatvlm.CaptionImages (plan_inference sets it)


def inference_dtype(recipe: Recipe, dtype: str = "auto") -> torch.dtype:
    """``auto``: the recipe's compute dtype (bf16-* → bfloat16, 16-* → float16, 32-true → float32)."""
    if dtype != "auto":
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        except KeyError:
            raise PlanError(f"--dtype {dtype!r}: use auto, float32, bfloat16 or float16") from None
    p = recipe.precision
    if p.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if p.startswith("16") else torch.float32


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _is_t5_like(text_cfg) -> bool:
    return bool(getattr(text_cfg, "is_encoder_decoder", False))


def _depth_attr(text_cfg) -> str:
    return "num_decoder_layers" if _is_t5_like(text_cfg) else "num_hidden_layers"


def lm_layers(config) -> int:
    t = _text_config(config)
    return int(getattr(t, _depth_attr(t)))


def _with_depth(config, n: int):
    cfg = copy.deepcopy(config)
    t = _text_config(cfg)
    setattr(t, _depth_attr(t), n)
    return cfg


def lm_prompt_length(config, w: Workload) -> int:
    """Tokens the language model's cache starts from: the prompt (caption: the image tokens, BOS, prompt)."""
    if w.task == "caption" and w.images is not None:  # the chat template's text around the image's tokens
        return len(w.images.prompt_ids) - 1 + w.images.image_tokens
    if w.task == "caption":
        nq = int(getattr(config, "num_query_tokens", 0))
        if _is_t5_like(_text_config(config)):
            return nq + w.prompt_tokens + 1  # encoder input: image tokens, prompt, EOS
        return nq + 1 + w.prompt_tokens  # image tokens, BOS, prompt
    return w.prompt_tokens


def kv_cache_bytes(config, w: Workload) -> int:
    """The KV cache at its fullest, in closed form.

    Decoder-only: 2 (K and V) · layers · kv_heads · head_dim · tokens · batch · bytes, with tokens =
    prompt + max_new_tokens − 1 (the last token is returned, never fed back). GQA models keep
    ``num_key_value_heads`` heads. T5 (encoder-decoder): the decoder's self-attention cache over its
    start token and new tokens (max_new_tokens) plus the cross-attention cache over the encoder length.
    """
    if w.task == "predict" or w.new_tokens < 1:
        return 0
    t = _text_config(config)
    es = torch.empty((), dtype=w.dtype).element_size()
    b = w.batch_size
    if _is_t5_like(t):
        layers, heads, hd = int(t.num_decoder_layers), int(t.num_heads), int(t.d_kv)
        self_tokens = w.new_tokens  # decoder start token + max_new_tokens − 1 fed back
        cross_tokens = lm_prompt_length(config, w)
        return 2 * layers * heads * hd * (self_tokens + cross_tokens) * b * es
    layers = int(t.num_hidden_layers)
    heads = int(t.num_attention_heads)
    kv_heads = int(getattr(t, "num_key_value_heads", None) or heads)
    hd = int(getattr(t, "head_dim", None) or (int(t.hidden_size) // heads))
    tokens = lm_prompt_length(config, w) + w.new_tokens - 1
    return 2 * layers * kv_heads * hd * tokens * b * es


@dataclass
class InferSim:
    """Byte counts of one simulated batch: peak per phase, and what is held at the end."""

    phases: dict[str, int]  # peak allocated per phase (vision, prefill, decode | forward)
    weights: int  # parameters + buffers (+ quantization state)
    cache: int  # KV cache held at the end of decoding (simulated tensors)
    numel: int  # parameters
    lm_matmul_numel: int  # language model's nn.Linear weights (FLOPs and bytes per token)
    vision_matmul_numel: int  # vision tower + Q-Former nn.Linear weights
    largest_linear: int  # elements of the largest quantized nn.Linear weight (dequant temporary)
    # CUDA targets (0 on a CPU): the caching allocator replayed over the batch (allocator.replay): its peak
    # reserved, and the least device memory the replay survives on (allocator.least_capacity: what must fit)
    reserved: int = 0
    needed: int = 0
    replayed_at: tuple[int, ...] = ()  # the two depths replayed and extrapolated from (() at full depth)
    # CUDA targets: the simulated batch's trace at each language-model depth simulated (largest_batch writes
    # other batch sizes from two of them: written_at)
    traces: dict[int, "Trace"] = field(default_factory=dict, repr=False, compare=False)

    def scalars(self) -> dict[str, int]:
        d = {f"phase:{k}": v for k, v in self.phases.items()}
        d.update(
            weights=self.weights,
            cache=self.cache,
            numel=self.numel,
            lm_matmul_numel=self.lm_matmul_numel,
            vision_matmul_numel=self.vision_matmul_numel,
            largest_linear=self.largest_linear,
            reserved=self.reserved,
            needed=self.needed,
        )
        return d

    @classmethod
    def from_scalars(cls, d: dict[str, int]) -> "InferSim":
        phases = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("phase:")}
        return cls(
            phases,
            d["weights"],
            d["cache"],
            d["numel"],
            d["lm_matmul_numel"],
            d["vision_matmul_numel"],
            d["largest_linear"],
            d.get("reserved", 0),
            d.get("needed", 0),
        )


def _auto_class(family: str, task: str):
    if family == "image-to-text":
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    if family == "sequence-classification":
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def build_inference_model(config, family: str, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """The model as inference uses it: from its config, in ``dtype``, eval mode, cache on.

    The CPU measurement in the tests builds the model with this same function on real tensors.
    """
    cfg = copy.deepcopy(config)
    cfg._attn_implementation = attn_implementation
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None:
            c.use_cache = True
    model = _auto_class(family, "").from_config(cfg, dtype=dtype)
    return model.eval()


def greedy_config(new_tokens: int, pad_id: int):
    """The generation settings planned and measured: greedy, all ``new_tokens`` produced (no early EOS)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        pad_token_id=pad_id,
        eos_token_id=None,
        min_new_tokens=None,
    )


def decode_loop(
    lm,
    input_ids,
    attention_mask,
    new_tokens: int,
    tracker,
    phases: dict,
    inputs_embeds=None,
    extra=None,
    repeat: Optional["DecodeRepeat"] = None,
) -> Any:
    """Greedy decoding as ``transformers.GenerationMixin._sample`` does it, on any tensors.

    Mirrors generate's per-step allocations: the previous step's outputs stay alive until the next
    forward returns, the float32 copy of the last position's logits, the argmax and the growing
    ``input_ids``. Phase peaks are written to ``phases`` (prefill, decode). ``extra``: further model
    inputs (a chat vision-language model's pixels, image grids, token types), which the model's own
    prepare_inputs_for_generation passes to the prefill only. ``repeat``: asked at the start of every
    decode step whether the steps left repeat the last ones (then the loop stops there and
    ``DecodeRepeat.complete`` writes them). Returns the cache.
    """
    from transformers import DynamicCache, EncoderDecoderCache

    enc_dec = bool(getattr(lm.config, "is_encoder_decoder", False))
    kw: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": True, **(extra or {})}
    if enc_dec:
        # generate runs the encoder once, then decodes from the decoder start token.
        enc_kw = {"attention_mask": attention_mask, "return_dict": True}
        enc_kw["inputs_embeds" if inputs_embeds is not None else "input_ids"] = (
            inputs_embeds if inputs_embeds is not None else input_ids
        )
        kw["encoder_outputs"] = lm.get_encoder()(**enc_kw)
        start = lm.config.decoder_start_token_id
        b = attention_mask.shape[0]
        input_ids = torch.full((b, 1), int(start if start is not None else 0), dtype=torch.long)
        kw["cache"] = EncoderDecoderCache(DynamicCache(config=lm.config), DynamicCache(config=lm.config))
    else:
        kw["cache"] = DynamicCache(config=lm.config)
        if inputs_embeds is not None:
            kw["inputs_embeds"] = inputs_embeds
    if lm._supports_logits_to_keep():
        kw["logits_to_keep"] = 1
    if extra and "position_ids" in inspect.signature(lm.forward).parameters:
        # generate's own start: positions from the mask (Qwen2-VL: its 3-D M-RoPE positions, from the image grids)
        kw["position_ids"] = lm._prepare_position_ids_for_generation(input_ids, {**kw, "input_ids": input_ids})
    # generate (transformers 5.2x) passes the cache as ``cache`` and no cache_position: the model works
    # positions out from the cache (a stale cache_position kept in the kwargs misplaces Qwen2-VL's M-RoPE)
    length = input_ids.shape[1] if inputs_embeds is None or enc_dec else inputs_embeds.shape[1]
    inputs = lm.prepare_inputs_for_generation(input_ids, next_sequence_length=length, is_first_iteration=True, **kw)
    out = lm(**inputs, return_dict=True)
    for step in range(new_tokens):
        if step == 1:  # the prefill forward and its token are done
            phases["prefill"] = tracker.peak_bytes
            tracker.reset_peak()
        if step and repeat is not None and repeat.stop(step, kw["cache"], lm.config):
            break
        if step:
            inputs = lm.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **kw)
            out = lm(**inputs, return_dict=True)
        kw = lm._update_model_kwargs_for_generation(out, kw, is_encoder_decoder=enc_dec)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        next_tokens = torch.argmax(logits, dim=-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
    if new_tokens == 1:
        phases["prefill"] = tracker.peak_bytes
    else:
        phases["decode"] = tracker.peak_bytes
    return kw["cache"]


REPEAT_STEPS = 3  # consecutive decode steps that must repeat exactly before the rest are written from them


class DecodeRepeat:
    """Decode steps written from the ones simulated, once they repeat.

    From the second decode step on, every step runs the same operators in the same order on one more
    cached token: the same storages are born and die, each one's size grows by a fixed number of bytes
    per step (the cache's and the attention mask's ``torch.cat``: the KV cache grows by 2·layers·
    kv_heads·head_dim·batch·bytes a step, in closed form in ``kv_cache_bytes``), and each free hits the
    storage born the same number of steps earlier at the same place. So once ``REPEAT_STEPS``
    consecutive steps show exactly that (the same event kinds, the same frees, sizes growing by the same
    bytes), the events of the steps left are those of the last one with the sizes grown, and the loop
    stops: the allocator replay, the decode peak and the cache at the end come out as a full run's
    (tests: equal to the byte on the tiny presets; the prefill and 5 decode steps instead of 63 for the
    7B example). Not where a length the model changes behaviour at (a sliding window, an attention chunk,
    the positions RoPE was trained on) lies between the steps compared and the last one: those run.
    """

    def __init__(self, tracker, new_tokens: int):
        self.tracker = tracker
        self.new_tokens = new_tokens
        self.starts: list[int] = []  # event index where decode step 1, 2, ... starts
        self.live: list[int] = []  # tracker.live_bytes there
        self.cache: list[int] = []  # bytes of the KV cache there
        self.cut = 0  # the decode step the loop stopped before (0: it ran to the end)

    def stop(self, step: int, cache, config) -> bool:
        """At the start of decode step ``step``: record it; whether the steps left are written instead of run."""
        events = self.tracker.events
        if events is None:  # an untraced run: nothing to write the steps from
            return False
        self.starts.append(len(events))
        self.live.append(self.tracker.live_bytes)
        self.cache.append(cache_bytes(cache))
        first = step - REPEAT_STEPS  # the steps compared: first .. step - 1 (from step 2 on)
        if first < 2 or step >= self.new_tokens - 1:
            return False
        growth = {self.cache[i] - self.cache[i - 1] for i in range(first, step)}
        length = int(cache.get_seq_length())
        final = length + self.new_tokens - step
        if len(growth) > 1 or any(length - REPEAT_STEPS - 1 <= t <= final + 1 for t in length_thresholds(config)):
            return False
        shapes = [self._step(events, s) for s in range(first, step)]
        if any(s is None for s in shapes) or any(s[0] != shapes[0][0] for s in shapes):
            return False
        sizes = [s[1] for s in shapes]
        deltas = [[b - a for a, b in zip(x, y)] for x, y in zip(sizes, sizes[1:])]
        if any(d != deltas[0] for d in deltas):
            return False
        self.cut = step
        return True

    def _step(self, events: list, s: int) -> Optional[tuple[list, list[int]]]:
        """Decode step ``s``'s events as (kinds and frees, alloc sizes): a free as (steps back, place), the place
        counted from the step's start (its own step) or from the end of an earlier one (where the first decode
        steps free what the prefill left, they are a few events shorter); None where one frees a storage
        born before decoding (that cannot recur)."""
        import bisect

        lo, hi = self.starts[s - 1], self.starts[s]
        shape, sizes = [], []
        for ev in events[lo:hi]:
            if ev[0] == "alloc":
                shape.append("alloc")
                sizes.append(ev[2])
                continue
            born = bisect.bisect_right(self.starts, ev[1])  # the step the freed storage was born in
            if born < 1 or s - born > 2:
                return None
            shape.append((0, ev[1] - lo) if born == s else (s - born, self.starts[born] - ev[1]))
        return shape, sizes

    def complete(self, events: list, round_to: int) -> Optional[tuple[list, int, int]]:
        """(the events of all ``new_tokens`` steps, the decode phase's peak bytes, the KV cache at the end)
        from a loop cut at step ``cut``; None where a storage is born after the loop (nothing is written)."""
        cut, starts = self.cut, self.starts[: self.cut - 1]  # the steps run before the last one compared
        tail = events[self.starts[cut - 1] :]
        if any(ev[0] == "alloc" for ev in tail):
            return None
        out = events[: self.starts[cut - 1]]  # the loop's locals' frees after it are left out: nothing follows
        shape, last = self._step(events, cut - 1)
        prev = self._step(events, cut - 2)[1]
        growth = [b - a for a, b in zip(prev, last)]
        for t in range(cut, self.new_tokens):
            starts.append(len(out))
            sizes = iter(x + g * (t - cut + 1) for x, g in zip(last, growth))
            for kind in shape:
                if kind == "alloc":
                    out.append(("alloc", len(out), next(sizes)))
                else:
                    back, at = kind  # starts[t - 1]: where step t starts; starts[t - back]: where step t - back ends
                    out.append(("free", starts[t - 1] + at if back == 0 else starts[t - back] - at))
        size = {ev[1]: -(-ev[2] // round_to) * round_to for ev in out if ev[0] == "alloc"}
        live = peak = self.live[0]  # the decode phase's peak starts where step 1 starts
        for ev in out[starts[0] :]:
            live += size[ev[1]] if ev[0] == "alloc" else -size.get(ev[1], 0)
            peak = max(peak, live)
        kv = self.cache[-1] + (self.cache[-1] - self.cache[-2]) * (self.new_tokens - cut)
        return out, peak, kv


def length_thresholds(config) -> set[int]:
    """Cache lengths at which a model's decode steps can change: sliding windows, attention chunks, the
    positions its RoPE covers (dynamic and long RoPE switch there)."""
    found: set[int] = set()
    for c in {id(x): x for x in (config, _text_config(config))}.values():
        for key in ("sliding_window", "attention_chunk_size", "max_position_embeddings"):
            if isinstance(getattr(c, key, None), int):
                found.add(int(getattr(c, key)))
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        for params in [rope, *(v for v in rope.values() if isinstance(v, dict))] if isinstance(rope, dict) else []:
            if isinstance(params.get("original_max_position_embeddings"), int):
                found.add(int(params["original_max_position_embeddings"]))
    return found


def cache_bytes(cache) -> int:
    """Bytes of every key/value tensor a transformers cache holds."""
    from bigtune.core.stepmath import storage_bytes

    caches = (
        [cache.self_attention_cache, cache.cross_attention_cache]
        if hasattr(cache, "cross_attention_cache")
        else [cache]
    )
    tensors = []
    for c in caches:
        for layer in getattr(c, "layers", []):
            tensors += [
                t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)
            ]
    return storage_bytes(tensors)


def make_inputs(config, w: Workload):
    """Token ids (and pixels for caption) of one full batch: every prompt exactly ``prompt_tokens`` long."""
    t = _text_config(config)
    vocab = int(t.vocab_size)
    g = torch.Generator().manual_seed(0)
    if w.task == "caption" and w.images is not None:
        from bigtune.plan.step.chatvlm import caption_inputs

        return caption_inputs(w.images, w.batch_size, w.dtype)
    if w.task == "caption":
        vc = config.vision_config
        pixels = torch.randn(
            w.batch_size, int(getattr(vc, "num_channels", 3)), int(vc.image_size), int(vc.image_size), generator=g
        ).to(w.dtype)
        nq = int(config.num_query_tokens)
        image = [int(config.image_token_index)] * nq
        rng = random.Random(0)  # plain Python: under fake tensors a tensor's values cannot be read
        text = [rng.randrange(3, min(vocab, 500)) for _ in range(w.prompt_tokens)]
        eos, bos = getattr(t, "eos_token_id", None), getattr(t, "bos_token_id", None)
        if _is_t5_like(t):
            row = image + text + ([int(eos)] if eos is not None else [])
        else:
            row = image + ([int(bos)] if bos is not None else []) + text
        ids = torch.tensor([row] * w.batch_size, dtype=torch.long)
        return {"pixel_values": pixels, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ids = torch.randint(3, vocab, (w.batch_size, w.prompt_tokens), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def run_workload(model, inputs: dict, w: Workload, tracker, phases: dict, repeat: Optional[DecodeRepeat] = None):
    """Run the workload on ``model`` (real or fake tensors) under ``tracker``; returns the KV cache (or None).
    ``repeat``: see decode_loop."""
    if w.task == "predict":
        out = model(**inputs, use_cache=False, return_dict=True)
        phases["forward"] = tracker.peak_bytes
        del out
        return None
    if w.task == "caption" and w.images is not None:  # the vision tower runs inside the prefill forward
        rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        return decode_loop(
            model,
            inputs["input_ids"],
            inputs["attention_mask"],
            w.new_tokens,
            tracker,
            phases,
            extra=rest,
            repeat=repeat,
        )
    if w.task == "caption":
        holder: dict[str, Any] = {}

        def lm_generate(inputs_embeds=None, attention_mask=None, input_ids=None, **_ignored):
            phases["vision"] = tracker.peak_bytes  # vision tower + Q-Former + projection, before the LM starts
            tracker.reset_peak()
            holder["cache"] = decode_loop(
                model.language_model,
                input_ids,
                attention_mask,
                w.new_tokens,
                tracker,
                phases,
                inputs_embeds=inputs_embeds,
                repeat=repeat,
            )
            return None

        with mock.patch.object(model.language_model, "generate", lm_generate, create=True):
            model.generate(**inputs, max_new_tokens=w.new_tokens)
        return holder["cache"]
    return decode_loop(
        model, inputs["input_ids"], inputs["attention_mask"], w.new_tokens, tracker, phases, repeat=repeat
    )


def _linear_stats(model, quantized: bool) -> tuple[int, int, int, list]:
    """(LM linear numel, vision+Q-Former linear numel, largest quantizable linear, quantizable linears)."""
    from bigtune.plan.step.quantized import quantized_linears

    lm = vision = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        n = mod.weight.numel()
        vision_parts = ("vision_model", "qformer", "language_projection", "visual", "vision_tower", "connector")
        if any(k in name for k in vision_parts) or "multi_modal_projector" in name:
            vision += n
        else:
            lm += n
    # the same rule as training plans: what transformers' bitsandbytes loading quantizes
    quant = [mod.weight for _, mod in quantized_linears(model)]
    largest = max((w.numel() for w in quant), default=0)
    return lm, vision, largest, quant


def quantized_weight_delta(weights: list, quantize: str, double_quant: bool) -> int:
    """Bytes bitsandbytes loading saves on the given linear weights (negative); the byte rule is the
    training planner's ``packed_weight_bytes``."""
    from bigtune.plan.step.quantized import packed_weight_bytes

    return sum(packed_weight_bytes(w, quantize, double_quant) - w.numel() * w.element_size() for w in weights)


def simulate(
    config,
    family: str,
    w: Workload,
    cuda: bool,
    attn_implementation: str = "sdpa",
    arch: Optional[tuple[int, int]] = None,
    repeat: bool = True,
) -> InferSim:
    """Run one batch of ``w`` on fake tensors with ``config`` as given (no depth change); on a CUDA
    target of compute capability ``arch`` attention takes the math path wherever CUDA would, and the
    storages' births and deaths are replayed through the caching allocator (``InferSim.reserved``,
    ``InferSim.needed``). ``repeat``: write the decode steps that repeat instead of running them
    (DecodeRepeat); False runs every step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bigtune.core.stepmath import storage_bytes
    from bigtune.memory.tracker import LiveTensorTracker
    from bigtune.plan.device.kernels import cuda_attention
    from bigtune.plan.step.chatvlm import real_index_math

    # Fake tensors look like tracing to transformers, which would then keep an explicit mask for packed
    # sequences that a real (unpadded) batch drops; the training planner patches the same function.
    no_packing = mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None)
    # Truncated-normal init (BLIP-2's vision tower) draws data-dependent samples: skip it on fake weights.
    from transformers.initialization import TORCH_INIT_FUNCTIONS

    no_trunc_init = mock.patch.dict(TORCH_INIT_FUNCTIONS, {"trunc_normal_": lambda tensor, **_: tensor})
    phases: dict[str, int] = {}
    kernels = cuda_attention(arch if arch is not None else ((8, 0) if cuda else None))
    # a chat vision-language model places its image tokens and positions from its integer inputs' values
    index_math = real_index_math() if w.images is not None else contextlib.nullcontext()
    # the same fake model for every batch size (_keep_model)
    key = (config.to_json_string(), family, w.dtype, attn_implementation, w.images is not None)
    mode, model = FAKE_MODELS.get(key) or (FakeTensorMode(allow_non_fake_inputs=True), None)
    with index_math, mode, no_packing, no_trunc_init, torch.no_grad(), kernels:
        model = model or build_inference_model(config, family, w.dtype, attn_implementation)
        inputs = make_inputs(config, w)
        repeat = repeat and w.task != "predict"  # the decode steps are written from the events
        events: Optional[list] = [] if (cuda or repeat) else None
        tracker = LiveTensorTracker(round_to=512 if cuda else 1, events=events)
        resets = _marking_resets(tracker)
        steps = DecodeRepeat(tracker, w.new_tokens) if repeat else None
        held = list(model.parameters()) + list(model.buffers())
        weights = storage_bytes(held)
        lm_mm, vis_mm, largest, quant = _linear_stats(model, w.quantize != "none")
        packed = track_weights(tracker, held, quant if w.quantize != "none" else [], w)
        tracker.track(list(inputs.values()))
        tracker.reset_peak()
        with tracker:
            cache = run_workload(model, inputs, w, tracker, phases, steps)
        kv = cache_bytes(cache) if cache is not None else 0
        numel = sum(p.numel() for p in model.parameters())
        delta = quantized_weight_delta(quant, w.quantize, w.double_quant) if w.quantize != "none" else 0
        _keep_model(key, mode, model, held)
    if steps is not None and steps.cut:
        done = steps.complete(events, tracker.round_to)
        if done is None:  # a storage born after the loop: run every step
            return simulate(config, family, w, cuda, attn_implementation, arch, repeat=False)
        events, phases["decode"], kv = done
    replayed = replay_batch(loaded_as(events, packed)) if cuda else (0, 0)
    weights += delta
    phases = {k: v + delta for k, v in phases.items()}
    out = InferSim(phases, weights, kv, numel, lm_mm, vis_mm, largest if w.quantize != "none" else 0, *replayed)
    if cuda:
        out.traces = {lm_layers(config): Trace(events, resets, tracker.round_to, packed, delta, w.batch_size, out)}
    return out


def _marking_resets(tracker) -> list[int]:
    """The event index at each ``reset_peak`` of ``tracker`` from now on: where each phase starts."""
    marks: list[int] = []
    reset = tracker.reset_peak

    def reset_and_mark() -> None:
        marks.append(len(tracker.events) if tracker.events is not None else 0)
        reset()

    tracker.reset_peak = reset_and_mark
    return marks


@dataclass
class Trace:
    """One simulated batch as the tracker recorded it (every decode step written in): its storages' births
    and deaths, where each phase starts (a reset_peak, in InferSim.phases' order), the quantized weights'
    events (track_weights) and the bytes bitsandbytes saves on them, the batch size and its simulation."""

    events: list
    resets: list[int]
    round_to: int
    packed: dict[int, tuple[int, int]]
    delta: int
    batch: int
    sim: InferSim


def phase_peaks(events: list, resets: list[int], round_to: int) -> list[int]:
    """Each phase's peak live bytes from a trace's events, as the tracker counts them (sizes rounded up to
    ``round_to``; a phase's peak starts at what is live where it starts)."""
    size: dict = {}
    live, peaks, k = 0, [], 0
    for i, ev in enumerate(events):
        while k < len(resets) and resets[k] == i:
            peaks.append(live)
            k += 1
        if ev[0] == "alloc":
            size[ev[1]] = -(-ev[2] // round_to) * round_to
            live += size[ev[1]]
            if peaks:
                peaks[-1] = max(peaks[-1], live)
        else:
            live -= size.pop(ev[1], 0)
    return peaks + [live] * (len(resets) - len(peaks))


def written_at(t1: Trace, t2: Trace, b: int) -> Optional[InferSim]:
    """The simulation of batch ``b`` written from the traces of two other batch sizes at one depth.

    The same operators run at every batch size: the same storages are born and die in the same order, and
    each one's size is affine in the batch (a batch dimension, or none: weights, RoPE tables), so where two
    traces agree event for event and every size grows by whole bytes per row, batch ``b``'s events are
    theirs with the sizes moved along that line, and its phase peaks and caching-allocator replay follow
    (tests: equal to a simulation of that batch on the tiny presets; Open-LLaMA-7B and BLIP-2 OPT-2.7B
    scale so from batch 1 up). None where the traces do not scale so."""
    rows = t2.batch - t1.batch
    if len(t1.events) != len(t2.events) or t1.resets != t2.resets or rows == 0:
        return None
    events = []
    for e1, e2 in zip(t1.events, t2.events):
        if e1[:2] != e2[:2]:
            return None
        if e1[0] == "alloc":
            per_row, rest = divmod(e2[2] - e1[2], rows)
            if rest:
                return None
            e1 = ("alloc", e1[1], e1[2] + per_row * (b - t1.batch))
        events.append(e1)
    kv, rest = divmod((t2.sim.cache - t1.sim.cache) * (b - t1.batch), rows)
    if rest:
        return None
    peaks = phase_peaks(events, t1.resets, t1.round_to)
    phases = {k: v + t1.delta for k, v in zip(t1.sim.phases, peaks)}
    s = t1.sim
    replayed = replay_batch(loaded_as(events, t1.packed))
    return InferSim(
        phases, s.weights, s.cache + kv, s.numel, s.lm_matmul_numel, s.vision_matmul_numel, s.largest_linear, *replayed
    )


FAKE_MODELS: dict[tuple, tuple] = {}  # (config JSON, family, dtype, attention, chat VLM) -> (its fake mode, the model)

FAKE_MODELS_KEPT = 4  # a plan's simulations use two depths, or four (simulate_full_depth)


def _keep_model(key: Optional[tuple], mode, model, held: list) -> None:
    """Keep a fake model for the next simulation of the same config (a largest-batch search simulates the
    same few depths at every batch size; building BLIP-2's vision tower and Q-Former on fake tensors took
    a third of each simulation). A run leaves nothing on the model that the next one reads before it
    writes it (Qwen2-VL's M-RoPE offsets are recomputed on an empty cache; tests: the same simulation as
    on a fresh model); not where the run changed its parameters or buffers (RoPE that grows its
    frequencies past the trained length re-registers them): the next run must start from a fresh model."""
    if key is None:
        return
    if [id(t) for t in list(model.parameters()) + list(model.buffers())] != [id(t) for t in held]:
        FAKE_MODELS.pop(key, None)
        return
    FAKE_MODELS.pop(key, None)
    FAKE_MODELS[key] = (mode, model)
    while len(FAKE_MODELS) > FAKE_MODELS_KEPT:
        FAKE_MODELS.pop(next(iter(FAKE_MODELS)))


def track_weights(tracker, held: list, quantized: list, w: Workload) -> dict[int, tuple[int, int]]:
    """Register the weights with ``tracker`` one by one, in the order loading moves them to the device
    (born before anything else, as on a GPU); returns, for each of the ``quantized`` linear weights, its
    event's index and the bytes bitsandbytes keeps for it instead: (packed data, quantization constants)."""
    from bigtune.plan.step.quantized import packed_weight_bytes

    ids = {id(q) for q in quantized}
    out: dict[int, tuple[int, int]] = {}
    for t in held:
        at = len(tracker.events) if tracker.events is not None else 0
        tracker.track([t])
        if id(t) in ids and tracker.events is not None and len(tracker.events) > at:
            data = t.numel() if w.quantize == "int8" else t.numel() // 2
            out[at] = (data, packed_weight_bytes(t, w.quantize, w.double_quant) - data)
    return out


def loaded_as(events: list, packed: dict[int, tuple[int, int]]) -> list:
    """``events`` with each quantized weight's birth (index in ``packed``) replaced by the births of its
    packed data and of its constants (one block, never freed), as the device holds them once loaded."""
    out = []
    for i, ev in enumerate(events):
        if i not in packed:
            out.append(ev)
            continue
        data, constants = packed[i]
        out += [("alloc", ev[1], data), ("alloc", ("constants", ev[1]), constants)]
    return out


def replay_batch(events: list) -> tuple[int, int]:
    """(peak reserved, least capacity) of PyTorch's CUDA caching allocator, default settings, over one
    batch's storage events (``bigtune generate`` and ``caption`` set no PYTORCH_CUDA_ALLOC_CONF;
    train.cuda_alloc_conf is for training)."""
    from bigtune.plan.device.allocator import least_capacity, replay

    return replay(events).stats.peak_reserved, least_capacity(events)


def simulate_full_depth(
    config,
    family: str,
    w: Workload,
    cuda: bool,
    attn_implementation: str = "sdpa",
    arch: Optional[tuple[int, int]] = None,
) -> InferSim:
    """Simulate shallow language models and extrapolate every byte count linearly to the real depth.

    Values at depths 2 and 3 give the per-layer increment: from the second layer on, layers are
    identical (T5's first decoder layer holds the relative position bias) and each phase peaks at the
    same point of the last layer (a 1-layer Llama peaks elsewhere in prefill: its increment from 1 to 2
    layers is 17 % larger than every later one). Vision tower and Q-Former run at full depth (once).

    On a CUDA target the caching allocator's replay is extrapolated the same way (replayed_at_depth). It is
    not linear in depth: where the two extrapolations behind it lie more than the planner's typical error
    apart (FIT_UNCERTAINTY), a reuse jump between the two depths dominates (the cache's growth by
    concatenation leaves cached blocks the next step cannot reuse), and the pair is simulated again 4 and
    8 layers deep (simulate.RESERVED_DEPTHS), as the training planner's own replay: PaliGemma 2-3B
    captioning at batch 174 replays 51 % above a full-depth replay's reserved from 2 and 3 layers, 2.4 %
    below from 4 and 8 (Open-LLaMA-7B, 512 + 64 tokens at batch 8 and 24: 4.0 and 8.8 % below from 2 and
    3 layers, 2.2 % and 4.7 % from 4 and 8; all on fake tensors). Allocated bytes are the same from either.
    """
    from bigtune.plan.step.simulate import RESERVED_DEPTHS

    n = lm_layers(config)
    traces: dict[int, Trace] = {}
    for d, e in ((2, 3), RESERVED_DEPTHS):
        if n <= e:
            out = simulate(config, family, w, cuda, attn_implementation, arch)
            out.traces = {**traces, **out.traces}
            return out
        a = simulate(_with_depth(config, d), family, w, cuda, attn_implementation, arch)
        b = simulate(_with_depth(config, e), family, w, cuda, attn_implementation, arch)
        traces.update({**a.traces, **b.traces})
        full, spread = over_depth(a.scalars(), b.scalars(), d, e, n)
        if spread <= FIT_UNCERTAINTY:
            break
    out = InferSim.from_scalars(full)
    out.replayed_at = (d, e) if out.reserved else ()
    out.traces = traces
    return out


def over_depth(a: dict, b: dict, d: int, e: int, n: int) -> tuple[dict, float]:
    """(InferSim.scalars at depth ``n``, how far apart the replay's extrapolations are: 0 without one) from
    the scalars of simulations ``d`` and ``e`` layers deep (simulate_full_depth)."""
    full = {k: int(a[k] + (b[k] - a[k]) * (n - d) / (e - d)) for k in a}
    full["largest_linear"] = max(a["largest_linear"], b["largest_linear"])
    if not a["reserved"]:
        return full, 0.0
    full["reserved"], full["needed"], spread = replayed_at_depth(a, b, full)
    return full, spread


def written_need(t1: dict[int, Trace], t2: dict[int, Trace], b: int, n: int) -> Optional[int]:
    """What must fit at batch ``b`` on a GPU, written from the traces (depth -> Trace) of two other batch sizes
    and carried to depth ``n`` as simulate_full_depth carries simulations, as far as their depths allow (a
    pair both lack stops it there); None where the traces do not scale with the batch (written_at)."""
    from bigtune.plan.step.simulate import RESERVED_DEPTHS

    def at(d: int) -> Optional[InferSim]:
        return written_at(t1[d], t2[d], b) if d in t1 and d in t2 else None

    full = None
    for d, e in ((2, 3), RESERVED_DEPTHS):
        if n <= e:
            direct = at(n)
            full = direct.scalars() if direct is not None else full
            break
        a, c = at(d), at(e)
        if a is None or c is None:
            break
        full, spread = over_depth(a.scalars(), c.scalars(), d, e, n)
        if spread <= FIT_UNCERTAINTY:
            break
    return None if full is None else _totals(InferSim.from_scalars(full), True)[4]


def replayed_at_depth(a: dict, b: dict, full: dict) -> tuple[int, int, float]:
    """(peak reserved, least capacity, how far apart the extrapolations behind them are) at full depth from the replays of two shallow simulations (``a``,
    ``b``: InferSim.scalars at two depths; ``full``: the allocated bytes already extrapolated).

    Which cached block serves each request depends on the whole sequence, so these are not linear in depth
    the way allocated bytes are: the training planner's rule (simulate.replayed_over_depth, never below
    the full-depth peak allocated), then rounded up to whole 2 MiB, as every segment is. The least
    capacity is never above the reserved peak (the unbounded replay itself survives on that much)."""
    from bigtune.plan.device.allocator import ROUND_LARGE
    from bigtune.plan.step.simulate import replayed_over_depth

    def peak(x: dict) -> int:
        return max(v for k, v in x.items() if k.startswith("phase:"))

    def whole(n: int) -> int:
        return -(-n // ROUND_LARGE) * ROUND_LARGE

    (reserved, spread), (needed, spread_needed) = (
        replayed_over_depth((a[k], peak(a)), (b[k], peak(b)), peak(full)) for k in ("reserved", "needed")
    )
    return whole(reserved), min(whole(needed), whole(reserved)), max(spread, spread_needed)


@dataclass
class InferencePlan:
    recipe_name: str
    model: str
    target: str
    task: str
    batch_size: int
    prompt_tokens: int  # text prompt tokens as given
    lm_prompt_tokens: int  # what the language model's cache starts from (caption: + image tokens, BOS)
    new_tokens: int
    dtype: str
    quantize: str
    parameters_total: int
    weights: int  # bytes on the device
    kv_cache: int  # bytes at its fullest (analytic; equals the simulated cache)
    activations: int  # peak − weights − the cache held at the peak's phase
    peak_phase: str
    phases: dict[str, int]
    peak_allocated: int
    peak_reserved: Optional[int]
    overhead: int
    peak_total: int  # reserved + context on a GPU; the peak on a CPU
    needed_total: int  # what must fit: on a GPU the replay's least capacity (+ dequant temporary) + context
    capacity: Optional[int]
    fits: Optional[bool]
    max_batch_size: Optional[int] = None  # BATCH_SEARCH_LIMIT: that many or more
    prefill_s: Optional[float] = None
    decode_step_s: Optional[float] = None
    batch_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    host_ram_bytes: int = 0
    host_cpus: int = 1
    notes: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0
    image_tokens: int = 0  # caption, chat vision-language models: language-model tokens per image

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _phase_cache(phase: str, config, w: Workload) -> int:
    """KV cache alive at a phase's peak: decode's peak comes on the last step, with the full cache."""
    if phase == "decode":
        return kv_cache_bytes(config, w)
    if phase == "prefill" and w.task != "predict":
        return kv_cache_bytes(config, dataclasses.replace(w, new_tokens=1))
    return 0


def _totals(sim: InferSim, cuda: bool) -> tuple[int, Optional[int], int, int, int]:
    """(peak allocated, peak reserved or None, CUDA context, reserved + context, what must fit) of ``sim``.

    On a GPU bitsandbytes dequantizes one weight to the compute dtype per matmul (assumed 2 bytes): a real
    allocation at the peak, added to allocated and, as the segment of its own the allocator would reserve
    for it (allocator.segment_size), to reserved and to what must fit. What must fit is the replay's least
    capacity plus those and the context; on a CPU, the peak."""
    peak = max(sim.phases.values())
    if not cuda:
        return peak, None, 0, peak, peak
    temporary = sim.largest_linear * 2
    if temporary:
        from bigtune.plan.device.allocator import round_size, segment_size

        peak += temporary
        temporary = segment_size(round_size(temporary))
    reserved = sim.reserved + temporary
    return (
        peak,
        reserved,
        CUDA_CONTEXT_BYTES,
        reserved + CUDA_CONTEXT_BYTES,
        sim.needed + temporary + CUDA_CONTEXT_BYTES,
    )


def _time(
    sim: InferSim, config, w: Workload, target: Target
) -> tuple[Optional[float], Optional[float], Optional[float], Optional[float], list[str]]:
    """Roofline estimates: (prefill s, last decode step s, whole batch s, generated tokens/s)."""
    from bigtune.core.gpus import peak_flops

    if target.gpu is None:
        return None, None, None, None, []
    precision = {torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}[w.dtype]
    flops = peak_flops(target.gpu, precision)
    bw = target.gpu.mem_bandwidth_gbs
    if not flops or not bw:
        return None, None, None, None, [f"{target.gpu.key}: no {precision} rate or bandwidth in the catalog"]
    t = _text_config(config)
    b, p = w.batch_size, lm_prompt_length(config, w)
    layers = lm_layers(config)
    hidden = int(getattr(t, "hidden_size", None) or getattr(t, "d_model"))
    # Forward FLOPs: 2 per weight per token in every matmul, + 4·layers·hidden per token per attended
    # position (QK^T and AV); the vision tower and Q-Former once per image (their tokens: patches).
    prompt_flops = b * p * (2 * sim.lm_matmul_numel + 4 * layers * hidden * p / 2)
    if w.task == "caption":
        vc = config.vision_config
        patches = w.images.vision_patches if w.images else (int(vc.image_size) // int(vc.patch_size)) ** 2 + 1
        prompt_flops += b * patches * 2 * sim.vision_matmul_numel
    prefill = prompt_flops / (flops * ASSUMED_PREFILL_MFU)
    notes = [
        f"time: estimates. prefill compute bound at {ASSUMED_PREFILL_MFU:.0%} of the dense {precision} peak; "
        f"decode bandwidth bound: each step reads all weights and the cache once at "
        f"{ASSUMED_DECODE_BW_EFFICIENCY:.0%} of {bw:.0f} GB/s (assumed, uncalibrated)"
    ]
    if w.task == "predict":
        return prefill, None, prefill, b * w.prompt_tokens / prefill, notes
    full_kv = kv_cache_bytes(config, w)
    first_kv = kv_cache_bytes(config, dataclasses.replace(w, new_tokens=1))
    steps = w.new_tokens - 1

    def step_s(kv: float) -> float:
        mem = (sim.weights + kv) / (bw * 1e9 * ASSUMED_DECODE_BW_EFFICIENCY)
        comp = b * 2 * sim.lm_matmul_numel / (flops * ASSUMED_PREFILL_MFU)
        return max(mem, comp)  # a large enough batch makes decode compute bound

    last = step_s(full_kv)
    decode = steps * step_s((first_kv + full_kv) / 2)  # the cache grows linearly: the mean step
    total = prefill + decode
    return prefill, last, total, b * w.new_tokens / total, notes


def host_resources(
    config, w: Workload, sim: InferSim, target: Target, images_per_s: Optional[float]
) -> tuple[int, int, list[str]]:
    """(host RAM bytes, CPU cores) to request for serving this plan, with the rules as notes.

    RAM: bigtune loads weights on the CPU and then moves them to the device (infer.py, caption.py),
    so host RAM holds the whole model once in the load dtype, + 25 % (safetensors page cache,
    allocator slack), + 2 GiB (interpreter, torch, tokenizer, data); on a CPU target the plan's peak
    replaces the weights. Cores: one for the main process, plus for caption the image decoding
    (assumed 50 images/s per core, 224 px JPEG decode + resize), at the predicted images/s.
    """
    if target.gpu is None:
        ram = int(max(sim.phases.values()) * LOAD_HEADROOM) + HOST_BASE_BYTES
    else:
        ram = int(sim.weights * LOAD_HEADROOM) + HOST_BASE_BYTES
    ram = int(math.ceil(ram / GIB)) * GIB
    cpus = 2
    if w.task == "caption" and images_per_s:
        cpus = 1 + max(1, math.ceil(images_per_s / IMAGES_PER_CORE_S))
    cpus = min(cpus, 32)
    notes = [
        f"host: RAM = weights in the load dtype × {LOAD_HEADROOM} + {HOST_BASE_BYTES // GIB} GiB (loaded on "
        f"the CPU, then moved), rounded up to GiB; cores = 1 + data loading"
        + (f" (assumed {IMAGES_PER_CORE_S:.0f} images/s per core)" if w.task == "caption" else " (tokenizing: 1)")
    ]
    return ram, cpus, notes


def caption_workload(recipe: Recipe, config, w: Workload) -> Workload:
    """``w`` with a chat vision-language model's images laid out as ``bigtune caption`` lays them out
    (chatvlm.caption_images; its prompt is data.prompt in the chat template); BLIP-2's unchanged."""
    from bigtune.data.vlm import is_vlm
    from bigtune.plan.step.chatvlm import caption_images, check_image_budget

    check_image_budget(recipe, config)
    if not is_vlm(config):
        if w.image_size:
            raise PlanError(
                f"--image-size is for Qwen2-VL / Qwen2.5-VL, SmolVLM and LLaVA-NeXT models; {recipe.model.name} is "
                "BLIP-2"
            )
        return w
    images = caption_images(recipe, config, w.image_size)
    text = len(images.prompt_ids) - 1
    if w.prompt_tokens:
        raise PlanError(
            f"--prompt-tokens: {recipe.model.name} is asked data.prompt in its chat template ({text} text tokens); "
            "leave --prompt-tokens out and set data.prompt"
        )
    return dataclasses.replace(w, images=images, prompt_tokens=text)


def plan_inference(
    recipe: Recipe,
    target: Target,
    w: Workload,
    config=None,
    search_batch: bool = True,
    attn_implementation: Optional[str] = None,
) -> InferencePlan:
    """Predict one inference workload of the recipe's model on one target device.

    Long because it assembles one plan from its parts (simulation, cache, time, host) in the order a
    reader checks them; each part is a call to its own function.
    """
    t0 = time.perf_counter()
    if w.task not in TASKS:
        raise PlanError(f"--for {w.task!r}: use one of train, {', '.join(TASKS)}")
    family = recipe.model.family
    if w.task == "caption" and family != "image-to-text":
        raise PlanError(
            f"--for caption needs an image-to-text model (model.family: image-to-text); "
            f"{recipe.model.name} is {family}. Use --for generate"
        )
    notes: list[str] = []
    if w.task == "generate" and family == "image-to-text":
        w = dataclasses.replace(w, task="caption")  # an image-to-text model generates from an image: captioning
        notes.append("an image-to-text model generates from images: planned as --for caption")
    if w.task != "predict" and family == "sequence-classification":
        raise PlanError(f"{recipe.model.name} is a classifier: plan it with --for predict")
    if w.batch_size < 1 or w.prompt_tokens < 0 or (w.task != "caption" and w.prompt_tokens < 1):
        raise PlanError("--batch-size must be >= 1 and --prompt-tokens >= 1 (>= 0 for caption)")
    if w.task != "predict" and w.new_tokens < 1:
        raise PlanError("--max-new-tokens must be >= 1")
    if target.gpus > 1:
        raise PlanError("inference plans are for one device (--gpus 1): bigtune generates on one GPU")
    config = config if config is not None else resolve_config_name(recipe.model)
    if w.task == "caption":
        w = caption_workload(recipe, config, w)
        notes += [w.images.note] if w.images is not None else []
    attn = attn_implementation
    if attn is None:  # as training and caption build the model: eager where sdpa has no path (Gemma-2)
        from bigtune.models.build import attention_for

        attn, why = attention_for(recipe.model, config)
        notes += [why] if why else []
    cuda = target.device == "cuda"
    sim = simulate_full_depth(config, family, w, cuda, attn, target_arch(target))
    peak, reserved, overhead, total, need = _totals(sim, cuda)
    phase = max(sim.phases, key=sim.phases.get)
    kv = kv_cache_bytes(config, w)
    acts = peak - sim.weights - _phase_cache(phase, config, w)
    cap = target.capacity_bytes
    fits = None if cap is None else need <= cap  # what must fit against the whole card, as for training
    if cuda:
        notes.append(
            "reserved: PyTorch's caching allocator (default settings) replayed over the simulated batch"
            + (
                f", {sim.replayed_at[0]} and {sim.replayed_at[1]} layers deep, extrapolated to full depth"
                if sim.replayed_at
                else ""
            )
            + f"; FITS by the least memory that replay runs in + the CUDA context {CUDA_CONTEXT_BYTES / 2**20:.0f} "
            "MiB (measured in training steps on an H200)"
        )
    if w.quantize != "none":
        notes.append(
            f"{w.quantize}: linear weights (not the output head, not _keep_in_fp32_modules) at "
            "bitsandbytes sizes; + one dequantized weight as a temporary on a GPU (a segment of its own)"
        )
    max_b = largest_batch(config, family, w, target, attn, sim) if (search_batch and cap is not None) else None
    prefill, last, batch_s, tps, tnotes = _time(sim, config, w, target)
    images_s = w.batch_size / batch_s if (batch_s and w.task == "caption") else None
    ram, cpus, hnotes = host_resources(config, w, sim, target, images_s)
    return InferencePlan(
        recipe_name=recipe.name,
        model=recipe.model.name,
        target=target.label(),
        task=w.task,
        batch_size=w.batch_size,
        prompt_tokens=w.prompt_tokens,
        lm_prompt_tokens=lm_prompt_length(config, w),
        new_tokens=w.new_tokens,
        dtype=str(w.dtype).replace("torch.", ""),
        quantize=w.quantize,
        parameters_total=sim.numel,
        weights=sim.weights,
        kv_cache=kv,
        activations=acts,
        peak_phase=phase,
        phases=sim.phases,
        peak_allocated=peak,
        peak_reserved=reserved,
        overhead=overhead,
        peak_total=total,
        needed_total=need,
        capacity=cap,
        fits=fits,
        max_batch_size=max_b,
        prefill_s=prefill,
        decode_step_s=last,
        batch_s=batch_s,
        tokens_per_s=tps,
        host_ram_bytes=ram,
        host_cpus=cpus,
        notes=notes + tnotes + hnotes,
        plan_seconds=time.perf_counter() - t0,
        image_tokens=w.images.image_tokens if w.images is not None else 0,
    )


# The largest batch the search tries. Serving engines run far fewer sequences at once (vLLM's max_num_seqs is
# 256 to 1024), and a chat vision-language model's batch is simulated with real integer inputs (its image
# token positions are computed from their values): at 65,536 rows a tiny Qwen2-VL's search held 22 GB of host RAM.
BATCH_SEARCH_LIMIT = 4096


def largest_batch(
    config, family: str, w: Workload, target: Target, attn: str, sim_at_w: InferSim, limit: int = BATCH_SEARCH_LIMIT
) -> int:
    """The largest batch size whose planned need fits the target (0: not even one).

    Each phase's allocated peak is affine in the batch size (weights are fixed; cache, activations and
    inputs grow with it), and what must fit (the caching allocator's least capacity + context) is never
    below the allocated bytes, so two simulations (batch 1 and the plan's) bound the answer from above.
    Those two also give every other batch size's trace where it scales with the batch (written_at: the
    storages' sizes affine in it), and so what must fit there, at the cost of replays: the search first
    runs on those written needs, and the edge it finds there is the first batch simulated. Where the
    written needs carry the same depths as the rule (simulate_full_depth) they are the simulated ones, and
    the edge is proven by simulating it and the batch after it (BLIP-2 OPT-2.7B on an A10G: 146 fits, 147
    does not, four simulations where the search on simulations alone took eight batch sizes); where the
    rule goes deeper at that batch (Open-LLaMA-7B: 4 and 8 layers from batch 9 on, written from 2 and 3)
    they are only near, and the search goes on from the simulations (see edge_search).
    """
    cuda = target.device == "cuda"
    cap = target.capacity_bytes
    sims = {w.batch_size: sim_at_w}

    def simulated(b: int) -> int:
        if b not in sims:
            wb = dataclasses.replace(w, batch_size=b)
            sims[b] = simulate_full_depth(config, family, wb, cuda, attn, target_arch(target))
        return _totals(sims[b], cuda)[4]

    need = Needs(simulated)
    b1, b2 = 1, max(2, w.batch_size)
    if need(b1) > cap:
        return 0
    lo, hi = (b2, None) if need(b2) <= cap else (b1, b2)  # the largest known to fit, the smallest known not to
    s1, s2 = sims[b1], sims[b2]
    # allocated(b) = max over phases of affine lines, + the dequantized temporary: the upper bound
    budget = cap - (CUDA_CONTEXT_BYTES if cuda else 0) - (s1.largest_linear * 2 if cuda else 0)
    bound = limit
    for ph in s1.phases:
        slope = (s2.phases[ph] - s1.phases[ph]) / (b2 - b1)
        if slope > 0:
            bound = min(bound, int(1 + (budget - s1.phases[ph]) / slope))
    first = None
    n = lm_layers(config) if s1.traces and s2.traces else 0  # traces: a GPU target's simulations
    if n and written_need(s1.traces, s2.traces, b2, n) is not None:  # they scale with the batch
        written = Needs(lambda b: written_need(s1.traces, s2.traces, b, n))
        written.update({b1: need(b1), b2: need(b2)})
        first = edge_search(written, cap, lo, hi, bound)
    return edge_search(need, cap, lo, hi, bound, first)


class Needs(dict):
    """What must fit, by batch size: ``fn(b)`` the first time ``self(b)`` is asked, then kept."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __call__(self, b: int) -> int:
        if b not in self:
            self[b] = self.fn(b)
        return self[b]


def edge_search(need: Needs, cap: int, lo: int, hi: Optional[int], bound: int, first: Optional[int] = None) -> int:
    """The largest batch that fits next to one that does not (or ``bound``), from ``lo`` known to fit and
    ``hi`` known not to (None: none yet); ``first``: the first candidate.

    What must fit is near affine in the batch, up to segment rounding (tens of MiB: up to a batch row of
    BLIP-2 OPT-2.7B, 52 MiB; a tenth of Open-LLaMA-7B's): each next candidate is where the line through the
    two known needs nearest the card reaches it. Near the edge those two lie on either side of it, a row
    or two apart, so once the line has put a candidate next to the edge the next one lands across it: the
    edge is usually proven with one candidate per side (BLIP-2 on simulations alone: 181, 149, then 146
    fits and 147 does not, where a line through far-apart needs alternating with halving took seven
    candidates). The need grows in whole segments, so a line can stall on a step: where the batch after
    the largest that fits fits too twice in a row, the next candidate is twice it; where a candidate moved an
    end of the interval by one only, or left it more than half as wide as two candidates before, the next
    one halves it.
    """
    widths: list[int] = []  # the interval's width before each candidate inside it
    stalls = 0  # candidates in a row that the line put right after the largest fitting, and that fit
    crept = False  # the last candidate moved an end of the interval by one
    for _ in range(100):
        if hi is not None and hi - lo <= 1:
            return lo
        cand, first = (first, None) if first is not None else (_edge_on_line(need, cap), None)
        if hi is None:
            if cand is None or (stalls > 1 and cand <= lo):  # grow geometrically until one does not fit
                cand = 2 * lo
            cand = min(max(cand, lo + 1), bound)
            if cand <= lo:  # lo is the bound
                return lo
        else:
            if cand is None or (hi - lo > 3 and (crept or (len(widths) > 1 and 2 * (hi - lo) > widths[-2]))):
                cand = (lo + hi) // 2
            widths.append(hi - lo)
            cand = min(max(cand, lo + 1), hi - 1)
        fits = need(cand) <= cap
        stalls = stalls + 1 if fits and cand == lo + 1 else 0  # twice: the line is stalling on a step
        crept = hi is not None and cand == (lo + 1 if fits else hi - 1)
        lo, hi = (cand, hi) if fits else (lo, cand)
    return lo


def _edge_on_line(needs: dict[int, int], cap: int) -> Optional[int]:
    """The largest batch at or under ``cap`` on the line through the two simulated needs nearest it (None
    where that line does not rise)."""
    b, c = sorted(sorted(needs, key=lambda x: abs(needs[x] - cap))[:2])
    if needs[c] <= needs[b]:
        return None
    return b + (cap - needs[b]) * (c - b) // (needs[c] - needs[b])


def _size(n: Optional[float]) -> str:
    from bigtune.core.stepmath import human_bytes

    return human_bytes(n)


def format_inference_plan(p: InferencePlan) -> str:
    count = f"{p.parameters_total / 1e9:.2f} B" if p.parameters_total >= 1e8 else f"{p.parameters_total / 1e6:.2f} M"
    quant = f", {p.quantize} linear weights" if p.quantize != "none" else ""
    shape = f"batch {p.batch_size} × {p.lm_prompt_tokens} prompt tokens"
    if p.task == "caption":
        shape = (
            f"batch {p.batch_size} images × {p.lm_prompt_tokens} LM prompt tokens "
            f"(image tokens + BOS + {p.prompt_tokens} text)"
        )
        if p.image_tokens:  # a chat vision-language model: its prompt (data.prompt) around the image's tokens
            shape = (
                f"batch {p.batch_size} images × {p.lm_prompt_tokens} LM prompt tokens ({p.image_tokens} image "
                f"tokens + {p.prompt_tokens} prompt)"
            )
    if p.task != "predict":
        shape += f" + {p.new_tokens} new tokens"
    lines = [
        f"plan --for {p.task}: {p.model} ({count} parameters, {p.dtype}{quant}) on {p.target}",
        f"  {shape}",
        f"  {'weights':<22}{_size(p.weights):>12}",
        f"  {'KV cache (full)':<22}{_size(p.kv_cache):>12}",
        f"  {'activations/temps':<22}{_size(p.activations):>12}   at the {p.peak_phase} peak",
        f"  {'peak allocated':<22}{_size(p.peak_allocated):>12}   per phase: "
        + ", ".join(f"{k} {_size(v)}" for k, v in p.phases.items()),
    ]
    if p.peak_reserved is not None:
        lines.append(
            f"  {'reserved + context':<22}{_size(p.peak_total):>12}   ({_size(p.peak_reserved)} + {_size(p.overhead)})"
        )
    if p.capacity is not None:
        verdict = "FITS" if p.fits else "OOM"
        lines.append(
            f"{verdict}: needs {p.needed_total / GIB:.2f} of {p.capacity / GIB:.2f} GiB "
            f"({100 * p.needed_total / p.capacity:.0f}%)"
        )
    if p.max_batch_size is not None:
        lines.append(
            "largest batch that fits: none (the weights alone do not fit)"
            if not p.max_batch_size
            else f"largest batch that fits: {p.max_batch_size} or more (the search stops there)"
            if p.max_batch_size >= BATCH_SEARCH_LIMIT
            else f"largest batch that fits: {p.max_batch_size}"
        )
    if p.batch_s:
        what = "images" if p.task == "caption" else ("samples" if p.task == "predict" else "prompts")
        if p.task == "predict":
            lines.append(f"≈ {p.batch_s * 1e3:.1f} ms per batch, ≈ {p.tokens_per_s:,.0f} tokens/s (estimate)")
        else:
            lines.append(
                f"≈ {p.tokens_per_s:,.0f} generated tokens/s (estimate): prefill {p.prefill_s * 1e3:.1f} ms, "
                f"last decode step {p.decode_step_s * 1e3:.2f} ms, {p.batch_s:.2f} s per batch of "
                f"{p.batch_size} {what}"
            )
    lines.append(
        f"host: request {p.host_ram_bytes // GIB} GiB RAM and {p.host_cpus} CPU cores "
        f"(Slurm: --mem={p.host_ram_bytes // GIB}G --cpus-per-task={p.host_cpus})"
    )
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def weight_bytes(config, family: str, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters and buffers in ``dtype`` (fake 2- and 3-layer models, extrapolated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.initialization import TORCH_INIT_FUNCTIONS

    from bigtune.core.stepmath import storage_bytes

    n = lm_layers(config)
    depths = (2, 3) if n > 3 else (n,)
    sizes = []
    for d in depths:
        with FakeTensorMode(), mock.patch.dict(TORCH_INIT_FUNCTIONS, {"trunc_normal_": lambda tensor, **_: tensor}):
            model = build_inference_model(_with_depth(config, d), family, dtype)
            sizes.append(storage_bytes(list(model.parameters()) + list(model.buffers())))
    return sizes[0] if len(sizes) == 1 else sizes[0] + (sizes[1] - sizes[0]) * (n - 2)


def training_host_request(recipe: Recipe, tasks_per_node: int) -> tuple[int, int, str]:
    """(host RAM per node in bytes, CPU cores per task, the rule) for ``bigtune train`` under Slurm.

    Every task (one per GPU) loads the model on its CPU in the recipe's weights dtype before Fabric moves
    or shards it: RAM per node = tasks × (weights × 1.25 + 2 GiB), rounded up to GiB. Cores per task: the
    main process + data.num_workers DataLoader workers (at least 2).
    """
    from bigtune.models.build import weights_dtype

    config = resolve_config_name(recipe.model)
    wb = weight_bytes(config, recipe.model.family, weights_dtype(recipe.precision))
    per_task = int(wb * LOAD_HEADROOM) + HOST_BASE_BYTES
    mem = int(math.ceil(tasks_per_node * per_task / GIB)) * GIB
    cpus = max(2, 1 + recipe.data.num_workers)
    rule = (
        f"{tasks_per_node} task(s) x (weights {wb / GIB:.2f} GiB x {LOAD_HEADROOM} + {HOST_BASE_BYTES // GIB} GiB); "
        f"cpus = 1 + data.num_workers ({recipe.data.num_workers}), at least 2"
    )
    return mem, cpus, rule


def measure_cpu(
    config, family: str, w: Workload, attn_implementation: str = "sdpa", seed: int = 0, inputs: Optional[dict] = None
) -> dict[str, int]:
    """Run the workload for real on the CPU with transformers' own ``generate`` (BLIP-2: the model's
    ``generate``; predict: one forward) under the live tensor tracker: the peak to compare a plan with.
    ``inputs``: the batch to run (e.g. the one ``bigtune caption`` builds); default: make_inputs.

    Random weights: greedy decoding with no EOS, so every row produces ``new_tokens`` tokens, as planned.
    """
    from bigtune.core.stepmath import storage_bytes
    from bigtune.memory.tracker import LiveTensorTracker

    torch.manual_seed(seed)
    with torch.no_grad():
        model = build_inference_model(config, family, w.dtype, attn_implementation)
        inputs = make_inputs(config, w) if inputs is None else inputs
        tracker = LiveTensorTracker()
        held = list(model.parameters()) + list(model.buffers())
        tracker.track(held + list(inputs.values()))
        tracker.reset_peak()
        with tracker:
            if w.task == "predict":
                out = model(**inputs, use_cache=False, return_dict=True)
                del out
            else:
                pad = _text_config(config).pad_token_id
                model.generate(**inputs, generation_config=greedy_config(w.new_tokens, int(pad or 0)))
    return {"weights": storage_bytes(held), "peak": tracker.peak_bytes}


DEFAULTS = {  # the matching verbs' defaults: bigtune generate / caption (batch 8; 64 / 30 new tokens)
    "generate": {"batch_size": 8, "max_new_tokens": 64},
    "caption": {"batch_size": 8, "max_new_tokens": 30},
    "predict": {"batch_size": 8, "max_new_tokens": 0},
}


def workload_from_args(args, recipe: Recipe) -> Workload:
    """The workload ``bigtune plan --for TASK`` asks for; unset sizes take the verbs' defaults and, for the
    prompt length, the recipe's data.max_seq_length (caption: no text prompt)."""
    task = args.for_task
    if task == "generate" and recipe.model.family == "image-to-text":
        task = "caption"
    d = DEFAULTS[task]
    prompt = (
        args.prompt_tokens
        if args.prompt_tokens is not None
        else (0 if task == "caption" else recipe.data.max_seq_length)
    )
    return Workload(
        task=task,
        batch_size=args.batch_size or d["batch_size"],
        prompt_tokens=prompt,
        new_tokens=d["max_new_tokens"] if args.max_new_tokens is None else args.max_new_tokens,
        dtype=inference_dtype(recipe, args.dtype),
        quantize=recipe.model.quantize,
        double_quant=recipe.model.double_quant,
        image_size=_image_size_arg(args),
    )


def _image_size_arg(args) -> Optional[tuple[int, int]]:
    from bigtune.plan.step.chatvlm import parse_image_size

    if not getattr(args, "image_size", None):
        return None
    if args.for_task not in ("caption", "generate"):
        raise PlanError(f"--image-size plans images: it does not apply to --for {args.for_task}")
    try:
        return parse_image_size(args.image_size)
    except ValueError as e:
        raise PlanError(str(e)) from None


def main_plan_inference(args, recipe: Recipe, target: Target) -> int:
    import json

    w = workload_from_args(args, recipe)
    p = plan_inference(recipe, target, w)
    if args.json:
        print(json.dumps({"plan": p.to_dict()}, indent=2))
    else:
        print(format_inference_plan(p))
    return 0
