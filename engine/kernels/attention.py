"""Attention for one decode step, where PyTorch's fused kernel costs more than the arithmetic.

A decode step attends one query per head over the cached keys: a few hundred thousand multiply-adds per layer, for
which scaled_dot_product_attention's CPU flash kernel pays more in setup than in arithmetic. Prefill and the vision
tower keep the fused kernel, and so does everything transformers decides about masks: only the function behind the
"sdpa" name changes, and only for single-query calls, which go to the decode attention of
decode_attention.py (its C kernel, or the two small matmuls and softmax of its single_query), the same as
the direct step's (docs/decisions.md, "Single-query attention", "Decode attention kernel").

The arithmetic is float32 even for a bfloat16 cache: at these shapes (two query rows per key head) the bfloat16
batched matmul is the slow path.
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .decode_attention import best  # the direct step's attention too: the two agree to the bit




def single_query_attention(query, key, value, attention_mask=None, scaling=None, groups: int = 1) -> torch.Tensor:
    """query (b, heads, 1, d), key and value (b, heads / groups, n, d) -> (b, 1, heads, d), as sdpa's caller
    returns it. Query heads h * groups .. h * groups + groups - 1 share key/value head h (grouped-query)."""
    batch, heads, _, dim = query.shape
    dtype = value.dtype
    query = query.float()
    scaling = scaling if scaling is not None else dim ** -0.5
    kv_heads, length = heads // groups, key.shape[-2]
    grouped = query.reshape(batch * kv_heads, groups, dim)
    key, value = key.reshape(batch * kv_heads, length, dim), value.reshape(batch * kv_heads, length, dim)
    if attention_mask is None:
        out = best()[0].cached(grouped, key, value, scaling)
    else:  # rare: a padded batch through transformers' forward
        key, value = key.float(), value.float()
        scores = torch.bmm(key, grouped.transpose(1, 2)).mul_(scaling).transpose(1, 2).reshape(
            batch, kv_heads, groups, length)
        mask = attention_mask[..., -1:, :] if attention_mask.dim() == 4 else attention_mask
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
        out = torch.bmm(torch.softmax(scores, dim=-1).reshape(batch * kv_heads, groups, length), value)
    return out.reshape(batch, 1, heads, dim).to(dtype)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, with single-query calls (decode steps) done by single_query_attention."""
    single = query.shape[2] == 1 and not dropout and kwargs.get("position_bias") is None and not torch.is_grad_enabled()
    if not single or (attention_mask is not None and attention_mask.shape[-2] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    return single_query_attention(query, key, value, attention_mask, scaling, groups), None


def install() -> None:
    """Put attention_forward behind the "sdpa" name, once per process (every model loaded after uses it)."""
    if ALL_ATTENTION_FUNCTIONS["sdpa"] is not attention_forward:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = attention_forward
