"""The Streamlit pages through AppTest, against the tiny model: real engine, real database, no mocks."""
from __future__ import annotations

import json
import re

import pytest
from streamlit.testing.v1 import AppTest

from engine import ChatRequest, MetricsStore, TextChunk

from server.slot import shutdown

from .conftest import ROOT

APP = str(ROOT / "streamlit_app.py")


@pytest.fixture
def app_env(tiny_model, tmp_path, monkeypatch):
    for key in ("VLSCOPE_MAX_INPUT_TOKENS", "VLSCOPE_MAX_QUEUE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLSCOPE_MODEL", str(tiny_model))
    monkeypatch.setenv("VLSCOPE_DB", str(tmp_path / "app.db"))
    monkeypatch.setenv("VLSCOPE_MAX_NEW_TOKENS", "12")
    shutdown()  # one engine per test, built from this test's settings
    yield tmp_path / "app.db"
    shutdown()


def start() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def ask(at: AppTest, text: str) -> AppTest:
    at.chat_input(key="chat_prompt").set_value(text)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def assistant_messages(at: AppTest):
    return [m for m in at.chat_message if m.name == "assistant"]


def test_sample_image_question_streams_an_answer_with_stats(app_env):
    at = start()
    assert "Synthetic weights" not in " ".join(w.value for w in at.sidebar.warning)  # the tiny model has weights
    at.selectbox(key="sample_image").set_value("page.png").run()
    # before sending: the seconds it will take, from this server's answers (the tiny model has no record)
    (estimate,) = [c.value for c in at.caption if c.value.startswith("Next question:")]
    assert "s to the first word" in estimate and "this server's last answers" in estimate
    assert at.chat_input(key="chat_prompt").proto.placeholder == "Ask about the picture page.png"
    ask(at, "Read the text")
    (answer,) = assistant_messages(at)
    assert answer.markdown[0].value.strip()
    stats = answer.caption[0].value
    assert "TTFT" in stats and "tok/s" in stats and "vision tokens" in stats and "peak RSS" in stats
    record = MetricsStore(app_env).recent(1, include_warmup=False)[0]
    assert record.source == "app" and record.status == "ok" and record.vision_tokens > 0
    assert f"{record.vision_tokens} vision tokens" in stats


def test_enhance_for_ocr_shows_the_enhanced_picture_and_times_its_stage(app_env):
    at = start()
    at.selectbox(key="sample_image").set_value("page.png").run()
    assert not at.expander  # nothing to show before the toggle
    at.toggle(key="enhance_ocr").set_value(True).run()
    (shown,) = [e for e in at.expander if "Enhance for OCR" in e.label]
    assert len(shown.get("image")) == 2  # as sent, and enhanced
    ask(at, "Read the text")
    record = MetricsStore(app_env).recent(1, include_warmup=False)[0]
    assert record.status == "ok" and record.stages["ocr_enhance"] > 0


def test_a_clip_shows_its_sampled_frames_and_cost_then_is_asked_about(app_env):
    from ui.clips import SAMPLE_CLIP

    at = start()
    at.selectbox(key="sample_image").set_value(SAMPLE_CLIP).run()
    assert not at.exception, [e.value for e in at.exception]
    cost = next(c.value for c in at.caption if "vision tokens" in c.value and "frames a second" in c.value)
    assert "6.0 s at 2 frames a second: 12 frames in 6 pairs" in cost
    captions = [picture.caption for image in at.get("image") for picture in image.proto.imgs]
    times = [caption for caption in captions if caption.endswith(" s")]
    # 8 of the 12 frames, spread from the first to the last, each with its time
    assert len(times) == 8 and "0.0 s" in times and max(float(time[:-2]) for time in times) > 5
    at.select_slider(key="video_fps").set_value(1.0).run()
    assert any("at 1 frames a second: 6 frames in 3 pairs" in c.value for c in at.caption)
    ask(at, "What happens in this clip?")
    (answer,) = assistant_messages(at)
    assert "frames decoded in" in answer.caption[0].value
    record = MetricsStore(app_env).recent(1, include_warmup=False)[0]
    assert record.status == "ok" and record.stages["frame_decode"] > 0 and record.vision_tokens > 0


