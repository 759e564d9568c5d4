"""Speculative decoding: an int8 copy of the language model drafts a few tokens, the loaded step checks them in one
pass over its weights, and every token kept is the one the loaded model's own greedy step chooses.

Decode reads every weight once a token. An int8 copy of the layers and head reads a quarter of float32's bytes and
mostly picks float32's token, and float32 weights laid out for four rows check four tokens for about one token's
read (docs/decisions.md, "Speculative decoding for float32"). The copy shares the step's embeddings, norms,
rotary and key and value buffers: it drafts on top of the loaded model's own keys and values, and the check
overwrites what it drafted there.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ..kernels.fusion import StackedPart, StackedProjection
from ..kernels.packing import PackedLinear
from ..kernels.quantize import Int8Linear
from .direct_step import DirectDecodeStep
from .generate import DecodeState, next_positions

# Tokens drafted before a check: with the token before them the check is four rows, the float32 layout's
# (kernels/packing.py, decode_rows), so each row's product is the one a step of that token alone computes.
DRAFTED = 3
# A check and its drafts cost about two plain steps: below about half the drafts kept, a token a step is faster.
# A request stops drafting there, once enough drafts were checked to tell.
KEPT_SHARE_THAT_PAYS = 0.5
DRAFTS_BEFORE_JUDGING = 12


def pays(drafted: int, kept: int) -> bool:
    """Whether a request whose checks kept `kept` of `drafted` tokens goes on drafting."""
    return drafted < DRAFTS_BEFORE_JUDGING or kept >= KEPT_SHARE_THAT_PAYS * drafted


def _weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Linear's float weight and bias, packed or plain."""
    if isinstance(module, PackedLinear):
        return module.unpacked(), module.bias
    return module.weight.detach(), module.bias


def _int8(module: nn.Module) -> Int8Linear:
    return Int8Linear(*_weight(module))


def _int8_parts(parts: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    """The int8 copy of a stacked projection's parts (one product), or of each Linear alone."""
    first = parts[0]
    if isinstance(first, StackedPart):
        return StackedProjection(_int8(first.stacked.linear), first.stacked.sizes).parts()
    return tuple(_int8(part) for part in parts)


def int8_copy(model) -> SimpleNamespace:
    """The language model as the direct step reads it, its products int8 (fbgemm), the rest the model's own."""
    language_model = model.model.language_model
    layers = []
    for layer in language_model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        q_proj, k_proj, v_proj = _int8_parts((attention.q_proj, attention.k_proj, attention.v_proj))
        gate_proj, up_proj = _int8_parts((mlp.gate_proj, mlp.up_proj))
        layers.append(SimpleNamespace(
            input_layernorm=layer.input_layernorm, post_attention_layernorm=layer.post_attention_layernorm,
            self_attn=SimpleNamespace(q_proj=q_proj, k_proj=k_proj, v_proj=v_proj, o_proj=_int8(attention.o_proj),
                                      q_norm=attention.q_norm, k_norm=attention.k_norm),
            mlp=SimpleNamespace(gate_proj=gate_proj, up_proj=up_proj, down_proj=_int8(mlp.down_proj),
                                act_fn=mlp.act_fn)))
    copy = SimpleNamespace(config=language_model.config, layers=layers, embed_tokens=language_model.embed_tokens,
                           norm=language_model.norm, rotary_emb=language_model.rotary_emb)
    return SimpleNamespace(model=SimpleNamespace(language_model=copy), lm_head=_int8(model.lm_head))


def draft_bytes(draft: DirectDecodeStep) -> int:
    """What the copy's products hold: its int8 weights."""
    modules = [draft.lm_head] + [module for layer in draft.layers
                                 for module in (*vars(layer.self_attn).values(), *vars(layer.mlp).values())]
    products = {id(m.stacked.linear): m.stacked.linear for m in modules if isinstance(m, StackedPart)}
    products |= {id(m): m for m in modules if isinstance(m, Int8Linear)}
    return sum(product.packed_nbytes for product in products.values())


def draft_and_check(step: DirectDecodeStep, draft: DirectDecodeStep, state: DecodeState, token: int,
                    most: int) -> tuple[list[int], torch.Tensor]:
    """After `token` (sampled, not yet in the buffers): up to `most` - 1 tokens drafted greedily by `draft`, then
    `token` and the drafts through `step` in one pass. Returns the drafts and the step's logits after `token` and
    after each draft (one row more than drafts); `keep` then says which of the fed tokens stay."""
    kv, position = state.kv, state.tokens.shape[1]
    start, drafted = kv.length, max(0, min(DRAFTED, most - 1))
    step._make_room(kv, start + drafted + 1)
    fed = [token]
    for offset in range(drafted):
        logits = draft.batch([kv], torch.tensor([fed[-1]]), next_positions(position + offset, state.rope_delta))
        fed.append(int(logits[0].argmax()))
    kv.length = start
    return fed[1:], step.check(kv, torch.tensor(fed), next_positions(position, state.rope_delta, len(fed)))


def keep(state: DecodeState, fed: list[int]) -> None:
    """The tokens fed to draft_and_check's check that stay in the sequence: its `token` and the drafts accepted."""
    position = state.tokens.shape[1]
    state.tokens = torch.cat([state.tokens, torch.tensor([fed], dtype=state.tokens.dtype)], dim=1)
    state.positions = torch.cat([state.positions, next_positions(position, state.rope_delta, len(fed))], dim=2)
    state.kv.length += len(fed)
