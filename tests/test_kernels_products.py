"""Linear products, attention and stacked projections of the model's own weights, checked against plain PyTorch."""
from __future__ import annotations

import pytest
import torch

from engine import ChatRequest
from engine.kernels.fusion import StackedPart, stack_projections_, stacked_products
from engine.kernels.packing import (
    PackedLinear,
    keeps_fp16_copy,
    packing_works,
    wide_layout_pays,
)
from engine.kernels.quantize import Bf16Embedding, Bf16Linear, Int8Linear, has_int8_dot_product
from engine.model.loading import decode_weight_bytes

# Tests of the kernels a CPU may or may not have: tests/test_isa.py runs them again under AVX2-only dispatch.
kernels = pytest.mark.kernels


@kernels
def test_int8_linear_matches_dequantised_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    quantized = Int8Linear(linear.weight, linear.bias)
    # Without VNNI products of several rows run on two 7-bit halves, so fbgemm's 16-bit pair sums cannot saturate.
    assert quantized.split is (not has_int8_dot_product())
    dequantised = quantized.dequantized()
    assert (dequantised - linear.weight).abs().max() <= quantized.scales.max() / 2 + 1e-6  # half a rounding step
    for rows in (1, 40):  # the one-token op and the per-row scaled op
        x = torch.randn(1, rows, 64)
        expected = torch.nn.functional.linear(x, dequantised, linear.bias.detach())
        got = quantized(x)
        assert got.shape == (1, rows, 96) and got.dtype == torch.float32
        # int8 activations: each row rounds to 1/127 of its largest value
        assert torch.allclose(got, expected, atol=0.05, rtol=0.02)
        assert quantized(x.bfloat16()).dtype == torch.bfloat16  # computes for a bfloat16 model too


@kernels
@pytest.mark.parametrize("split", [False, True])
def test_int8_linear_scales_activations_per_token_and_sums_exactly(split):
    """One token with a huge activation must not crush the precision of the others (per-token scales); the sums
    are the exact integer sums of the rounded activations, on one product or on two 7-bit halves (a CPU without
    VNNI, whose 16-bit pair sums saturate on one)."""
    if not split and not has_int8_dot_product():
        pytest.skip("one product of several rows needs int8 dot products (AVX-512 VNNI, AVX-VNNI or AMX): this CPU's "
                    "fbgemm adds u8 x s8 pairs in 16 bits and saturates; the split case runs")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128, bias=False)
    quantized = Int8Linear(linear.weight, None, split=split)
    x = torch.randn(8, 256)
    x[0] *= 1000.0
    expected = torch.nn.functional.linear(x, quantized.dequantized())
    error = ((quantized(x) - expected).norm(dim=1) / expected.norm(dim=1))[1:]
    assert error.max() < 0.02, error
    scales = x.abs().amax(dim=1, keepdim=True) / 127
    exact = torch.nn.functional.linear((x / scales).round(), quantized.dequantized()) * scales
    torch.testing.assert_close(quantized(x), exact, rtol=1e-5, atol=1e-3)  # saturated sums were 3-9% off
    # against one scale for the whole block (what a plain dynamic-quantized Linear does): far worse
    one_scale = torch.ops.quantized.linear_dynamic(x, quantized._packed, False)
    assert ((one_scale - expected).norm(dim=1) / expected.norm(dim=1))[1:].min() > 10 * error.max()


@kernels
def test_packed_linear_matches_f_linear_and_engines_agree(make_engine, images_dir):
    torch.manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        if not packing_works(dtype):  # the fallback: the engine keeps stock kernels and says why
            name = str(dtype).removeprefix("torch.")
            engine = make_engine(dtype=name, compute_dtype=name, compile="off")
            assert type(engine.loaded.model.lm_head) is torch.nn.Linear
            assert any(note.startswith(f"{name}: oneDNN cannot pack") for note in engine.info.notes), engine.info
            assert engine.ask(ChatRequest(prompt="Hi", max_new_tokens=3)).metrics.status == "ok"
            continue
        linear = torch.nn.Linear(64, 96).to(dtype)
        packed = PackedLinear(linear)
        for rows in (1, 40):
            x = torch.randn(2, rows, 64).to(dtype)
            got = packed(x)
            assert got.dtype == dtype and got.shape == (2, rows, 96)
            assert torch.allclose(got.float(), linear(x).float(), atol=tolerance, rtol=tolerance)
        assert torch.equal(packed.unpacked(), linear.weight.detach())
    # A bfloat16 weight with fbgemm's float16 copy: one row runs on it (float32 in, float32 out), more rows on oneDNN.
    assert packing_works(torch.float32)  # oneDNN packs float32 on every x86 CPU with AVX2
    if not packing_works(torch.bfloat16):
        assert not keeps_fp16_copy("bfloat16")
    else:
        _check_fp16_copy()
    request = ChatRequest(prompt="Describe", images=(images_dir / "chelsea.png",), max_new_tokens=8)
    packed_engine, plain_engine = make_engine(), make_engine(kernels="plain")
    assert isinstance(packed_engine.loaded.model.lm_head, PackedLinear)
    assert type(plain_engine.loaded.model.lm_head) is torch.nn.Linear
    # the tied LM head gets its own packed copy beside the embeddings; nothing else is held twice but float32's
    # int8 draft (counted apart)
    head = plain_engine.loaded.model.lm_head.weight
    assert (packed_engine.loaded.weight_bytes - packed_engine.loaded.draft_bytes
            == plain_engine.loaded.weight_bytes + head.numel() * head.element_size())
    assert packed_engine.ask(request).text == plain_engine.ask(request).text