def test_upload_then_follow_up_refers_to_the_same_image(app_env, images_dir):
    at = start()
    at.file_uploader(key="image_upload").set_value(("rocket.jpg", (images_dir / "rocket.jpg").read_bytes(), "image/jpeg"))
    at.run()
    ask(at, "What is this?")
    ask(at, "And what colour is it?")
    users = [m for m in at.chat_message if m.name == "user"]
    assert len(users) == 2 and len(users[0].get("image")) == 1 and len(users[1].get("image")) == 0
    assert len(assistant_messages(at)) == 2
    first, second = sorted(MetricsStore(app_env).recent(5, include_warmup=False), key=lambda r: r.submitted_at)
    assert first.image_sizes == second.image_sizes == ((640, 427),)  # the follow-up still sees the image
    assert second.prompt_tokens > first.prompt_tokens


def test_preset_clear_and_transcript(app_env):
    at = start()
    at.selectbox(key="sample_image").set_value("text.png")
    at.selectbox(key="prompt_preset").set_value("OCR").run()
    at.button(key="ask_preset").click().run()
    assert not at.exception
    users = [m for m in at.chat_message if m.name == "user"]
    assert users[0].markdown[0].value == "Extract all visible text line by line."
    assert at.get("download_button")  # the transcript, offered once there is a conversation
    at.button(key="clear_chat").click().run()
    assert len(at.chat_message) == 0


def test_answer_as_json_shows_the_finished_answer_as_json_and_a_bad_schema_as_a_message(app_env):
    at = start()
    at.toggle(key="json_answer").set_value(True).run()
    assert "document_type" in at.text_area(key="json_schema_text_Scanned document").value  # the scans' preset
    small = {"type": "object", "properties": {"paid": {"type": "boolean"}}, "required": ["paid"],
             "additionalProperties": False}
    at.text_area(key="json_schema_text_Scanned document").set_value(json.dumps(small)).run()
    ask(at, "Is it paid?")
    (answer,) = assistant_messages(at)
    assert isinstance(answer.json[0].value, str) and set(json.loads(answer.json[0].value)) == {"paid"}
    assert "grammar" in answer.caption[0].value
    at.text_area(key="json_schema_text_Scanned document").set_value('{"type": "object", "unevaluatedProperties": 1')
    ask(at, "Again")
    assert any("not valid JSON" in e.value for e in at.error) and not at.exception
    assert MetricsStore(app_env).recent(1, include_warmup=False)[0].error_type == "invalid_schema"
    at.switch_page("pages/profiling.py").run()  # the grammar's time is a stage of its own there
    assert not at.exception and any("grammar" in list(frame.value["stage"]) for frame in at.dataframe
                                    if "stage" in frame.value)


def test_bad_image_shows_a_message_not_a_traceback(app_env):
    at = start()
    at.file_uploader(key="image_upload").set_value(("holiday.png", b"this is not a picture", "image/png"))
    at.run()
    assert any("holiday.png: not an image" in e.value for e in at.error)
    ask(at, "Describe")  # the refused file is not sent; the question still gets an answer
    assert not at.exception and assistant_messages(at)
    assert MetricsStore(app_env).recent(1, include_warmup=False)[0].vision_tokens == 0


def test_too_long_prompt_and_busy_queue_are_explained(app_env, monkeypatch):
    monkeypatch.setenv("VLSCOPE_MAX_INPUT_TOKENS", "40")
    monkeypatch.setenv("VLSCOPE_MAX_QUEUE", "0")
    monkeypatch.setenv("VLSCOPE_MAX_BATCH", "1")  # one long answer fills the batch
    at = start()
    at.selectbox(key="sample_image").set_value("coffee.png").run()
    ask(at, "Describe")
    assert any("limit is 40" in e.value for e in at.error)
    from ui.engine_resource import get_engine

    engine = get_engine().engine  # the app's own engine: cached once per process
    holder = engine.submit(ChatRequest(prompt="hold the model", max_new_tokens=5000, ignore_eos=True))
    events = holder.events()
    next(e for e in events if isinstance(e, TextChunk))
    try:
        at.selectbox(key="sample_image").set_value("(none)").run()
        ask(at, "Hi")
        assert any("busy" in e.value for e in at.error)
    finally:
        holder.cancel()
        list(events)


