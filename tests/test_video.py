"""Video clips, made here at test time with PyAV: every container read from its header and sampled by seeking, bad
and extreme clips refused before decoding or read within bounds, the prompt and positions as Qwen3-VL's processor
and model make them, and a clip asked about through the engine."""
from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch

from engine import ChatRequest, InvalidVideo, Turn
from engine.config import EngineConfig
from engine.inputs.preprocess import image_grids, patchify_images, tokenize_prompt, video_text
from engine.inputs.video import MAX_TOKENS_PER_PATCH, decode_frames, plan_frames, read_video_header
from engine.model.generate import as_pictures, prompt_positions
from engine.model.loading import load_model
from engine.records.stages import FRAME_DECODE, VIDEO_PROBE
from samples.clip import CLIP_FORMATS, make_clip

from .conftest import ROOT

LIMITS = dict(max_bytes=50 * 1024 * 1024, max_seconds=3600, max_pixels=3840 * 2160 * 2)


def header_of(path, **limits):
    return read_video_header(path, **(LIMITS | limits))


@pytest.mark.parametrize("kind", sorted(CLIP_FORMATS))
def test_each_container_is_read_from_its_header_and_sampled_by_seeking(tmp_path, kind):
    path = make_clip(tmp_path / f"clip.{kind.split('-')[0]}", kind, seconds=4.0, fps=10, size=(320, 240))
    header = header_of(path)
    assert header.size == (320, 240) and header.duration_s == pytest.approx(4.0, abs=0.2)
    assert header.fps == pytest.approx(10) and header.frames == pytest.approx(40, abs=2)
    plan = plan_frames(header, 2.0, 2048)
    assert len(plan.frame_times) == 8 and plan.size[0] % 32 == 0 and plan.size[1] % 32 == 0
    clip = decode_frames(header, plan)
    assert len(clip.frames) == 8 and all(frame.size == plan.size for frame in clip.frames)
    # each sampled frame is the one at its time: the square moves right and the blue level climbs frame by frame
    blues = [np.asarray(frame)[..., 2].mean() for frame in clip.frames]
    assert all(later > earlier for earlier, later in zip(blues, blues[1:]))


def test_frame_times_and_sizes_follow_qwen_vl_utils(tmp_path):
    """qwen-vl-utils: frames at `fps` over the clip, an even count of 4 to 768, indices torch.linspace(0, n-1).round();
    each pair of frames between 128 and 768 tokens; the pair's timestamp is the mean of its frames' times."""
    header = header_of(make_clip(tmp_path / "clip.mp4", seconds=4.0, fps=10))
    plan = plan_frames(header, 2.0, 8192)
    indices = torch.linspace(0, header.frames - 1, 8).round().long().tolist()
    assert plan.frame_times == pytest.approx([index / header.fps for index in indices])
    assert plan.patch_times == pytest.approx([(indices[i] + indices[i + 1]) / 2 / header.fps for i in range(0, 8, 2)])
    assert 128 <= plan.tokens_per_patch <= MAX_TOKENS_PER_PATCH  # 320x240 is scaled up to 128 tokens at least
    # a budget that holds fewer pairs than the rate asks for: fewer frames, 128 tokens a pair at least
    tight = plan_frames(header, 2.0, 256)
    assert len(tight.frame_times) == 4 and tight.tokens <= 256
    assert len(plan_frames(header, 0.5, 8192).frame_times) == 4  # two frames asked, four at least
    assert len(plan_frames(header, 2.0, 8192, max_frames=5).frame_times) == 4  # an even count


