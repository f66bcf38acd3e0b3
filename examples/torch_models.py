"""Real architectures written in PyTorch with random weights (no downloads): what issue-8 users bring.

A LLaMA-style decoder layer (RMSNorm, rotary embedding, causal attention, SwiGLU MLP) and its decoding
step with a KV cache (`make_decode`), a BERT-base
encoder layer (LayerNorm, softmax attention, GELU) and a ResNet basic block whose BatchNorm either
computes batch statistics over (N, H, W) as in training or is folded into the convolutions for
inference. `CONFIGS` names each model at the sizes we benchmark; `make(name)` returns the module and
example inputs. Needs PyTorch (an optional extra of this project).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """LLaMA's: statistics in float32, result rounded back, then the weight."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(hidden) + 0.5), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention(q, k, v, causal: bool):
    """Softmax attention spelled out (matmul, scale, mask, softmax in float32, matmul), as the
    Hugging Face eager implementations write it."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
        scores = scores + mask.to(scores.dtype)
    return torch.matmul(F.softmax(scores.float(), dim=-1).to(q.dtype), v)


class LlamaLayer(nn.Module):
    def __init__(self, hidden: int = 4096, heads: int = 32, intermediate: int = 11008):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.input_norm, self.post_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(hidden, intermediate, bias=False), nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        b, n, hidden = x.shape
        h = self.input_norm(x)
        q, k, v = (proj(h).view(b, n, self.heads, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        angles = torch.arange(n, device=x.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = attention(q, k, v, causal=True).transpose(1, 2).reshape(b, n, hidden)
        x = x + self.o(a)
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def repeat_kv(x, group: int):
    """[b, kv_heads, L, d] -> [b, kv_heads * group, L, d], each head repeated `group` times, as
    transformers writes it (no op for one query head per key/value head)."""
    if group == 1:
        return x
    b, kv_heads, length, dim = x.shape
    return x[:, :, None].expand(b, kv_heads, group, length, dim).reshape(b, kv_heads * group, length, dim)


class LlamaDecodeLayer(LlamaLayer):
    """One decoding step of the LLaMA layer with a KV cache, as Hugging Face's DynamicCache runs it:
    the new tokens x [b, n, hidden] (n = 1 when decoding) attend to the past keys and values
    [b, kv_heads, L, head_dim] and their own (causally); returns the output and the cache grown to
    L + n. `kv_heads` < heads is grouped-query attention (each key/value head serves heads / kv_heads
    query heads, repeated as transformers' repeat_kv does)."""

    def __init__(self, hidden: int = 4096, heads: int = 32, intermediate: int = 11008, kv_heads: int | None = None):
        super().__init__(hidden, heads, intermediate)
        self.kv_heads = kv_heads or heads
        self.k = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)

    def forward(self, x, past_k, past_v):
        b, n, hidden = x.shape
        start = past_k.shape[2]
        h = self.input_norm(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = (proj(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2) for proj in (self.k, self.v))
        angles = torch.arange(start, start + n, device=x.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        keys, values = repeat_kv(k, self.heads // self.kv_heads), repeat_kv(v, self.heads // self.kv_heads)
        scores = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if n > 1:  # a new token sees the cache and the new tokens up to itself
            mask = torch.triu(torch.full((n, start + n), float("-inf"), device=x.device), diagonal=start + 1)
            scores = scores + mask.to(scores.dtype)
        a = torch.matmul(F.softmax(scores.float(), dim=-1).to(q.dtype), values)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, hidden))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), k, v


class BertLayer(nn.Module):
    def __init__(self, hidden: int = 768, heads: int = 12, intermediate: int = 3072):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden, eps=1e-12), nn.LayerNorm(hidden, eps=1e-12)
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)

    def forward(self, x):
        b, n, hidden = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = attention(q, k, v, causal=False).transpose(1, 2).reshape(b, n, hidden)
        x = self.norm1(x + self.out(a))
        return self.norm2(x + self.fc2(F.gelu(self.fc1(x))))


