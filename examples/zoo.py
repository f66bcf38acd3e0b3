"""Model zoo: small random-weight versions of models users compile, for the zoo test tier.

Each builder returns `(module, inputs)`: a `torch.nn.Module` in eval mode whose weights come from a
fixed seed, and the tuple of example inputs to call it with the way users do (`module(*inputs)`).
Every module's forward takes positional tensors and returns plain tensors (HF models are wrapped to
return their logits / last hidden state), so `tvm_ext.from_torch(module, *inputs)` takes it as is.

Sizes are small (2 layers, hidden 256, 4 heads, vocab 1000) but keep the real models' structure:
grouped-query attention (4 query heads, 2 key/value heads) for LLaMA, Mistral and Qwen2, the odd
intermediate width 688 for LLaMA and Qwen2, padding masks, relative position buckets in T5.

Builders take `dtype` (a torch dtype or its name: "float32", "float16", "bfloat16"); the HF ones
also take `attn` ("sdpa" or "eager": transformers' attention implementations export differently).
`ZOO` maps a name to a builder: `module, inputs = ZOO["llama_mask"](dtype="float16", attn="eager")`.

Needs torch, transformers (>= 5) and torchvision; nothing is downloaded (models come from configs).
"""

from __future__ import annotations

import functools

import torch

SEED = 0
VOCAB = 1000
HIDDEN = 256
HEADS = 4
LAYERS = 2
ATTN = ("sdpa", "eager")
POSITIONS = 512  # longest sequence the text models take


def _dtype(dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class HFOutput(torch.nn.Module):
    """Calls a transformers model with named inputs (from positional ones, for torch.export) and
    returns its first output (logits or last_hidden_state) as a plain tensor."""

    def __init__(self, model, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs):
        out = self.model(**dict(zip(self.names, inputs, strict=True)), return_dict=False)
        return out[0]


def _ids(batch: int, seq: int, *, seed: int = SEED) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))


