"""How much memory a request will take beyond the weights, estimated before it runs, so that a request that
cannot fit is refused with a message instead of pushing the server into swap or the OOM killer."""
from __future__ import annotations

import psutil

# Activations are estimated at their largest live set, times this margin for allocator slack and temporaries.
MARGIN = 2.0


def estimate_request_bytes(model_config, vision_patches: int, prompt_tokens: int, new_tokens: int,
                           bytes_per_value: int, float32_decode_cache: bool = False) -> int:
    """`float32_decode_cache`: decode keeps a float32 copy of the keys and values (model/direct_step.py)."""
    text, vision = model_config.get_text_config(), model_config.vision_config
    head_dim = getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    kv_cache = (prompt_tokens + new_tokens) * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim
    prefill = prompt_tokens * (4 * text.hidden_size + 3 * text.intermediate_size)
    logits = text.vocab_size * 4  # the last position's float32 logits
    encoder = vision_patches * (6 * vision.hidden_size + 2 * vision.intermediate_size)
    decode_copy = kv_cache * 4 if float32_decode_cache else 0
    return int(((kv_cache + max(prefill, encoder)) * bytes_per_value + decode_copy) * MARGIN + logits)


def available_bytes() -> int:
    return psutil.virtual_memory().available
