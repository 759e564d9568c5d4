"""The model on a tiny Qwen3-VL: parity with transformers, each precision, compiled decode, chunked prefill, loading
and freeing, huge pages."""
from __future__ import annotations

import mmap

import pytest
import torch
from PIL import Image

from engine import ChatRequest, Engine, EngineConfig, ModelUnavailable
from engine.core.sampling import Sampler
from engine.inputs.images import load_image
from engine.inputs.limits import fit_to_budget
from engine.inputs.preprocess import chat_messages, patchify_images, tokenize_prompt
from engine.kernels.decode_attention import best as best_attention
from engine.kernels.int4 import Int4Linear
from engine.kernels.packing import PackedLinear, keeps_fp16_copy
from engine.kernels.quantize import (
    Int8Linear,
    has_int8_dot_product,
    int8_vision_is_faster,
)
from engine.model.generate import decode_one_token, encode_images, prefill
from engine.model.loading import load_model

# Tests of the kernels a CPU may or may not have: tests/test_isa.py runs them again under AVX2-only dispatch.
kernels = pytest.mark.kernels


@pytest.mark.parametrize("kv_cache", [True, False])
def test_stage_loop_matches_transformers_generate(tiny_model, images_dir, kv_cache):
    loaded = load_model(EngineConfig(model=str(tiny_model)))
    image = load_image(images_dir / "coffee.png", max_pixels=10**8, max_bytes=10**8).image
    sizes = [fit_to_budget(*image.size, 64 * 1024, 1024 * 1024)]
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages((), "Describe", [1]), sizes, loaded.image_token_id)
    patches = patchify_images(loaded.image_processor, [image], sizes)
    with torch.inference_mode():
        vision = encode_images(loaded.model, patches)
        logits, state = prefill(loaded.model, prompt, vision, patches.image_grid_thw, kv_cache)
        ours = [Sampler()(logits)]
        for _ in range(11):
            ours.append(Sampler()(decode_one_token(loaded.model, state, ours[-1])))
        reference = loaded.model.generate(
            input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
            mm_token_type_ids=prompt.mm_token_type_ids, pixel_values=patches.pixel_values,
            image_grid_thw=patches.image_grid_thw, max_new_tokens=12, do_sample=False, eos_token_id=None,
        )
    assert ours == reference[0, prompt.input_ids.shape[1]:].tolist()


def test_bf16_int8_int4_and_no_kv_cache_run(make_engine, images_dir):
    request = ChatRequest(prompt="Describe", images=(images_dir / "chelsea.png",), max_new_tokens=6)
    for settings in (dict(dtype="bfloat16", compute_dtype="bfloat16"), dict(dtype="bfloat16", compute_dtype="float32"),
                     dict(dtype="int8", compute_dtype="bfloat16"), dict(dtype="int8", compute_dtype="float32"),
                     dict(dtype="int4", compute_dtype="bfloat16"), dict(dtype="int4", compute_dtype="float32"),
                     dict(kv_cache=False)):
        engine = make_engine(**settings)
        metrics = engine.ask(request).metrics
        assert metrics.status == "ok" and metrics.output_tokens == 6, settings
        assert metrics.dtype == engine.config.dtype and metrics.kv_cache == engine.config.kv_cache
        assert metrics.compute_dtype == settings.get("compute_dtype", "float32") == engine.info.compute_dtype
    int8_engine, plain = make_engine(dtype="int8"), make_engine().loaded
    int8 = int8_engine.loaded
    layer = int8.model.model.language_model.layers[0].mlp.gate_up_proj.linear
    assert isinstance(layer, Int8Linear) and layer.packed_nbytes == layer.in_features * layer.out_features
    assert isinstance(int8.model.lm_head, Int8Linear)
    assert int8.weight_bytes < plain.weight_bytes
    int4 = make_engine(dtype="int4").loaded
    layer = int4.model.model.language_model.layers[0].mlp.gate_up_proj.linear
    weights = layer.in_features * layer.out_features  # two a byte, and a float16 scale and offset a group
    assert isinstance(layer, Int4Linear) and layer.packed.numel() == weights // 2 + weights // layer.group * 4
    assert int4.decode_weight_bytes < int8.decode_weight_bytes
    # the vision tower goes int8 too where this CPU's int8 products beat its matmuls (measured at load)
    vision = int8.model.model.visual.blocks[0].mlp.linear_fc1
    quick = has_int8_dot_product() and int8_vision_is_faster(int8_engine.config.threads, int8.compute_dtype)
    assert isinstance(vision, Int8Linear) == quick