def test_the_batch_layout_is_kept_for_cpus_where_a_lone_row_pays_little():
    assert wide_layout_pays(frozenset({"avx2", "fma", "avx512f", "avx512bw"}))
    assert not wide_layout_pays(frozenset({"avx2", "fma", "f16c"}))


@kernels
def test_float32_decode_weights_are_laid_out_for_the_batch(make_engine):
    """The language model's float32 weights are packed for the batch decode runs at (up to four rows; four where it
    drafts, whose check is four rows), the vision tower's for one; a product of fewer rows is padded, so each row's
    result is the one it gets beside others (a lone answer's tokens are its tokens in a batch, to the bit) and
    F.linear's within rounding."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    packed = PackedLinear(linear, rows=4)
    assert torch.equal(packed.unpacked(), linear.weight.detach())
    x = torch.randn(6, 64)
    with torch.inference_mode():
        four = packed(x[:4])
        for count in (1, 2, 3):
            assert torch.equal(packed(x[:count]), four[:count])
        assert torch.allclose(packed(x), linear(x), atol=1e-4, rtol=1e-4)
    assert PackedLinear(linear.to(torch.bfloat16), rows=4).rows == 1 if packing_works(torch.bfloat16) else True
    for settings, rows in ((dict(max_batch=4), 4), (dict(max_batch=8), 4), (dict(max_batch=2), 4),
                           (dict(max_batch=1), 4), (dict(max_batch=2, draft="off"), 2),
                           (dict(max_batch=1, draft="off"), 1), (dict(kv_cache=False), 1)):
        rows = rows if wide_layout_pays() else 1  # oneDNN's AVX2 kernels: a padded lone row would cost 1.6x
        model = make_engine(**settings).loaded.model
        assert model.lm_head.rows == rows, settings
        assert model.model.language_model.layers[0].mlp.down_proj.rows == rows
        assert {module.rows for module in model.model.visual.modules() if isinstance(module, PackedLinear)} == {1}


def _check_fp16_copy() -> None:
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    packed = PackedLinear(linear, one_row_fp16=True)
    assert packed.one_row_dtype == torch.float32 and "fbgemm float16" in repr(packed)
    assert packed.read_nbytes == 64 * 96 * 2 and packed.packed_nbytes == 2 * packed.read_nbytes
    reference = linear.float()
    for dtype, rows, tolerance in ((torch.float32, 1, 1e-4), (torch.bfloat16, 1, 0.05), (torch.bfloat16, 40, 0.05)):
        x = torch.randn(2 if rows > 1 else 1, rows, 64).to(dtype)
        got = packed(x)
        assert got.dtype == dtype and got.shape == (*x.shape[:-1], 96)
        torch.testing.assert_close(got.float(), reference(x.float()), atol=tolerance, rtol=tolerance)


@kernels
def test_stacked_projections_compute_what_the_separate_linears_did(tiny_model):
    """q, k, v and gate, up stacked: the model's forward gives the same logits, each old name hands out its slice,
    the separate weights are gone and the weights a decode step reads are counted once."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 20, 300, 4000, 50, 6]])
    attention = model.model.language_model.layers[0].self_attn
    x = torch.randn(1, 3, attention.q_proj.in_features)
    with torch.inference_mode():
        expected_logits = model(input_ids=ids).logits
        expected_parts = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
        bytes_before = decode_weight_bytes(model)
        assert stack_projections_(model) == 2 * len(model.model.language_model.layers)
        assert decode_weight_bytes(model) == bytes_before
        assert isinstance(attention.q_proj, StackedPart) and attention.qkv_proj.linear.weight.shape[0] == sum(
            part.shape[-1] for part in expected_parts)
        assert torch.allclose(model(input_ids=ids).logits, expected_logits, atol=1e-5, rtol=1e-5)
        # in any order; once each part is handed out, nothing of the product is kept alive
        for name, expected in reversed(list(zip(("q_proj", "k_proj", "v_proj"), expected_parts))):
            assert torch.allclose(getattr(attention, name)(x), expected, atol=1e-5, rtol=1e-5)
        assert attention.qkv_proj._input is None
        for _ in range(2):  # one name alone, twice
            assert torch.allclose(attention.k_proj(x), expected_parts[1], atol=1e-5, rtol=1e-5)
        stacked = stacked_products((attention.q_proj, attention.k_proj, attention.v_proj), x)
        assert all(torch.allclose(got, want, atol=1e-5, rtol=1e-5) for got, want in zip(stacked, expected_parts))