def _padding_mask(batch: int, seq: int) -> torch.Tensor:
    """int64 mask, 1 = real token: row 0 full, the others right-padded (a quarter of the row more
    padding each, at most half). Right padding keeps every causal query row with a visible key."""
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(1, batch):
        mask[row, seq - min(seq // 2, row * seq // 4):] = 0
    return mask


def _hf(model_cls, config, dtype, names, inputs):
    """Build `model_cls(config)` from a seed, in eval mode and `dtype`, wrapped by HFOutput."""
    torch.manual_seed(SEED)
    model = model_cls(config).eval().to(_dtype(dtype))
    return HFOutput(model, names).eval(), tuple(inputs)


def _decoder(model_cls, config, dtype, mask: bool, batch: int, seq: int):
    ids = _ids(batch, seq)
    if mask:
        return _hf(model_cls, config, dtype, ("input_ids", "attention_mask"), (ids, _padding_mask(batch, seq)))
    return _hf(model_cls, config, dtype, ("input_ids",), (ids,))


def _common(attn: str) -> dict:
    if attn not in ATTN:
        raise ValueError(f"attn must be one of {ATTN}, got {attn!r}")
    return {"vocab_size": VOCAB, "use_cache": False, "attn_implementation": attn}


def gpt2(dtype="float32", attn="sdpa", mask=False, batch=2, seq=32):
    """GPT2LMHeadModel -> logits [batch, seq, vocab]; learned positions, LayerNorm, gelu_new, Conv1D."""
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

    config = GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS, bos_token_id=VOCAB - 1,
                        eos_token_id=VOCAB - 1, **_common(attn))
    return _decoder(GPT2LMHeadModel, config, dtype, mask, batch, seq)


def llama(dtype="float32", attn="sdpa", mask=False, batch=2, seq=32):
    """LlamaForCausalLM -> logits; RMSNorm, RoPE, GQA (4 q / 2 kv heads), SwiGLU of width 688."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=688, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                         **_common(attn))
    return _decoder(LlamaForCausalLM, config, dtype, mask, batch, seq)


def mistral(dtype="float32", attn="sdpa", mask=False, batch=2, seq=32):
    """MistralForCausalLM -> logits; like LLaMA (GQA 4/2) with SwiGLU width 896 (3.5x, as Mistral-7B).
    The sliding window stays at the config's default (4096), far above `seq`."""
    from transformers import MistralConfig, MistralForCausalLM  # noqa: PLC0415

    config = MistralConfig(hidden_size=HIDDEN, intermediate_size=896, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                           **_common(attn))
    return _decoder(MistralForCausalLM, config, dtype, mask, batch, seq)


def qwen2(dtype="float32", attn="sdpa", mask=False, batch=2, seq=32):
    """Qwen2ForCausalLM -> logits; GQA 4/2, biased q/k/v projections, SwiGLU of width 688."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    config = Qwen2Config(hidden_size=HIDDEN, intermediate_size=688, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                         **_common(attn))
    return _decoder(Qwen2ForCausalLM, config, dtype, mask, batch, seq)


def bert(dtype="float32", attn="sdpa", batch=2, seq=32):
    """BertModel(input_ids, attention_mask) -> last_hidden_state [batch, seq, 256]; padded rows."""
    from transformers import BertConfig, BertModel  # noqa: PLC0415

    config = BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=4 * HIDDEN, max_position_embeddings=POSITIONS, **_common(attn))
    return _hf(lambda c: BertModel(c, add_pooling_layer=False), config, dtype, ("input_ids", "attention_mask"),
               (_ids(batch, seq), _padding_mask(batch, seq)))


def _t5_config(attn: str):
    from transformers import T5Config  # noqa: PLC0415

    # flan-t5 style: gated GELU feed-forward, untied head; d_kv * heads = d_model
    return T5Config(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=512, num_layers=LAYERS, num_decoder_layers=LAYERS,
                    num_heads=HEADS, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                    decoder_start_token_id=0, **_common(attn))


def t5(dtype="float32", attn="sdpa", batch=2, seq=32, decoder_seq=16):
    """T5ForConditionalGeneration(input_ids, attention_mask, decoder_input_ids) -> logits
    [batch, decoder_seq, vocab]: encoder, causal decoder with cross-attention (one teacher-forced step)."""
    from transformers import T5ForConditionalGeneration  # noqa: PLC0415

    return _hf(T5ForConditionalGeneration, _t5_config(attn), dtype,
               ("input_ids", "attention_mask", "decoder_input_ids"),
               (_ids(batch, seq), _padding_mask(batch, seq), _ids(batch, decoder_seq, seed=SEED + 7)))


def t5_encoder(dtype="float32", attn="sdpa", batch=2, seq=32):
    """T5EncoderModel(input_ids, attention_mask) -> last_hidden_state (T5 as a text encoder)."""
    from transformers import T5EncoderModel  # noqa: PLC0415

    return _hf(T5EncoderModel, _t5_config(attn), dtype, ("input_ids", "attention_mask"),
               (_ids(batch, seq), _padding_mask(batch, seq)))


def vit(dtype="float32", attn="sdpa", batch=2, image=32, patch=8):
    """ViTForImageClassification(pixel_values) -> logits [batch, 10]; 16 patches + CLS token."""
    from transformers import ViTConfig, ViTForImageClassification  # noqa: PLC0415

    config = ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       intermediate_size=4 * HIDDEN, image_size=image, patch_size=patch, num_labels=10,
                       attn_implementation=attn)
    pixels = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(SEED + 1))
    return _hf(ViTForImageClassification, config, dtype, ("pixel_values",), (pixels.to(_dtype(dtype)),))


def clip(dtype="float32", attn="sdpa", batch=2, image=32, patch=8):
    """CLIPVisionModel(pixel_values) -> last_hidden_state [batch, 17, 256]: the class token joined
    to the patches, then a LayerNorm before the first layer."""
    from transformers import CLIPVisionConfig, CLIPVisionModel  # noqa: PLC0415

    config = CLIPVisionConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, image_size=image, patch_size=patch, attn_implementation=attn)
    pixels = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(SEED + 1))
    return _hf(CLIPVisionModel, config, dtype, ("pixel_values",), (pixels.to(_dtype(dtype)),))


def swin(dtype="float32", batch=2, image=32):
    """SwinModel(pixel_values) -> last_hidden_state: windowed attention with a relative position
    bias, patch merging, and a LayerNorm of the transposed patch embedding."""
    from transformers import SwinConfig, SwinModel  # noqa: PLC0415

    config = SwinConfig(image_size=image, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4)
    pixels = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(SEED + 1))
    return _hf(SwinModel, config, dtype, ("pixel_values",), (pixels.to(_dtype(dtype)),))


def resnet18(dtype="float32", batch=2, image=64):
    """torchvision ResNet-18 (1000 classes) -> logits [batch, 1000] on an image batch. BatchNorm
    running statistics and affine parameters are randomized (fresh ones are the identity)."""
    import torchvision  # noqa: PLC0415

    torch.manual_seed(SEED)
    model = torchvision.models.resnet18(weights=None)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    model = model.eval().to(_dtype(dtype))
    pixels = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(SEED + 1))
    return model, (pixels.to(_dtype(dtype)),)


ZOO = {
    "gpt2": gpt2,
    "gpt2_mask": functools.partial(gpt2, mask=True),
    "llama": llama,
    "llama_mask": functools.partial(llama, mask=True),
    "mistral": mistral,
    "mistral_mask": functools.partial(mistral, mask=True),
    "qwen2": qwen2,
    "qwen2_mask": functools.partial(qwen2, mask=True),
    "bert": bert,
    "t5": t5,
    "t5_encoder": t5_encoder,
    "vit": vit,
    "clip": clip,
    "swin": swin,
    "resnet18": resnet18,
}
"""name -> builder(dtype=..., [attn=...]) -> (module, inputs). Every builder but swin's and resnet18's takes `attn`."""

HAS_ATTN = {name for name in ZOO if name not in ("swin", "resnet18")}