class ResNetBlock(nn.Module):
    """conv-BN-ReLU-conv-BN + identity, ReLU. `train_stats`: BatchNorm normalises with the batch's
    own mean and variance over (N, H, W) (training mode); else with running statistics, which the
    frontend folds into a per-channel scale and shift (inference)."""

    def __init__(self, channels: int = 256, train_stats: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)
        self.train_stats = train_stats
        for bn in (self.bn1, self.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)

    def norm(self, bn, x):
        if self.train_stats:  # functional, so export sees the statistics and no buffer update
            return F.batch_norm(x, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
        return bn(x)

    def forward(self, x):
        h = F.relu(self.norm(self.bn1, self.conv1(x)))
        return F.relu(x + self.norm(self.bn2, self.conv2(h)))


# name -> (constructor, input shape, dtype)
CONFIGS = {
    "llama-seq1": (LlamaLayer, (1, 1, 4096), torch.float16),  # one decoding step's token (no KV cache)
    "llama-seq4": (LlamaLayer, (1, 4, 4096), torch.float16),  # a small batch's step
    "llama-seq16": (LlamaLayer, (1, 16, 4096), torch.float16),
    "llama-seq512": (LlamaLayer, (1, 512, 4096), torch.float16),
    "llama-seq512-bf16": (LlamaLayer, (1, 512, 4096), torch.bfloat16),  # as LLaMA, Mistral and Qwen checkpoints ship
    "llama-seq2048": (LlamaLayer, (1, 2048, 4096), torch.float16),
    "bert-seq128": (BertLayer, (8, 128, 768), torch.float16),
    "bert-seq512": (BertLayer, (8, 512, 768), torch.float16),
    "resnet-train-bn": (lambda: ResNetBlock(256, train_stats=True), (32, 256, 56, 56), torch.float32),
    "resnet-folded-bn": (lambda: ResNetBlock(256, train_stats=False), (32, 256, 56, 56), torch.float32),
    # small twins for CPU tests
    "llama-tiny": (lambda: LlamaLayer(256, 4, 512), (1, 32, 256), torch.float32),
    "bert-tiny": (lambda: BertLayer(128, 4, 256), (2, 16, 128), torch.float32),
    "resnet-tiny-train-bn": (lambda: ResNetBlock(8, train_stats=True), (4, 8, 8, 8), torch.float32),
    "resnet-tiny-folded-bn": (lambda: ResNetBlock(8, train_stats=False), (4, 8, 8, 8), torch.float32),
}


# decode layers: name -> (constructor, dtype); inputs from `make_decode`
DECODE_CONFIGS = {
    "llama-decode": (LlamaDecodeLayer, torch.float16),  # LLaMA-7B: 32 heads, each its own keys and values
    "llama-decode-gqa": (lambda: LlamaDecodeLayer(4096, 32, 14336, kv_heads=8), torch.float16),  # Mistral-7B's sizes
    "llama-decode-tiny": (lambda: LlamaDecodeLayer(256, 4, 512, kv_heads=2), torch.float32),  # for CPU tests
}
# from_torch's `dynamic` for a decode layer: any batch and cache length up to these bounds
DECODE_DYNAMIC = {0: {0: ("batch", 1, 64)}, 1: {0: ("batch", 1, 64), 2: ("past", 1, 8191)},
                  2: {0: ("batch", 1, 64), 2: ("past", 1, 8191)}}


def decode_inputs(module: LlamaDecodeLayer, batch: int, past: int, dtype, device="cpu"):
    """(x, past_k, past_v): one new token per sequence and a cache of `past` positions."""
    hidden = module.heads * module.head_dim
    x = torch.randn(batch, 1, hidden, device=device).to(dtype)
    k, v = (torch.randn(batch, module.kv_heads, past, module.head_dim, device=device).to(dtype) for _ in range(2))
    return x, k, v


def make_decode(name: str, batch: int = 2, past: int = 128, seed: int = 0):
    """(module in eval mode with `name`'s dtype, (x, past_k, past_v)) for a DECODE_CONFIGS entry. A
    batch of 2: torch.export takes a dim whose example is 1 for always 1."""
    if name not in DECODE_CONFIGS:
        raise ValueError(f"unknown decode layer {name!r}; known: {', '.join(DECODE_CONFIGS)}")
    ctor, dtype = DECODE_CONFIGS[name]
    torch.manual_seed(seed)
    module = ctor().eval().to(dtype)
    return module, decode_inputs(module, batch, past, dtype)


def make(name: str, seed: int = 0):
    """(module in eval mode with `name`'s dtype, example input) for a CONFIGS entry."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    ctor, shape, dtype = CONFIGS[name]
    torch.manual_seed(seed)
    module = ctor().eval().to(dtype)
    return module, torch.randn(shape).to(dtype)
