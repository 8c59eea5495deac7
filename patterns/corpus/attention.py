"""Corpus of ``attention``: attention layers whose heads are wider than flash attention's (the Stable
Diffusion VAE's single 512-wide head, here 320 to stay small), and the attention calls the family
leaves to eager's kernels.  The family takes fp16 / bf16 only, so its cases run in fp16."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CorpusCase, x_of


class _Attention(nn.Module):
    """A diffusers-style attention block over ``(N, L, C)`` tokens: q, k, v projections, heads split by
    a view and a transpose, ``F.scaled_dot_product_attention(**sdpa)``, the heads merged, a residual."""

    def __init__(self, channels: int, heads: int = 1, **sdpa) -> None:
        super().__init__()
        self.qkv = nn.Linear(channels, 3 * channels)
        self.heads, self.sdpa = heads, sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, channels = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, **self.sdpa).transpose(1, 2).reshape(n, length, channels) + x


def _half(model: nn.Module, *shape: int) -> tuple[nn.Module, list[torch.Tensor]]:
    return model.half(), [t.half() for t in x_of(*shape)]


CASES = [
    CorpusCase("vae_mid_block_single_wide_head", lambda: _half(_Attention(320), 1, 16, 320),
               regions=("attention(head dim 320)",)),
    CorpusCase("two_heads_of_272", lambda: _half(_Attention(544, heads=2), 2, 6, 544),
               regions=("attention(head dim 272)",)),
    CorpusCase("transformer_heads_of_64", lambda: _half(_Attention(256, heads=4), 2, 6, 256),
               near_misses=(("attention", "unsupported_argument", "head dim 64: torch's flash attention kernel"),)),
    CorpusCase("causal_wide_head", lambda: _half(_Attention(320, is_causal=True), 1, 6, 320),
               near_misses=(("attention", "unsupported_argument", "is_causal=True"),)),
    CorpusCase("wide_head_in_fp32", lambda: (_Attention(320), x_of(1, 6, 320)),
               near_misses=(("attention", "unsupported_dtype", "attention in torch.float32"),)),
]
