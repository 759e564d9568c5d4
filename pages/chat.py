"""Chat page: pick or upload an image or a PDF, ask, watch the answer stream, see what it cost."""
import json
import logging
import time
from pathlib import Path

import streamlit as st

from engine import InvalidImage, Queued, RequestMetrics, StageProgress, StageStarted, TextChunk, VlscopeError
from engine.inputs.documents import page_tokens
from engine.inputs.images import decode, load_image, read_header
from engine.inputs.ocr import enhance_for_ocr
from engine.records.stages import RUNNING
from ui.engine_resource import get_engine
from ui.conversation import (PRESETS, SCHEMA_PRESETS, ChatTurn, attached_words, build_request, images_to_attach,
                             inert_markdown, parsed_json, stats_line, transcript)
from ui.estimate import estimate_line
from engine.inputs.documents import Document
from ui.clips import SAMPLE_CLIP, Clip, clip_preview, clip_strip, is_clip, sample_clip
from ui.documents import document_of, page_picker, png_thumbnail
from ui.documents import preview as page_preview

log = logging.getLogger(__name__)
SAMPLES = Path(__file__).resolve().parent.parent / "samples"
UPLOAD_TYPES = ["jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "pdf", "mp4", "m4v", "webm", "mov", "mkv"]

st.title("Chat")
loaded = get_engine(show_problems=False)
if loaded is None:
    st.stop()
engine = loaded.engine
turns: list[ChatTurn] = st.session_state.setdefault("turns", [])


@st.cache_data(max_entries=64, show_spinner=False)
def thumbnail(data: bytes, max_pixels: int, max_bytes: int, name: str = "image") -> tuple[bytes | None, str | None]:
    """A PNG preview of an image file, or the reason it is refused: decoded by the engine's own checks, so the
    page never hands the browser a file the model would refuse (nor a TIFF it cannot show)."""
    try:
        picture = load_image(data, max_pixels=max_pixels, max_bytes=max_bytes, name=name).image.copy()
    except InvalidImage as exc:
        return None, exc.message
    return png_thumbnail(picture, 560), None


@st.cache_data(max_entries=64, show_spinner=False)
def picture_tokens(data: bytes, max_pixels: int, max_bytes: int, config) -> int:
    """The vision tokens a picture costs at the loaded budget, from its header alone."""
    try:
        return page_tokens(read_header(data, max_pixels=max_pixels, max_bytes=max_bytes).size, config) - 2
    except InvalidImage:
        return 0


@st.cache_data(max_entries=16, show_spinner="Enhancing for OCR…")
def enhanced_thumbnail(data: bytes, max_pixels: int, max_bytes: int, budget_pixels: int) -> bytes | None:
    """A PNG preview of what Enhance for OCR hands the model: the picture decoded at the size the engine decodes
    it for its token budget, then enhanced (None for a file the engine refuses)."""
    try:
        picture = decode(read_header(data, max_pixels=max_pixels, max_bytes=max_bytes), budget_pixels).image
    except InvalidImage:
        return None
    return png_thumbnail(enhance_for_ocr(picture), 560)


def preview(data: bytes | Document | Clip) -> bytes | None:
    if isinstance(data, Document):
        return page_preview(data, engine.config)
    if isinstance(data, Clip):
        return clip_preview(data, engine.config)
    return thumbnail(data, engine.config.max_image_pixels, engine.config.max_image_bytes)[0]


upload_column, sample_column, option_column = st.columns([3, 2, 2])
uploads = upload_column.file_uploader("Upload images, PDFs or video clips", type=UPLOAD_TYPES,
                                      accept_multiple_files=True, key="image_upload")
sample_names = ["(none)"] + sorted(p.name for p in SAMPLES.iterdir() if p.suffix in (".png", ".jpg")) + [SAMPLE_CLIP]
sample = sample_column.selectbox("…or a sample", sample_names, key="sample_image")
preset = option_column.selectbox("Prompt preset", list(PRESETS), key="prompt_preset")
enhance = option_column.toggle("Enhance for OCR", key="enhance_ocr",
                               help="Find and flatten a photographed page, straighten its lines and turn it into black "
                                    "ink on white, neighbourhood by neighbourhood (a shadow keeps its text), before "
                                    "the model sees it.")
as_json = option_column.toggle("Answer as JSON", key="json_answer",
                               help="The answer is held to a JSON Schema, token by token: it is always valid JSON.")
json_schema = None
if as_json:
    with st.expander("JSON Schema of the answer", expanded=True):
        schema_preset = st.selectbox("Schema preset", list(SCHEMA_PRESETS), key="json_schema_preset")
        json_schema = st.text_area("Schema (editable)", json.dumps(SCHEMA_PRESETS[schema_preset], indent=2),
                                   height=240, key=f"json_schema_text_{schema_preset}")

if uploads:
    picked = [(upload.name, upload.getvalue()) for upload in uploads]
elif sample == SAMPLE_CLIP:
    picked = [(sample, sample_clip())]
elif sample != "(none)":
    picked = [(sample, (SAMPLES / sample).read_bytes())]
else:
    picked = []
video_fps = None
if any(is_clip(name) or name == SAMPLE_CLIP for name, _ in picked):
    video_fps = option_column.select_slider("Clip: frames a second", [0.5, 1.0, 2.0, 4.0],
                                            value=engine.config.video_fps if engine.config.video_fps in
                                            (0.5, 1.0, 2.0, 4.0) else 2.0, key="video_fps")
gallery = st.container()  # a document's pages, as wide as the page
current = []
pieces: list[int] = []  # the vision tokens of each picked picture, page and pair of frames: the estimate's input
for name, data in picked:
    if is_clip(name) or name == SAMPLE_CLIP:
        strip = clip_strip(upload_column, name, data, video_fps, engine.config)
        if strip is not None:
            current.append((name, strip[0]))
            pieces += strip[1]
        continue
    if document_of(data, engine.config.max_image_bytes):
        picked_pages = page_picker(upload_column, gallery, name, data, engine.config)
        if picked_pages is not None:
            document, tokens = picked_pages
            pieces += tokens
            pages = document.pages
            current.append((f"{name}, page{'s' if len(pages) > 1 else ''} {pages[0]}"
                            + (f"-{pages[-1]}" if len(pages) > 1 else ""), document))
        continue
    image, problem = thumbnail(data, engine.config.max_image_pixels, engine.config.max_image_bytes, name)
    if problem:
        upload_column.error(f"Not used: {problem}", icon=":material/broken_image:")
    else:
        current.append((name, data))
        pieces.append(picture_tokens(data, engine.config.max_image_pixels, engine.config.max_image_bytes,
                                     engine.config))
        sample_column.image(image, width=120, caption=name)
if enhance and any(isinstance(data, bytes) for _, data in current):
    with st.expander("What the model sees with Enhance for OCR", expanded=False):
        for name, data in (item for item in current if isinstance(item[1], bytes)):
            before, after = st.columns(2)
            before.image(preview(data), caption=f"{name}, as sent", width=240)
            enhanced = enhanced_thumbnail(data, engine.config.max_image_pixels, engine.config.max_image_bytes,
                                          engine.config.max_pixels)
            if enhanced is not None:
                after.image(enhanced, caption=f"{name}, enhanced", width=240)

# Above the conversation, so they stay where they are as it grows; beside them what the next question will cost.
actions = st.columns([1, 1, 5], vertical_alignment="center")
ask_preset = actions[0].button(f"Ask: {preset}", key="ask_preset", disabled=not PRESETS[preset])
if actions[1].button("Clear chat", key="clear_chat"):
    st.session_state["turns"] = []
    st.rerun()
actions[2].caption(estimate_line(engine, pieces if images_to_attach(turns, current) else []),
                   help="Vision encode and prefill grow with the prompt's tokens, decode with the answer's: both "
                        "rates come from the benchmark on record for this CPU kind at the loaded precision, or, "
                        "without one for this model, from this server's latest answers.")
st.divider()


def settle_stopped(pending: list[ChatTurn]) -> bool:
    """Give stopped answers their cost line from the records the engine's worker wrote after the stop. Returns
    whether any is still waiting for its record."""
    for turn in pending:
        record = engine.store.get(turn.request_id)
        if record is not None and record.status != RUNNING:
            turn.stats = stats_line(record)
    return any(not turn.stats for turn in pending)


def unsettled(turns: list[ChatTurn]) -> list[ChatTurn]:
    return [turn for turn in turns if turn.request_id and not turn.stats and not turn.streaming and not turn.error]


@st.fragment(run_every=1.0)
def finish_stopped_answers() -> None:
    """A stopped answer's record is written by the engine's worker after the stop; this fragment keeps running after
    the script run and reruns the page once it is, so the answer's cost line appears at once."""
    pending = unsettled(st.session_state.get("turns", []))
    # Never while an answer streams: the rerun would end it. Its run redraws the page when it ends.
    if pending and not settle_stopped(pending) and not in_flight():
        st.rerun(scope="app")


def in_flight() -> dict:
    """The answer streaming now: {"handle": its RequestHandle}, else empty. Changed in place through a reference taken
    before the answer starts: a stopped run's `finally` cannot reach session state itself."""
    return st.session_state.setdefault("in_flight", {})


def stop_answer_in_flight(turns: list[ChatTurn]) -> None:
    """Any run after an answer began ends it: Stop, or any other click while it streams. The run that wrote it may
    still be waiting for the engine's next event, so this run cancels the request and marks the answer itself."""
    handle = in_flight().pop("handle", None)
    if handle is not None:
        handle.cancel()
    for turn in turns:
        turn.end_stream()


stop_answer_in_flight(turns)
waiting = unsettled(turns)
if waiting and settle_stopped(waiting):
    finish_stopped_answers()
for turn in turns:
    with st.chat_message(turn.role):
        for name, data in turn.images:
            st.image(preview(data), caption=name, width=280)
        if turn.error:
            st.error(turn.text)
        elif turn.as_json and parsed_json(turn.text) is not None:
            st.json(parsed_json(turn.text))
        else:
            st.markdown(inert_markdown(turn.shown_text))
        if turn.stats:
            st.caption(turn.stats)

typed = st.chat_input(attached_words(current, turns), key="chat_prompt", submit_mode="stop", max_chars=8000)
prompt = typed if typed else (PRESETS[preset] if ask_preset else None)



def progress_text(event: StageProgress, started: float) -> str:
    """A long stage's progress in words: pieces done of pieces, time so far and the time left at that pace."""
    elapsed = time.monotonic() - started
    stage = event.name.replace("_", " ").capitalize()
    line = f"{stage}: {event.done:,} of {event.total:,} {event.unit}, {elapsed:.0f} s"
    if 0 < event.done < event.total:
        line += f", about {elapsed * (event.total - event.done) / event.done:.0f} s left"
    return line


def stream_text(handle, status, answer: ChatTurn, result: dict):
    """Engine events to text for st.write_stream, the answer's turn kept up to date as it grows. Runs in this script
    thread: the worker never touches st."""
    stage_started: dict[str, float] = {}
    while True:
        event = handle.next_event(timeout=0.25)
        if event is None:
            continue  # a heartbeat: lets Streamlit stop this run between events
        if isinstance(event, Queued):
            status.info(f"Waiting for the model: {event.position} request(s) ahead", icon=":material/hourglass:")
        elif isinstance(event, StageStarted):
            stage_started.setdefault(event.name, time.monotonic())
            status.caption(f"{event.name.replace('_', ' ').capitalize()}…")
        elif isinstance(event, StageProgress):
            started = stage_started.setdefault(event.name, time.monotonic())
            status.progress(min(event.done / max(event.total, 1), 1.0), text=progress_text(event, started))
        elif isinstance(event, TextChunk):
            status.empty()
            answer.text += event.text
            yield inert_markdown(event.text)
        elif isinstance(event, RequestMetrics):
            result["metrics"] = event
            return


if prompt:
    finish_stopped_answers()
    attach = images_to_attach(turns, current)
    request = build_request(turns, prompt, attach, enhance, json_schema, video_fps)
    user_turn = ChatTurn("user", prompt, attach)
    turns.append(user_turn)
    with st.chat_message("user"):
        for name, data in attach:
            st.image(preview(data), caption=name, width=280)
        st.markdown(prompt)
    with st.chat_message("assistant"):
        # Every answer stops the same way, asked by the chat box or by a preset: Stop reruns the page, and that run
        # cancels the request and keeps what was written (stop_answer_in_flight).
        stop = st.empty()
        stop.button("Stop this answer", key="stop_answer", icon=":material/stop_circle:")
        status = st.empty()
        result: dict = {}
        answer = ChatTurn("assistant", "", as_json=json_schema is not None, streaming=True)
        turns.append(answer)  # from now on: a later run sees the answer, however this one ends
        flight = in_flight()
        handle = None
        try:
            handle = engine.submit(request)
            answer.request_id = handle.id
            flight["handle"] = handle
            with st.container(key="streaming_answer"):  # what a browser test watches grow
                st.write_stream(stream_text(handle, status, answer, result))
            stop.empty()
            answer.stats = stats_line(result["metrics"])
            if answer.as_json and parsed_json(answer.text) is not None:
                st.json(parsed_json(answer.text))
            st.caption(answer.stats)
        except VlscopeError as exc:
            status.empty()
            stop.empty()
            user_turn.error = answer.error = True
            answer.text = exc.message
            st.error(exc.message)
        except Exception as exc:  # never a traceback in the UI
            log.exception("chat request failed")
            stop.empty()
            user_turn.error = answer.error = True
            answer.text = f"Something went wrong: {type(exc).__name__}: {exc}"
            st.error(answer.text)
        finally:
            # Also runs when the user stops the run or reruns: the engine stops, the partial answer is kept.
            if handle is not None:
                handle.cancel()
            answer.end_stream()
            if flight.get("handle") is handle:
                flight.clear()
    # A finished answer is drawn again by a run without the question, which also drops the fragment: its timer, which
    # ticked while the answer streamed, would otherwise hold the chat box in its running state (no next question).
    st.rerun()

if turns:
    st.download_button("Download transcript", transcript(turns), file_name="vlscope-transcript.md",
                       mime="text/markdown", key="download_transcript", icon=":material/download:")
