"""A one-token decode step written out over the model's own weights, gpt-fast's way; eager, or compiled by segment.

transformers' forward is built for every case (any batch, masks, cache kinds, output capture); for one token it
runs thousands of small operations around the 197 products that read the weights. Here a token is the products plus
about 30 operations a layer, on keys and values kept in buffers of this step's own, in the dtype transformers'
cache keeps (no mask, no cache object, no copy of the whole cache a step: transformers' DynamicCache
concatenates). Attention for all the step's sequences is one call (decode_attention.py).

A token is cut at its attentions into 29 segments (the head, then from each attention to the next: o_proj, MLP,
the next layer's norms, projections and rotary). `compile()` hands each segment to inductor with the weights frozen
as constants, so its products run on inductor's CPP GEMM templates and its small operations fuse; attention stays
eager, over the used length of the buffers. Compiling transformers' forward over a StaticCache instead attended
over the whole cache every token (figures in docs/decisions.md). One code object per segment: Dynamo caches
compiled code by code object, and 29 entries on one would be searched in turn at every call.

Images stay with transformers: a prompt's vision tokens are prefilled by its forward into its DynamicCache, and the
prefix cache keeps DynamicCaches. `take` copies a prefilled cache in, `extend` prefills text tokens after it (a
follow-up question, a prompt without images), `give_back` appends the new keys and values to the cache. By
default the hidden state keeps the model's compute dtype between operations as transformers' layers do, and the
eager step's logits are its forward's to the bit (tests/test_direct_step.py).
"""
from __future__ import annotations

import sys
import types
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..kernels.decode_attention import SequenceKV, best as best_attention
from ..kernels.fusion import stacked_products

# Keys and values are stored this many positions at a time: a request grows its buffers a few times at most.
GROWTH = 256
# A long text prompt is prefilled this many tokens at a time: attention scores and MLP activations stay at tens of
# MB (8,192 tokens at once would take 4 GB of float32 scores), and products of 256 rows already run at the matmul
# rate.
PREFILL_CHUNK = 256




def append_decoded(cache: DynamicCache, keys, values, length: int, empty_dtype: torch.dtype) -> None:
    """Append to a prefilled `cache` what a decode step kept elsewhere: positions from the cache's own length up to
    `length` of each layer's (1, kv heads, n, head dim) `keys` and `values`, in the cache's dtype, so that the prefix
    cache keeps the answer for the conversation's next turn."""
    for index, (layer, layer_keys, layer_values) in enumerate(zip(cache.layers, keys, values)):
        start = layer.get_seq_length()
        if length > start:
            # A layer still empty (a text prompt the step prefilled) takes `empty_dtype`: what transformers' prefill
            # would have stored.
            dtype = layer.keys.dtype if start else empty_dtype
            cache.update(layer_keys[:, :, start:length].to(dtype, copy=True),
                         layer_values[:, :, start:length].to(dtype, copy=True), index)