def test_skeleton_folder_loads_synthetic_weights(make_engine, tiny_skeleton):
    engine = make_engine(model=str(tiny_skeleton))
    assert engine.info.synthetic
    metrics = engine.ask(ChatRequest(prompt="Hi", max_new_tokens=3)).metrics
    assert metrics.synthetic and metrics.status == "ok"
    weights = engine.loaded.model.model.language_model.layers[0].mlp.gate_up_proj.linear.unpacked()
    assert torch.isfinite(weights).all() and weights.std() > 0  # filled, not left as garbage or zeros


def test_missing_model_gives_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ModelUnavailable, match="does not exist"):
        load_model(EngineConfig(model=str(tmp_path / "nowhere")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailable, match="synthetic skeleton"):
        load_model(EngineConfig(model="Qwen/Qwen3-VL-2B-Instruct-not-cached"))


def test_compiled_decode_step_gives_the_eager_tokens(make_engine, images_dir):
    """The compiled direct step against the eager one (float32: inductor's GEMM templates on frozen weights): the
    same greedy answer, and a follow-up that reuses the conversation's cache (handed back by the step) gives the
    same answer too."""
    from engine.request import Turn

    image = images_dir / "coffee.png"
    from torch._dynamo.utils import counters

    answers = {}
    for mode in ("on", "off"):
        graphs = counters["stats"]["unique_graphs"]
        engine = make_engine(compile=mode, dtype="float32", draft="off")  # a token a step either way
        first = engine.ask(ChatRequest(prompt="Describe", images=(image,), max_new_tokens=12, ignore_eos=True))
        follow_up = engine.ask(ChatRequest(prompt="More", history=(Turn("user", "Describe", (image,)),
                                                                   Turn("assistant", first.text)),
                                           max_new_tokens=12, ignore_eos=True))
        assert follow_up.metrics.cached_prompt_tokens > 0
        answers[mode] = (first.text, follow_up.text, engine.info.decode)
        # One graph per segment, compiled at load: a real step that recompiled would run without freezing.
        layers = len(engine.loaded.model.model.language_model.layers)
        assert counters["stats"]["unique_graphs"] - graphs == (layers + 1 if mode == "on" else 0)
        engine.close()
    assert answers["on"][2].startswith("compiled decode step"), answers["on"][2]
    assert answers["off"][2] == (f"direct decode step; eager decode (compilation off); one token a step (drafting "
                                 f"off); {best_attention()[1]}")
    assert answers["on"][:2] == answers["off"][:2]


@kernels
def test_auto_compile_keeps_float32_eager_and_says_why(make_engine):
    engine = make_engine(compile="auto")  # float32: the frozen copy does not fit beside the eager weights
    assert engine.info.decode.startswith("direct decode step; eager decode: float32 weights")
    assert engine.ask(ChatRequest(prompt="Hi", max_new_tokens=3)).metrics.status == "ok"


@kernels
def test_auto_compile_leaves_bfloat16_on_float16_products(make_engine):
    """bfloat16 under auto decodes eager on fbgemm's float16 copy of the language model's weights (as fast as the
    compiled step, no compile at load); the vision tower, which never runs one row, has none. Where oneDNN cannot
    pack bfloat16 (no AVX-512 BW/VL/DQ or AVX-NE-CONVERT) there is no copy: auto measures the compiled step against
    eager at load and keeps the faster, saying which and why."""
    if not keeps_fp16_copy("bfloat16"):
        engine = make_engine(compile="auto", dtype="bfloat16", compute_dtype="bfloat16")
        assert engine.info.decode.startswith(("compiled decode step (", "direct decode step; eager decode: measured",
                                              "direct decode step; eager decode: the compiled step")), engine.info
        assert getattr(engine.loaded.model.lm_head, "one_row_dtype", None) is None
        assert any("oneDNN cannot pack bfloat16" in note for note in engine.info.notes), engine.info.notes
        assert engine.ask(ChatRequest(prompt="Hi", max_new_tokens=3)).metrics.status == "ok"
        return
    engine = make_engine(compile="auto", dtype="bfloat16", compute_dtype="bfloat16")
    assert "fbgemm's float16 copy" in engine.info.decode, engine.info.decode
    model = engine.loaded.model
    assert model.lm_head.one_row_dtype == torch.float32
    assert model.model.language_model.layers[0].mlp.down_proj.one_row_dtype == torch.float32
    assert all(module.one_row_dtype is None for module in model.model.visual.modules()
               if isinstance(module, PackedLinear))
    # Decode reads one copy of each weight: the bandwidth figures count it once.
    plain = make_engine(compile="auto", dtype="bfloat16", compute_dtype="bfloat16", kernels="plain").loaded
    assert engine.loaded.decode_weight_bytes == plain.decode_weight_bytes
    assert engine.ask(ChatRequest(prompt="Hi", max_new_tokens=3)).metrics.status == "ok"


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_a_closed_engine_frees_its_model(tiny_model, tmp_path, images_dir, compile_mode):
    """Settings changes and the bench load one model after another: nothing may keep the last one alive (the compute
    thread once held its last task, and with it the engine, until the next task came)."""
    import gc
    import weakref

    def live_tensor_bytes() -> int:
        gc.collect()
        from torch._subclasses.fake_tensor import FakeTensor

        return sum(o.untyped_storage().nbytes() for o in gc.get_objects() if isinstance(o, torch.Tensor)
                   and not isinstance(o, FakeTensor) and o.layout == torch.strided and not o.is_meta)

    before = live_tensor_bytes()
    engine = Engine(EngineConfig(model=str(tiny_model), db_path=str(tmp_path / "m.db"), warmup=False,
                                 compile=compile_mode))
    engine.ask(ChatRequest(prompt="Describe", images=(images_dir / "chelsea.png",), max_new_tokens=2))
    model = weakref.ref(engine.loaded.model)
    assert engine.decode_step.compiled == (compile_mode == "on")
    engine.close()
    del engine
    gc.collect()
    assert model() is None
    # Nor any copy of its weights (the compiled step's frozen ones lived on in inductor's generated module).
    assert live_tensor_bytes() - before < 1 << 20


def _kernel_can_collapse() -> bool:
    import platform
    import re

    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    version = re.match(r"(\d+)\.(\d+)", platform.release())
    return "[never]" not in mode and version is not None and tuple(map(int, version.groups())) >= (6, 1)


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            low, high = (int(value, 16) for value in fields[0].split("-"))
            inside = low <= address < high
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    return 0


@pytest.mark.skipif(not _kernel_can_collapse(), reason="needs Linux 6.1+ with transparent huge pages not 'never'")
def test_large_regions_move_onto_huge_pages():
    """Weights are read once a token: on 2 MB pages rather than 4 KB ones (docs/decisions.md, "Huge pages after load", has the figures)."""
    from engine.model.memory_pages import back_with_huge_pages, huge_page_bytes

    # A mapping of its own, touched: on 4 KB pages unless THP is "always" (memory from the allocator may be a range
    # that an earlier test in this process already moved onto huge pages)
    region = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    weights = torch.frombuffer(region, dtype=torch.uint8)
    weights.fill_(1)
    middle = weights.data_ptr() + (32 << 20)
    if "[madvise]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
        assert _huge_bytes_at(middle) < 32 << 20
        back_with_huge_pages(budget_s=0)  # out of time before the first piece: nothing moves
        assert _huge_bytes_at(middle) < 32 << 20
    # The whole test process, whatever its size: the budget is for one model's load.
    assert back_with_huge_pages(budget_s=300) == huge_page_bytes()
    assert _huge_bytes_at(middle) >= 32 << 20
    assert int(weights.sum()) == 64 << 20  # the contents moved with it


def test_a_prefill_in_chunks_is_the_prefill_in_one_piece(tiny_model, images_dir):
    """Chunks of a picture's prompt, each with its slice of the vision tokens (two images, so a chunk holds the end
    of one and the start of the next), give the one-piece prefill's next token and, within float32 rounding, its
    logits and cache; the prefill pauses between chunks."""
    from engine.inputs.preprocess import image_grids
    from engine.model.generate import ChunkedPrefill

    loaded = load_model(EngineConfig(model=str(tiny_model), compile="off", warmup=False))
    pictures = [Image.open(images_dir / name).convert("RGB") for name in ("coffee.png", "chelsea.png")]
    config = EngineConfig()
    sizes = [fit_to_budget(*picture.size, config.min_pixels, config.max_pixels) for picture in pictures]
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages([], "Compare them.", [2]), sizes, loaded.image_token_id)
    with torch.inference_mode():
        vision = encode_images(loaded.model, patchify_images(loaded.image_processor, pictures, sizes))
        whole_logits, whole = prefill(loaded.model, prompt, vision, image_grids(sizes), True)
        chunked, pauses = ChunkedPrefill(loaded.model, prompt, vision, image_grids(sizes), True), 0
        while not chunked.run(16):
            pauses += 1
        logits, state = chunked.logits, chunked.state
    length = prompt.input_ids.shape[1]
    assert pauses == (length + 15) // 16 - 1 >= 3
    assert int(logits.argmax()) == int(whole_logits.argmax())
    torch.testing.assert_close(logits, whole_logits, atol=1e-4, rtol=1e-4)
    for got, want in zip(state.cache.layers, whole.cache.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=1e-4)
