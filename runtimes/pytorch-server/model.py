"""A tiny decoder-only transformer with random weights and a KV cache per
sequence, batched across sequences at each decode step. Real tensors, real
allocator traffic; nothing downloaded."""

import math

import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, d, heads, dtype, device, kv_dtype=None):
        super().__init__()
        self.heads = heads
        # The KV cache's element type (None: the model's): a lower one holds
        # less and rounds the keys and values attention reads back.
        self.kv_dtype = kv_dtype
        self.qkv = nn.Linear(d, 3 * d, bias=False, dtype=dtype, device=device)
        self.out = nn.Linear(d, d, bias=False, dtype=dtype, device=device)
        self.up = nn.Linear(d, 4 * d, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(4 * d, d, bias=False, dtype=dtype, device=device)
        self.norm1 = nn.LayerNorm(d, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(d, dtype=dtype, device=device)

    def forward(self, x, caches, layer):
        """x: [B, T, d] (T > 1 only for a single-sequence prefill); caches: one
        dict per sequence, holding this layer's (k, v) as [heads, len, hd]."""
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        outs = []
        for i, cache in enumerate(caches):
            qi = q[i].view(t, self.heads, hd).transpose(0, 1)
            ki = k[i].view(t, self.heads, hd).transpose(0, 1)
            vi = v[i].view(t, self.heads, hd).transpose(0, 1)
            if self.kv_dtype is not None:
                ki, vi = ki.to(self.kv_dtype), vi.to(self.kv_dtype)
            if layer in cache:  # grow the cache the way a dynamic cache does
                pk, pv = cache[layer]
                ki, vi = torch.cat([pk, ki], dim=1), torch.cat([pv, vi], dim=1)
            cache[layer] = (ki, vi)
            ki, vi = ki.to(q.dtype), vi.to(q.dtype)
            scores = (qi @ ki.transpose(1, 2)) / math.sqrt(hd)
            if t > 1:
                mask = torch.ones(t, ki.shape[1], dtype=torch.bool, device=x.device).tril(ki.shape[1] - t)
                scores = scores.masked_fill(~mask, float("-inf"))
            outs.append((scores.softmax(-1) @ vi).transpose(0, 1).reshape(t, d))
        x = x + self.out(torch.stack(outs))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, vocab=32000, d=256, layers=2, heads=4, dtype=torch.float32, device="cpu", kv_dtype=None):
        super().__init__()
        self.vocab, self.d, self.n_layers = vocab, d, layers
        self.embed = nn.Embedding(vocab, d, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Layer(d, heads, dtype, device, kv_dtype) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False, dtype=dtype, device=device)

    def kv_bytes_per_token(self):
        p = self.head.weight
        return 2 * self.n_layers * self.d * p.element_size()

    def forward(self, tokens, caches):
        """tokens: [B, T] int64; returns logits [B, T, vocab]."""
        x = self.embed(tokens)
        for n, layer in enumerate(self.layers):
            x = layer(x, caches, n)
        return self.head(x)


def cache_bytes(cache):
    return sum(k.nbytes + v.nbytes for k, v in cache.values())