def test_the_prompt_writes_a_clip_as_qwen3_vl_s_processor_does(tiny_model, tmp_path):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    header = header_of(make_clip(tmp_path / "clip.mp4", seconds=6.0, fps=10, size=(320, 240)))
    plan = plan_frames(header, 2.0, 2048)
    width, height = plan.size
    indices = [round(t * header.fps) for t in plan.frame_times]
    processor = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                                vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                                video_token="<|video_pad|>")
    processor._calculate_timestamps = lambda *args: Qwen3VLProcessor._calculate_timestamps(processor, *args)
    grid = torch.tensor([[len(indices) // 2, height // 16, width // 16]])
    metadata = VideoMetadata(total_num_frames=header.frames, fps=header.fps, frames_indices=indices)
    expected = Qwen3VLProcessor.replace_video_token(processor, {"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    assert video_text(plan) == expected

    loaded = load_model(EngineConfig(model=str(tiny_model), warmup=False, compile="off"))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    prompt = tokenize_prompt(loaded.tokenizer, messages, [], loaded.image_token_id, videos=[plan],
                             video_token_id=loaded.video_token_id)
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    reference = loaded.tokenizer(text.replace("<|vision_start|><|video_pad|><|vision_end|>", expected),
                                 add_special_tokens=False)["input_ids"]
    assert prompt.input_ids[0].tolist() == reference
    assert int((prompt.mm_token_type_ids == 2).sum()) == plan.tokens == int((prompt.input_ids == 151656).sum())

    # Positions: the model's own rope index for the clip (video ids, one grid of all pairs) is the one the engine
    # computes with each pair as a picture.
    model = loaded.model
    reference_positions, reference_delta = model.model.get_rope_index(
        prompt.input_ids, mm_token_type_ids=prompt.mm_token_type_ids, video_grid_thw=grid)
    positions, delta = prompt_positions(model, prompt, image_grids([plan.size] * len(plan.patch_times)))
    assert torch.equal(positions[1:], reference_positions) and delta == int(reference_delta.view(-1)[0])

    # The tower and the language model: the clip given as a video and as pictures gives the same logits.
    clip = decode_frames(header, plan)
    pairs = [(clip.frames[i], clip.frames[i + 1]) for i in range(0, len(clip.frames), 2)]
    patches = patchify_images(loaded.image_processor, pairs, [plan.size] * len(pairs))
    with torch.no_grad():
        as_video = model(input_ids=prompt.input_ids, mm_token_type_ids=prompt.mm_token_type_ids,
                         pixel_values_videos=patches.pixel_values, video_grid_thw=grid).logits
        ids, types = as_pictures(model, prompt.input_ids, prompt.mm_token_type_ids)
        as_pictures_logits = model(input_ids=ids, mm_token_type_ids=types, pixel_values=patches.pixel_values,
                                   image_grid_thw=patches.image_grid_thw).logits
    assert torch.allclose(as_video, as_pictures_logits, atol=1e-5)


def test_a_pair_of_frames_is_one_temporal_patch_of_both(images_dir, tiny_model):
    from PIL import Image

    loaded = load_model(EngineConfig(model=str(tiny_model), warmup=False, compile="off"))
    first = Image.open(images_dir / "coffee.png").convert("RGB").resize((320, 224))
    second = Image.open(images_dir / "rocket.jpg").convert("RGB").resize((320, 224))
    pair = patchify_images(loaded.image_processor, [(first, second)], [(320, 224)]).pixel_values
    alone = [patchify_images(loaded.image_processor, [picture], [(320, 224)]).pixel_values for picture in (first, second)]
    frames = pair.view(pair.shape[0], 3, 2, -1)
    assert torch.equal(frames[:, :, 0], alone[0].view(pair.shape[0], 3, 2, -1)[:, :, 0])
    assert torch.equal(frames[:, :, 1], alone[1].view(pair.shape[0], 3, 2, -1)[:, :, 1])
    same = patchify_images(loaded.image_processor, [(first, first)], [(320, 224)]).pixel_values
    assert torch.equal(same, alone[0])  # a picture is a pair of itself


def test_bad_clips_are_refused_with_a_reason_before_any_frame_is_decoded(tmp_path):
    good = make_clip(tmp_path / "clip.mp4", seconds=2.0)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    notes = tmp_path / "notes.mp4"
    notes.write_text("not a video at all")
    audio_only = tmp_path / "voice.mp4"
    with av.open(str(audio_only), "w") as output:
        stream = output.add_stream("aac", rate=48000)
        for _ in range(20):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 48000
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    empty = tmp_path / "empty.mkv"  # a video stream declared, no frame written
    with av.open(str(empty), "w", format="matroska") as output:
        stream = output.add_stream("libx264", rate=10)
        stream.width, stream.height = 64, 48
        output.start_encoding()
    for path, reason in [(notes, "not a video"), (audio_only, "no video stream (it holds audio)"),
                         (empty, "ends before its first frame")]:
        with pytest.raises(InvalidVideo, match=reason.replace("(", r"\(").replace(")", r"\)")):
            header_of(path)
    # a clip cut short is refused from its header, or read with the frames it still holds
    try:
        clip = decode_frames(header := header_of(cut), plan_frames(header, 2.0, 2048))
        assert len(clip.frames) == len(clip.plan.frame_times)
    except InvalidVideo as exc:
        assert cut.name in exc.message
    with pytest.raises(InvalidVideo, match="over the 1.0 s limit"):
        header_of(good, max_seconds=1.0)
    with pytest.raises(InvalidVideo, match="over the 0 megapixel limit"):
        header_of(good, max_pixels=1000)
    with pytest.raises(InvalidVideo, match="over the 0 MB limit"):
        header_of(good, max_bytes=1000)


def test_one_frame_is_read_as_the_smallest_clip(tmp_path):
    header = header_of(make_clip(tmp_path / "one.mp4", seconds=0.1, fps=10))
    assert header.frames == 1
    clip = decode_frames(header, plan := plan_frames(header, 2.0, 2048))
    assert len(plan.frame_times) == 4 and len(clip.frames) == 4  # four frames at the least, all the one there is


def test_a_4k_clip_is_sampled_down_within_the_budget(tmp_path):
    header = header_of(make_clip(tmp_path / "4k.mp4", seconds=1.0, fps=4, size=(3840, 2160)))
    plan = plan_frames(header, 2.0, 2048)
    clip = decode_frames(header, plan)
    assert plan.tokens <= 2048 and plan.tokens_per_patch <= MAX_TOKENS_PER_PATCH
    assert clip.frames[0].size == plan.size and plan.size[0] < 3840 and plan.size[0] / plan.size[1] == \
        pytest.approx(16 / 9, rel=0.05)


def test_an_hour_long_clip_is_sampled_in_bounded_time_or_refused_from_its_header(tmp_path):
    path = make_clip(tmp_path / "hour.mp4", seconds=3600, fps=1, size=(64, 48))
    started = time.perf_counter()
    with pytest.raises(InvalidVideo, match="1 hour|60 min 0 s long"):
        header_of(path, max_seconds=600)
    assert time.perf_counter() - started < 1.0  # refused from the header: nothing decoded
    header = header_of(path)
    plan = plan_frames(header, 2.0, 2048)
    started = time.perf_counter()
    clip = decode_frames(header, plan)
    # 2,048 tokens hold 16 pairs of 128: 32 frames sought across the hour, not 7,200 decoded
    assert len(clip.frames) == 32 and time.perf_counter() - started < 10
    assert plan.frame_times[-1] > 3500


def test_the_engine_answers_about_a_clip_and_reuses_it_for_a_follow_up(make_engine, tmp_path):
    path = make_clip(tmp_path / "clip.webm", "webm", seconds=3.0, fps=10)
    engine = make_engine()
    first = engine.ask(ChatRequest("What happens in this clip?", videos=(str(path),), max_new_tokens=3))
    metrics = first.metrics
    assert metrics.status == "ok" and metrics.vision_tokens == 3 * 140  # 3 s at 2 a second: 6 frames, 3 pairs of 448x320
    assert metrics.stages[VIDEO_PROBE] > 0 and metrics.stages[FRAME_DECODE] > 0
    history = (Turn("user", "What happens in this clip?", videos=(str(path),)), Turn("assistant", first.text))
    follow_up = engine.ask(ChatRequest("And at the end?", history=history, max_new_tokens=3))
    assert follow_up.metrics.cached_prompt_tokens > metrics.vision_tokens  # the clip was not encoded again
    with pytest.raises(InvalidVideo, match="at most 2"):
        engine.ask(ChatRequest("Three?", videos=(str(path),) * 3, max_new_tokens=1))
    with pytest.raises(InvalidVideo, match="fps must be"):
        engine.ask(ChatRequest("Too fast?", videos=(str(path),), video_fps=100, max_new_tokens=1))


def test_check_images_gives_each_clip_a_verdict(tmp_path):
    good = make_clip(tmp_path / "clip.mkv", "mkv", seconds=2.0)
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"\x00" * 1000)
    run = subprocess.run([sys.executable, "-m", "engine", "check-images", str(good), str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    verdicts = [__import__("json").loads(line) for line in run.stdout.splitlines()]
    assert run.returncode == 2
    assert verdicts[0]["ok"] and verdicts[0]["kind"] == "video" and verdicts[0]["frames_sampled"] == 4
    assert not verdicts[1]["ok"] and "not a video" in verdicts[1]["error"]


def test_the_api_takes_a_clip_as_vllm_does(tiny_model, tmp_path):
    """`video_url` parts with a data: URL, fps and frame limits in vLLM's spellings, usage counting the clip's
    tokens; a bad clip gets a 400 with its code and is recorded without its body."""
    import base64

    import openai

    from engine import MetricsStore

    from .test_api import start_server

    clip = make_clip(tmp_path / "clip.mp4", seconds=3.0, fps=10)
    url_of = lambda data: "data:video/mp4;base64," + base64.b64encode(data).decode()  # noqa: E731
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def ask(data: bytes, **extra):
            return client.chat.completions.create(
                model=model, max_tokens=2, extra_body=extra,
                messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url_of(data)}},
                                                       {"type": "text", "text": "What happens?"}]}])

        answer = ask(clip.read_bytes())
        metrics = answer.model_extra["metrics"]
        assert metrics["vision_tokens"] == 3 * 140 and answer.usage.prompt_tokens > metrics["vision_tokens"]
        assert metrics["stages"]["frame_decode"] > 0
        slower = ask(clip.read_bytes(), mm_processor_kwargs={"fps": 1.0}, media_io_kwargs={"video": {"num_frames": 4}})
        assert slower.model_extra["metrics"]["vision_tokens"] == 2 * 140  # 4 frames, two pairs
        for data, extra, code in [(b"not a clip", {}, "invalid_video"),
                                  (clip.read_bytes(), {"mm_processor_kwargs": {"fps": 99}}, "invalid_value"),
                                  (clip.read_bytes(), {"mm_processor_kwargs": {"size": 4}}, "unsupported_parameter")]:
            with pytest.raises(openai.BadRequestError) as refused:
                ask(data, **extra)
            assert refused.value.code == code
        records = MetricsStore(tmp_path / "api.db").recent(10, include_warmup=False)
        (record,) = [r for r in records if r.error_type == "invalid_video"]
        assert record.status == "refused" and record.prompt is None and "not a video" in record.error
    finally:
        process.terminate()
        process.wait(20)


def test_bench_video_times_the_clip_s_stages_per_precision(tiny_model, tmp_path):
    out = tmp_path / "video.md"
    run = subprocess.run([sys.executable, "-m", "bench.video", "--model", str(tiny_model), "--dtypes", "float32",
                          "--seconds", "2", "--size", "96", "--tokens", "2", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = __import__("json").loads(out.with_suffix(".json").read_text())
    assert row["vision_tokens"] == 2 * 144 and row["ttft_s"] > 0  # 4 frames: 2 pairs of 384x384, up to 128 tokens or more
    assert all(row["stages"][stage] > 0 for stage in ("video_probe", "frame_decode", "vision_encode", "prefill"))
    assert "| float32 | float32 |" in out.read_text()


def test_a_clip_batches_beside_a_picture_and_cancels_as_one_does(make_engine, images_dir, tmp_path):
    """A clip's answer decodes in the same steps as a picture's, gives the tokens it gives alone, and a cancelled
    clip request ends within a step."""
    from engine import RequestMetrics, TextChunk

    path = make_clip(tmp_path / "clip.mov", "mov", seconds=2.0, fps=10)
    engine = make_engine()
    about_clip = ChatRequest("Describe the clip", videos=(str(path),), max_new_tokens=12, ignore_eos=True)
    alone = engine.ask(about_clip)
    long_one = engine.submit(ChatRequest("A long story about it", videos=(str(path),), max_new_tokens=5000,
                                         ignore_eos=True))
    beside = engine.submit(about_clip)
    picture = engine.submit(ChatRequest("And this?", images=(images_dir / "chelsea.png",), max_new_tokens=12,
                                        ignore_eos=True))
    events = long_one.events()
    next(event for event in events if isinstance(event, TextChunk))

    def finish(handle):
        stream = list(handle.events())
        return "".join(e.text for e in stream if isinstance(e, TextChunk)), stream[-1]

    text, metrics = finish(beside)
    assert text == alone.text and max(metrics.decode_batch_sizes) >= 2  # it shared steps, and said the same
    assert finish(picture)[1].status == "ok"
    cancelled_at = time.perf_counter()
    long_one.cancel()
    last = [event for event in events if isinstance(event, RequestMetrics)][0]
    assert last.status == "cancelled" and time.perf_counter() - cancelled_at < 2.0