def test_profiling_page_shows_the_new_request(app_env):
    at = start()
    ask(at, "Hello there")
    record = MetricsStore(app_env).recent(1, include_warmup=False)[0]
    at.switch_page("pages/profiling.py").run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["requests"] == "1"  # the warm-up is hidden by default
    assert record.decode_weight_bytes > 0 and record.decode_gb_per_s > 0
    assert metrics["last read GB/s"] == f"{record.decode_gb_per_s:.1f}"
    assert metrics["last decode tok/s"] == f"{record.decode_tokens_per_s:.1f}"
    delta = next(m for m in at.metric if m.label == "last read GB/s").delta
    assert re.fullmatch(r"\d+% of \d+", delta)  # against the measured read ceiling
    charts = at.get("plotly_chart")
    stage_chart = json.loads(charts[0].proto.spec)
    assert any(record.id[:6] in label for trace in stage_chart["data"] for label in trace["x"])
    assert {trace["name"] for trace in stage_chart["data"]} >= {"prefill", "decode"}
    assert at.get("download_button")  # CSV
    at.toggle(key="prof_warmups").set_value(True).run()
    assert {m.label: m.value for m in at.metric}["requests"] == "2"


def test_settings_change_reloads_the_model(app_env):
    at = start()
    at.switch_page("pages/settings.py").run()
    # the chosen precision's agreement with float32, from the benchmark on record or how to measure it: it follows
    # the choice before anything is applied
    assert any(line.value.startswith("float32 is the reference") for line in at.caption)
    at.selectbox(key="set_dtype").set_value("int4").run()
    assert any(line.value.startswith(("int4 picks float32's token", "What int4 costs")) for line in at.caption)
    at.selectbox(key="set_dtype").set_value("bfloat16")
    at.selectbox(key="set_compute_dtype").set_value("float32")
    assert at.number_input(key="set_max_batch").value == 4
    at.number_input(key="set_max_batch").set_value(2)
    at.button(key="apply_settings").click().run()
    assert not at.exception
    at.switch_page("pages/chat.py").run()
    ask(at, "Hi")
    record = MetricsStore(app_env).recent(1, include_warmup=False)[0]
    assert (record.dtype, record.compute_dtype) == ("bfloat16", "float32")
    at = start()  # a new session sees the new settings too
    assert {m.label: m.value for m in at.sidebar.metric}["precision"] == "bfloat16"
    assert any("of 2 answering together" in caption.value for caption in at.sidebar.caption)
    # one plain line for a room; the technical reason waits in an expander
    line = next(caption.value for caption in at.sidebar.caption if caption.value.startswith("Decode: "))
    assert line == "Decode: eager" or (line.startswith("Decode: eager, ") and line.endswith(" tok/s on the last answer"))
    (details,) = [e for e in at.sidebar.expander if e.label == "How decode runs here"]
    assert any("direct decode step" in caption.value for caption in details.caption)