@kernels
def test_bf16_linear_keeps_bfloat16_weights_and_float32_outputs():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    compact = Bf16Linear(linear.weight, linear.bias)
    assert compact.weight.dtype == torch.bfloat16 and compact.weight.numel() == 64 * 96
    rounded = linear.weight.detach().bfloat16().float()
    for rows in (1, 40):  # the decode path (bfloat16 product) and the prefill path (widened weights)
        x = torch.randn(1, rows, 64)
        got = compact(x)
        assert got.dtype == torch.float32 and got.shape == (1, rows, 96)
        tolerance = 0.05 if rows == 1 else 1e-4
        assert torch.allclose(got, torch.nn.functional.linear(x, rounded, linear.bias.detach()), atol=tolerance)
    embedding = Bf16Embedding(linear.weight)
    assert embedding.weight.data_ptr() != 0 and embedding(torch.tensor([[3, 5]])).dtype == torch.float32


@kernels
def test_compact_weights_with_float32_compute_track_the_float32_model(make_engine, images_dir):
    """bfloat16 weights computing in float32: same tokens as float32 on the tiny model, half the weight bytes,
    the LM head still sharing the embedding's tensor, and float32 activations."""
    request = ChatRequest(prompt="Describe", images=(images_dir / "chelsea.png",), max_new_tokens=6)
    reference = make_engine()
    compact = make_engine(dtype="bfloat16", compute_dtype="float32")
    model = compact.loaded.model
    assert isinstance(model.lm_head, Bf16Linear) and isinstance(model.get_input_embeddings(), Bf16Embedding)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert isinstance(model.model.visual.blocks[0].mlp.linear_fc1, Bf16Linear)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # norms, convolution, position tables
    assert compact.loaded.weight_bytes < 0.6 * reference.loaded.weight_bytes
    assert compact.ask(request).text == reference.ask(request).text


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_auto_compute_dtype_follows_the_measured_probe(make_engine, monkeypatch, bf16_faster):
    monkeypatch.setattr("engine.model.loading.bfloat16_matmul_is_faster", lambda threads: bf16_faster)
    expected = "bfloat16" if bf16_faster else "float32"
    engine = make_engine(dtype="bfloat16")
    assert engine.info.compute_dtype == expected
    assert isinstance(engine.loaded.model.lm_head, Bf16Linear) is (not bf16_faster)
    assert make_engine().info.compute_dtype == "float32"  # float32 weights never compute in bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@kernels
def test_single_query_attention_matches_sdpa(dtype):
    """The decode step's attention (grouped-query, with and without a mask) against transformers' sdpa path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.kernels.attention import single_query_attention

    class Layer:
        num_key_value_groups, is_causal = 2, True

    torch.manual_seed(0)
    query, key, value = torch.randn(1, 16, 1, 128), torch.randn(1, 8, 250, 128), torch.randn(1, 8, 250, 128)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    mask = torch.ones(1, 1, 1, 250, dtype=torch.bool)
    mask[..., 200:] = False
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        for attention_mask in (None, mask):
            expected, _ = sdpa_attention_forward(Layer(), query, key, value, attention_mask, scaling=128 ** -0.5)
            got = single_query_attention(query, key, value, attention_mask, 128 ** -0.5, groups=2)
            assert got.shape == expected.shape == (1, 1, 16, 128)
            assert torch.allclose(got.float(), expected.float(), atol=tolerance)