class DirectDecodeStep:
    def __init__(self, model, hidden_dtype: torch.dtype | None = None, growth: int = GROWTH,
                 chunk: int = PREFILL_CHUNK, attention=None):
        """hidden_dtype: what the hidden state is kept in between operations; the model's own dtype if None.
        attention: what a step attends with (decode_attention.py); this process's best if None."""
        self.hidden_dtype, self.growth, self.chunk = hidden_dtype, growth, chunk
        self.attention = attention if attention is not None else best_attention()[0]
        language_model = model.model.language_model
        config = language_model.config
        self.layers = list(language_model.layers)
        self.embed_tokens, self.final_norm, self.lm_head = language_model.embed_tokens, language_model.norm, model.lm_head
        # What transformers' layers compute in, so keep in a cache: the dtype embeddings come out in.
        self.cache_dtype = self.embed_tokens(torch.zeros(1, dtype=torch.long)).dtype
        # The step's buffers keep what transformers' cache keeps where the attention reads bfloat16: it halves what
        # every step reads of them.
        keeps_bfloat16 = self.cache_dtype == torch.bfloat16 and self.attention.reads_bfloat16
        self.kv_dtype = torch.bfloat16 if keeps_bfloat16 else torch.float32
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        rotary = language_model.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scaling = float(rotary.attention_scaling)
        # Qwen3-VL's interleaved M-RoPE: frequency j turns with the height position where j % 3 == 1, with the
        # width position where j % 3 == 2 (each up to its section's length), with the time position elsewhere.
        self.rope_row = torch.zeros(self.inv_freq.shape[0], dtype=torch.long)
        for row, offset in ((1, 1), (2, 2)):
            self.rope_row[offset:rotary.mrope_section[row] * 3:3] = row
        self.segments: list[Callable] = [self._segment] * (len(self.layers) + 1)
        self.compiled = False

    def take(self, cache: DynamicCache) -> SequenceKV:
        """A sequence's buffers, started from a prefilled cache: its keys and values are copied in (none from an
        empty one)."""
        length = cache.get_seq_length()
        capacity = length + self.growth
        keys, values = [], []
        for index in range(len(self.layers)):
            for kept, source in ((keys, "keys"), (values, "values")):
                buffer = torch.empty((self.kv_heads, capacity, self.head_dim), dtype=self.kv_dtype)
                if length:
                    buffer[:, :length].copy_(getattr(cache.layers[index], source)[0])
                kept.append(buffer)
        return SequenceKV(keys, values, length)

    def give_back(self, kv: SequenceKV, cache: DynamicCache, length: int) -> None:
        """Append to `cache` the keys and values the steps added to `kv`, up to `length` positions; its buffers go."""
        append_decoded(cache, [keys[None] for keys in kv.keys], [values[None] for values in kv.values], length,
                       self.cache_dtype)
        kv.keys, kv.values = [], []

    def kv_bytes(self, positions: int) -> int:
        """Bytes of a sequence's buffers holding `positions` (rounded up to the growth step)."""
        capacity = (positions + self.growth - 1) // self.growth * self.growth
        return 2 * len(self.layers) * self.kv_heads * capacity * self.head_dim * self.kv_dtype.itemsize

    def release(self) -> None:
        """Drop the model's modules; a compiled step also frees its compiled code, which holds a frozen copy of the
        weights. One engine is loaded at a time, so every compiled graph of the process goes."""
        self.layers = []
        self.embed_tokens = self.final_norm = self.lm_head = None
        self.segments = []
        if self.compiled:
            self.compiled = False
            release_compiled_code()

    def compile(self, options: dict, progress: Callable[[int, int], None] | None = None) -> None:
        """Compile every segment now, with inductor `options`, one at a time (progress(done, total) after each).
        Run on the compute thread, under inference mode, as the steps will be: any other state recompiles."""
        total = len(self.layers) + 1
        code = DirectDecodeStep._segment.__code__
        hidden_dtype = self.hidden_dtype or self.embed_tokens.weight.dtype
        hidden = torch.zeros(1, self.embed_tokens.weight.shape[1], dtype=hidden_dtype)
        attended = torch.zeros(self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        # Two tensors, not one: Dynamo guards on which inputs alias each other (one tensor for both recompiled every
        # segment at its first real call, without these options: eager speed).
        cos, signed_sin = torch.zeros(self.head_dim, dtype=hidden_dtype), torch.zeros(self.head_dim, dtype=hidden_dtype)
        segments = []
        # Set globally, not as torch.compile's options: Dynamo reads `freezing` while it traces, to keep the weights
        # as constants instead of graph inputs.
        try:
            with torch._inductor.config.patch(options):
                for index in range(total):
                    function = types.FunctionType(code.replace(co_name=f"decode_segment_{index}"), globals(),
                                                  f"decode_segment_{index}")
                    segment = torch.compile(types.MethodType(function, self), dynamic=False)
                    segment(index, hidden, attended if index else None, cos, signed_sin)
                    segments.append(segment)
                    if progress is not None:
                        progress(index + 1, total)
        except BaseException:
            # The segments compiled before the failure hold frozen weights too; `compiled` is not set yet, so
            # release() would not free them.
            release_compiled_code()
            raise
        self.segments, self.compiled = segments, True

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (tokens, head_dim) for the tokens' (time, height, width) positions (4, 1, tokens), rounded to
        `dtype` as transformers does, with the sign of rotate_half folded into sin."""
        angles = positions[-3:].reshape(3, -1).float()[self.rope_row].T * self.inv_freq
        cos, sin = angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling
        cos, sin = cos.to(dtype), sin.to(dtype)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def _make_room(self, kv: SequenceKV, end: int) -> None:
        """Buffers for at least `end` positions, grown in one copy."""
        missing = end - kv.capacity
        if missing <= 0:
            return
        extra = (missing + self.growth - 1) // self.growth * self.growth
        for kept in (kv.keys, kv.values):
            for index, buffer in enumerate(kept):
                kept[index] = torch.cat([buffer, buffer.new_empty((self.kv_heads, extra, self.head_dim))], dim=1)

    @staticmethod
    def _norm(norm, x: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm: float32 statistics, the result rounded to the input's dtype, then the weight."""
        return norm.weight * F.rms_norm(x.float(), x.shape[-1:], None, norm.variance_epsilon).to(x.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """rotate_half's rotation: x * cos + (-x2, x1) * sin, for (..., heads, head_dim)."""
        halves = x.view(*x.shape[:-1], 2, self.head_dim // 2).flip(-2).view(x.shape)
        return x * cos + halves * signed_sin

    def _segment(self, index: int, hidden: torch.Tensor, attended: torch.Tensor | None, cos: torch.Tensor,
                 signed_sin: torch.Tensor):
        """From layer index-1's attention output `attended` (none before layer 0) to layer `index`'s attention
        inputs: (hidden, query in float32, key, value), each (tokens, heads, head_dim) but hidden; past the last
        layer, the logits. `hidden` is (tokens, hidden size); cos and sin broadcast over (tokens, heads, head_dim)."""
        rows = hidden.shape[0]
        if index > 0:
            layer = self.layers[index - 1]
            hidden = hidden + layer.self_attn.o_proj(attended.reshape(rows, -1).to(hidden.dtype))
            x = self._norm(layer.post_attention_layernorm, hidden)
            mlp = layer.mlp
            gate, up = stacked_products((mlp.gate_proj, mlp.up_proj), x)
            hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        if index == len(self.layers):
            return self.lm_head(self._norm(self.final_norm, hidden))
        attention, heads, kv_heads, dim = self.layers[index].self_attn, self.heads, self.kv_heads, self.head_dim
        x = self._norm(self.layers[index].input_layernorm, hidden)
        query, key, value = stacked_products((attention.q_proj, attention.k_proj, attention.v_proj), x)
        query = self._rotate(self._norm(attention.q_norm, query.view(rows, heads, dim)), cos, signed_sin)
        key = self._rotate(self._norm(attention.k_norm, key.view(rows, kv_heads, dim)), cos, signed_sin)
        return hidden, query.float(), key, value.view(rows, kv_heads, dim)

    def extend(self, kv: SequenceKV, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Prefill text tokens (1, n) at rotary positions (4, 1, n) after what the buffers hold -> the last token's
        next logits (1, vocab). Eager, whether or not the one-token segments are compiled (they are traced for one
        row). Vision tokens are not handled here: their embeddings and deepstack features come from transformers'
        forward.

        A follow-up question is ~16 such tokens after a cached conversation: products are most of the work, and
        transformers' forward spends a third as much again around them (docs/decisions.md, "The direct decode
        step")."""
        count = tokens.shape[1]
        if count == 0:
            raise ValueError("extend needs at least one token: the last one's logits are the result")
        self._make_room(kv, kv.length + count)
        for first in range(0, count, self.chunk):
            last = first + self.chunk >= count
            logits = self._extend(kv, tokens[:, first:first + self.chunk], positions[:, :, first:first + self.chunk],
                                  last)
        return logits

    def _extend(self, kv: SequenceKV, tokens: torch.Tensor, positions: torch.Tensor,
                want_logits: bool) -> torch.Tensor | None:
        rows, start = tokens.shape[1], kv.length
        end = start + rows
        hidden = self.embed_tokens(tokens.view(rows))
        if self.hidden_dtype is not None:
            hidden = hidden.to(self.hidden_dtype)
        cos, signed_sin = self._rotary(positions, hidden.dtype)
        cos, signed_sin = cos[:, None], signed_sin[:, None]
        groups, last, attended = self.heads // self.kv_heads, len(self.layers), None
        # Each new token sees the cached ones and the new ones up to itself. Attention as decode does it, two batched
        # products per key head with its query heads' rows stacked (no key heads expanded to the query heads),
        # which measured faster than SDPA at a follow-up's size.
        hidden_from = torch.ones(rows, end, dtype=torch.bool).tril(start).logical_not_().repeat(groups, 1)
        for index, (keys, values) in enumerate(zip(kv.keys, kv.values)):
            hidden, query, key, value = self._segment(index, hidden, attended, cos, signed_sin)
            keys[:, start:end].copy_(key.transpose(0, 1))
            values[:, start:end].copy_(value.transpose(0, 1))
            grouped = query.view(rows, self.kv_heads, groups, self.head_dim).permute(1, 2, 0, 3).reshape(
                self.kv_heads, groups * rows, self.head_dim)
            scores = torch.bmm(grouped, keys[:, :end].float().transpose(1, 2)).mul_(self.scaling).masked_fill_(
                hidden_from, float("-inf"))
            # (kv heads, groups * rows, dim)
            attended = torch.bmm(torch.softmax(scores, dim=-1), values[:, :end].float())
            attended = attended.view(self.kv_heads, groups, rows, self.head_dim).permute(2, 0, 1, 3).reshape(rows, -1)
        kv.length = end
        if not want_logits:
            return None
        # Only the last token's logits are wanted: the last layer's MLP and the head run on its row alone.
        return self._segment(last, hidden[-1:], attended[-1:], cos[-1], signed_sin[-1])

    def __call__(self, kv: SequenceKV, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token (1, 1) of one sequence at rotary positions (4, 1, 1) -> next logits (1, vocab)."""
        return self.batch([kv], token.view(1), positions)

    def batch(self, kvs: list[SequenceKV], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of B sequences: tokens (B,) at rotary positions (4, 1, B) -> next logits (B, vocab).

        The products read each weight once for all B rows, which is why a step for four costs little more than a
        step for one; attention runs per sequence over its own length, all of them in one call. Compiled segments
        were traced for one row: a batch of more runs the same segments eager."""
        for kv in kvs:
            self._make_room(kv, kv.length + 1)
        return self._rows(kvs, tokens, positions)

    def check(self, kv: SequenceKV, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Several tokens (n,) of one sequence at rotary positions (4, 1, n) in one pass -> the logits after each
        (n, vocab), each row what a step of that token alone gives (the same products of up to the layout's rows,
        the same attention over the positions up to its own). Leaves `kv.length` where it was: the caller keeps as
        many of the positions as it accepts."""
        count = tokens.shape[0]
        self._make_room(kv, kv.length + count)
        return self._rows(self._run_rows(kv, count), tokens, positions, shared=[(kv, 0, count)])

    def runs(self, kvs: list[SequenceKV], tokens: torch.Tensor, positions: torch.Tensor,
             counts: list[int]) -> torch.Tensor:
        """counts[i] tokens for each of B sequences in one pass (tokens (sum,) at positions (4, 1, sum), sequence by
        sequence) -> the logits after each sequence's last token (B, vocab). Each token a row of its own, as `check`
        runs them; each sequence keeps all of its tokens. A lone row runs beside a copy of itself: every row then
        goes through the same products (several rows), whatever the others, so an answer's rows compute alike
        alone, in a batch, and with tokens riding along (one-row products round differently)."""
        rows, shared = [], []
        for kv, count in zip(kvs, counts):
            self._make_room(kv, kv.length + count)
            shared.append((kv, len(rows), count))
            rows += self._run_rows(kv, count)
        if len(rows) == 1:
            rows.append(SequenceKV(kvs[0].keys, kvs[0].values, kvs[0].length))
            tokens, positions = tokens.repeat(2), positions.repeat(1, 1, 2)
        last = torch.tensor(counts).cumsum(0) - 1
        logits = self._rows(rows, tokens, positions, shared=shared, keep=last)
        for kv, count in zip(kvs, counts):
            kv.length += count
        return logits

    @staticmethod
    def _run_rows(kv: SequenceKV, count: int) -> list[SequenceKV]:
        """Row r of a run is a sequence of its own over the run's buffers, r positions longer: it attends over the
        rows before it, whose keys and values are written before any row attends."""
        return [SequenceKV(kv.keys, kv.values, kv.length + row) for row in range(count)]

    def _rows(self, kvs: list[SequenceKV], tokens: torch.Tensor, positions: torch.Tensor,
              shared: list[tuple[SequenceKV, int, int]] | None = None,
              keep: torch.Tensor | None = None) -> torch.Tensor:
        """`shared`: (buffers, first row, rows) of runs whose rows share buffers, their keys and values written here
        before any row attends. `keep`: the rows whose logits are wanted (the last layer and the head run on them
        alone), else all."""
        rows = len(kvs)
        hidden = self.embed_tokens(tokens.view(rows))  # (B, hidden)
        if self.hidden_dtype is not None:
            hidden = hidden.to(self.hidden_dtype)
        cos, signed_sin = self._rotary(positions, hidden.dtype)
        if rows == 1:
            segments, cos, signed_sin = self.segments, cos[0], signed_sin[0]
        else:
            segments = [self._segment] * len(self.segments)
            cos, signed_sin = cos[:, None], signed_sin[:, None]
        attend = self.attention.step(kvs, self.kv_heads, self.heads // self.kv_heads, self.head_dim, self.scaling,
                                     written=shared is not None)
        attended = None
        for index, segment in enumerate(segments[:-1]):
            hidden, query, key, value = segment(index, hidden, attended, cos, signed_sin)
            for kv, first, count in shared or ():
                kv.keys[index][:, kv.length:kv.length + count].copy_(key[first:first + count].transpose(0, 1))
                kv.values[index][:, kv.length:kv.length + count].copy_(value[first:first + count].transpose(0, 1))
            attended = attend(index, query, key, value)
        for kv in kvs:
            kv.length += 1
        if keep is not None:
            hidden, attended, cos, signed_sin = hidden[keep], attended[keep], cos[keep], signed_sin[keep]
        return segments[-1](len(self.layers), hidden, attended, cos, signed_sin)


def release_compiled_code() -> None:
    """Free every compiled graph of the process and the weights frozen into them. Dynamo keeps compiled code in a
    cache of its own, keyed by code object; inductor registers the Python module it generates per graph in
    sys.modules, and that module's globals hold the frozen (and CPP GEMM-packed) weights: without this they stay after
    close, and an engine loaded next decodes slower beside them (docs/decisions.md, "Compile policy")."""
    torch._dynamo.reset()
    from torch._inductor.codecache import PyCodeCache

    for module in list(PyCodeCache.modules):
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
    PyCodeCache.cache_clear()