def test_unreachable_hub_model_falls_back_to_the_skeleton(app_env, tiny_skeleton, monkeypatch):
    monkeypatch.setenv("VLSCOPE_MODEL", "Qwen/Qwen3-VL-2B-Instruct-not-here")
    monkeypatch.setenv("VLSCOPE_FALLBACK_MODEL", str(tiny_skeleton))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLSCOPE_MAX_NEW_TOKENS", "40")
    monkeypatch.setenv("VLSCOPE_SYNTHETIC_MAX_NEW_TOKENS", "6")
    at = start()
    # one short line; the reason and the fix wait in an expander
    (warning,) = [w for w in at.sidebar.warning if "ynthetic" in w.value]
    assert warning.value == "Synthetic weights: answers are noise, latency and memory are real."
    (details,) = [e for e in at.sidebar.expander if e.label.startswith("Why")]
    # one honest sentence: the hub id is what could not load, the skeleton what answers; the fix is on a page
    why = details.caption[0].value
    assert "`Qwen/Qwen3-VL-2B-Instruct-not-here` could not be loaded" in why and "skeleton answers" in why
    assert "Settings page" in why and "--model" not in why and "VLSCOPE_" not in why
    # synthetic answers stop at the lower default, and the page says so before sending
    assert any("answers stop there by default" in c.value for c in at.caption)
    ask(at, "Hi")
    assert assistant_messages(at)
    record = MetricsStore(app_env).recent(1, include_warmup=False)[0]
    assert record.synthetic and record.max_new_tokens == 6 and record.output_tokens <= 6
    at.switch_page("pages/settings.py").run()
    assert at.text_input(key="set_model").value == "Qwen/Qwen3-VL-2B-Instruct-not-here"
    assert why in [c.value for c in at.caption]  # the same sentence beside the model field
    assert any(c.value.startswith("Synthetic weights are loaded: answers stop at 6 tokens") for c in at.caption)


def test_broken_model_folder_offers_a_retry(app_env, tmp_path, monkeypatch):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    monkeypatch.setenv("VLSCOPE_MODEL", str(broken))
    at = start()
    assert any("could not be loaded" in e.value and "config.json" in e.value for e in at.error)
    assert at.button(key="retry_load")
    at.switch_page("pages/profiling.py").run()  # the rest of the app still serves
    assert not at.exception


def test_benchmark_page_runs_a_small_sweep(app_env):
    at = start()
    at.switch_page("pages/benchmark.py").run()
    assert not at.exception
    at.button(key="run_sweep").click().run(timeout=300)
    assert not at.exception
    # first, beside the run button: the sweep against the record at the loaded precision, as ratios; the tiny model
    # is not the one on record, and the page says so
    beside = at.dataframe[0].value
    assert list(beside["case"]) == ["448x448", "multi-turn"]
    assert {"TTFT s", "TTFT x", "tok/s", "tok/s x"} <= set(beside.columns)
    assert (beside["TTFT x"] > 0).all() and (beside["tok/s x"] > 0).all()
    assert any(c.value.startswith("At float32, now / on record, and the ratio") for c in at.caption)
    assert any("compare two models" in c.value for c in at.caption)
    # then the sweep's plots and a table that fits the page; the wide markdown waits in an expander
    charts = at.get("plotly_chart")
    assert charts and "memory-read ceiling" in charts[0].proto.spec  # decode against the measured ceiling
    table = at.dataframe[1].value  # the sweep's, shown above the committed run's
    assert {"multi-turn", "1280x960"} <= set(table["case"]) and "% of read ceiling" in table.columns
    tables = [m.value for m in at.markdown if "| case |" in m.value]
    assert tables and "multi-turn" in tables[0]
    sweep_records = [r for r in MetricsStore(app_env).recent(50) if r.source == "bench"]
    assert len(sweep_records) == 5  # two single questions and a three-turn conversation


def test_metrics_write_failure_is_shown_not_swallowed(app_env):
    import sqlite3

    at = start()
    blocker = sqlite3.connect(app_env, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        ask(at, "Hello")
        assert assistant_messages(at)[0].caption[0].value.startswith("TTFT")  # the answer still arrived
        fresh = start()  # the next page load shows it in the sidebar
        assert any("Metrics are not being saved" in e.value for e in fresh.sidebar.error)
    finally:
        blocker.rollback()
        blocker.close()


def test_a_stopped_answer_keeps_its_stats_line(app_env):
    """Stopping an answer mid-stream keeps the partial text and, once the worker has written the record, shows
    its cost like any other answer's, marked cancelled."""
    from ui.conversation import ChatTurn
    from ui.engine_resource import get_engine

    at = start()
    engine = get_engine().engine
    handle = engine.submit(ChatRequest(prompt="Write a long story", max_new_tokens=5000, ignore_eos=True))
    events = handle.events()
    partial = next(e for e in events if isinstance(e, TextChunk)).text
    handle.cancel()  # what the page's finally does when the user stops the run
    list(events)
    at.session_state["turns"] = [ChatTurn("user", "Write a long story"),
                                 ChatTurn("assistant", partial, request_id=handle.id, stopped=True)]
    at.run()
    assert not at.exception
    (answer,) = assistant_messages(at)
    assert answer.markdown[0].value.endswith("_(stopped)_")
    stats = answer.caption[0].value
    assert "TTFT" in stats and "total" in stats and stats.endswith("cancelled")


def test_concurrency_series_counts_overlapping_answers():
    """Two answers decoding over the same seconds and one alone after: whole counts (two at once, then none, then
    one), and the tokens per second of the pair add up to their own rates."""
    from engine import RequestMetrics
    from ui.charts import asked, concurrency_chart, concurrency_series

    def record(start: float, end: float, tokens: int, **more) -> RequestMetrics:
        return RequestMetrics(id=f"r{start}", status="ok", source="api", warmup=False, submitted_at=start - 1,
                              finished_at=end, model="m", synthetic=True, dtype="int8", threads=2, kv_cache=True,
                              min_pixels=1, max_pixels=2, max_new_tokens=64, temperature=0.0, top_p=1.0,
                              ttft_s=1.0, output_tokens=tokens, decode_tokens_per_s=tokens / (end - start), **more)

    series = concurrency_series([record(100, 110, 100), record(103, 110, 14), record(120, 130, 10)])
    assert list(series["active"]) == [1, 2, 0, 1, 0]
    assert list(series["tokens_per_s"].round(3)) == [10, 12, 0, 1, 0]
    assert series["active"].dtype.kind == "i"  # counts, never averages
    assert [trace.name for trace in concurrency_chart([]).data] == ["answers decoding at once", "tokens/s, all answers"]
    # bars say what was asked: the PDF's pages, a clip, pictures, and the question's first words when stored
    assert asked(record(1, 2, 1, document_pages=({"page": 2}, {"page": 3}))) == "PDF p. 2-3"
    assert asked(record(1, 2, 1, stages={"frame_decode": 0.1}, image_sizes=((8, 8),))) == "clip"
    assert asked(record(1, 2, 1, image_sizes=((8, 8),), prompt="Read the text on this <page> please")) == \
        "picture: Read the text on…"
    assert asked(record(1, 2, 1)) == "text"


def test_a_pdf_upload_picks_its_pages_and_the_answer_names_the_render(app_env, images_dir):
    import hashlib

    from . import pdfs

    data = pdfs.from_images([images_dir / "page.png", images_dir / "text.png", images_dir / "coffee.png"])
    at = start()
    at.file_uploader(key="image_upload").set_value(("scan.pdf", data, "application/pdf"))
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    key = hashlib.sha256(data).hexdigest()[:12]
    assert at.number_input(key=f"first_page_{key}").value == 1 and at.number_input(key=f"last_page_{key}").value == 3
    assert any("pages 1-3 of 3" in caption.value for caption in at.caption)
    at.number_input(key=f"first_page_{key}").set_value(2).run()
    assert any("pages 2-3 of 3" in caption.value for caption in at.caption)
    ask(at, "What do these pages say?")
    (answer,) = assistant_messages(at)
    assert "2 pages rendered in" in answer.caption[0].value
    record = MetricsStore(app_env).recent(1, include_warmup=False)[0]
    assert record.status == "ok" and [page["page"] for page in record.document_pages] == [2, 3]


def test_a_locked_pdf_upload_says_why_and_sends_nothing(app_env):
    from . import pdfs

    at = start()
    at.file_uploader(key="image_upload").set_value(("locked.pdf", pdfs.encrypted(), "application/pdf"))
    at.run()
    assert not at.exception
    assert any("password-protected" in error.value for error in at.error)
