"""PDFs and multi-page TIFFs: admitted from their outline before any page is rendered, each page rendered at the
resolution the token budget needs, refused with a clear reason when they cannot be read or cannot fit. Real PDFs,
made here from the shared photos and scans, by PDFium itself, and by hand for the hostile ones."""
from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import urllib.request

import psutil
import pytest
from PIL import Image

from engine import EngineConfig, InvalidImage, MetricsStore, PromptTooLong
from engine.inputs.documents import Document, as_document, pick_pages
from engine.records.stages import LOAD_IMAGES, RENDER_PAGES

from . import pdfs
from .conftest import ROOT


@pytest.fixture(scope="module")
def three_pages(images_dir) -> bytes:
    """A scanner's three pages: a page of text, a line of text, a photo."""
    return pdfs.from_images([images_dir / "page.png", images_dir / "text.png", images_dir / "coffee.png"])


def multipage_tiff(images_dir) -> bytes:
    frames = [Image.open(images_dir / name).convert("RGB") for name in ("page.png", "text.png")]
    buffer = io.BytesIO()
    frames[0].save(buffer, "TIFF", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def test_pages_are_sized_before_rendering_at_the_budget_and_read_in_order(engine, three_pages):
    answer = engine.ask(engine_request(Document(three_pages, "scan.pdf", (2, 3))))
    record = answer.metrics
    assert record.status == "ok"
    assert [(page["document"], page["page"]) for page in record.document_pages] == [("scan.pdf", 2), ("scan.pdf", 3)]
    assert record.vision_tokens == sum(page["vision_tokens"] for page in record.document_pages) > 0
    assert RENDER_PAGES in record.stages and LOAD_IMAGES in record.stages
    # a 72 dpi-sized page is rendered at 300 dpi at most, a letter page at what 1,024 tokens take
    assert [tuple(page["rendered"]) for page in record.document_pages] == [tuple(size) for size in record.image_sizes]
    letter = pick_pages(Document(pdfs.one_page(), "letter.pdf"), engine.config)[0]
    assert letter.points == (612.0, 792.0) and 0.95 < letter.size[0] * letter.size[1] / engine.config.max_pixels <= 1.0


def engine_request(*images, prompt="Read the document"):
    from engine import ChatRequest

    return ChatRequest(prompt=prompt, images=images, max_new_tokens=4)


def test_default_pages_are_the_first_that_fit_the_page_and_token_limits(images_dir):
    config = EngineConfig(max_pdf_pages=8)
    many = Document(pdfs.many_pages(), "huge-report.pdf")
    pages = pick_pages(many, config)
    assert pages[0].count == 100_000
    # letter pages take 1,008 tokens each (+2): seven fit the 8,192-token prompt with room kept for the question
    assert [page.number for page in pages] == list(range(1, 8))
    assert len(pick_pages(many, EngineConfig(max_pdf_pages=3))) == 3
    assert len(pick_pages(Document(many.data, max_pages=2), config)) == 2
    with pytest.raises(PromptTooLong, match=r"pages 1-8 take .* 7 of these pages fit \(pages 1-7\)"):
        pick_pages(Document(many.data, "huge-report.pdf", tuple(range(1, 9))), config)
    with pytest.raises(InvalidImage, match="9 pages asked, at most 8"):
        pick_pages(Document(many.data, "r.pdf", tuple(range(1, 10))), config)
    with pytest.raises(InvalidImage, match="page 100001 does not exist; the document has 100000 pages"):
        pick_pages(Document(many.data, "r.pdf", (100_001,)), config)


def test_mixed_sizes_and_a_rotated_page_keep_their_shape():
    pages = pick_pages(Document(pdfs.mixed_sizes_rotated(), "mixed.pdf"), EngineConfig())
    assert [page.points for page in pages] == [(595.0, 842.0), (612.0, 792.0), (600.0, 300.0)]
    assert all(page.size[0] < page.size[1] for page in pages[:2]) and pages[2].size[0] == 2 * pages[2].size[1]
    rendered = pages[2].render()
    assert rendered.size == pages[2].size  # landscape, as the rotated page is shown


@pytest.mark.parametrize("make, reason", [
    (pdfs.encrypted, "password-protected"),
    (lambda: pdfs.truncated(pdfs.mixed_sizes_rotated()), "not a readable PDF"),
    (pdfs.no_pages, "not a readable PDF|no pages"),
    (lambda: pdfs.one_page(b"[0 0 0.5 0.5]"), "too small to read"),
    (lambda: b"%PDF-1.7\n" + b"\x00garbage" * 100, "not a readable PDF"),
])
def test_hostile_pdfs_get_a_clear_refusal(engine, make, reason):
    with pytest.raises(InvalidImage, match=reason):
        engine.ask(engine_request(make()))
    record = MetricsStore(engine.config.db_path).recent(1, include_warmup=False)[0]
    assert record.status == "refused" and record.error_type == "invalid_image"


def test_a_huge_page_is_rendered_within_the_budget_without_a_memory_jump(engine):
    before = psutil.Process().memory_info().rss
    record = engine.ask(engine_request(pdfs.one_page(b"[0 0 14400 14400]"))).metrics  # 200 x 200 inches
    assert record.status == "ok" and record.document_pages[0]["rendered"] == [1024, 1024]
    assert psutil.Process().memory_info().rss - before < 200 * 1024 * 1024


def test_multipage_tiff_is_a_document_of_pages(engine, images_dir):
    data = multipage_tiff(images_dir)
    document = as_document(data, 10**8)
    assert document is not None and document.kind == "TIFF"
    record = engine.ask(engine_request(data)).metrics
    assert [page["page"] for page in record.document_pages] == [1, 2]
    assert record.image_sizes == tuple(Image.open(images_dir / name).size for name in ("page.png", "text.png"))


def test_check_images_gives_a_verdict_per_document(images_dir, tmp_path, three_pages):
    files = {"scan.pdf": three_pages, "locked.pdf": pdfs.encrypted(), "cut.pdf": pdfs.truncated(three_pages),
             "report.pdf": pdfs.many_pages(), "two-pages.tiff": multipage_tiff(images_dir)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    run = subprocess.run([sys.executable, "-m", "engine", "check-images", *(str(tmp_path / n) for n in files)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    verdicts = {json.loads(line)["file"].rsplit("/", 1)[1]: json.loads(line) for line in run.stdout.splitlines()}
    scan = verdicts["scan.pdf"]
    assert scan["ok"] and scan["format"] == "PDF" and scan["pages"] == 3 and scan["read_pages"] == [1, 2, 3]
    assert len(scan["page_sizes"]) == len(scan["rendered"]) == len(scan["vision_tokens"]) == 3
    assert not verdicts["locked.pdf"]["ok"] and "password" in verdicts["locked.pdf"]["error"]
    assert not verdicts["cut.pdf"]["ok"] and "not a readable PDF" in verdicts["cut.pdf"]["error"]
    assert verdicts["report.pdf"]["pages"] == 100_000 and verdicts["report.pdf"]["read_pages"] == list(range(1, 8))
    assert verdicts["two-pages.tiff"]["format"] == "TIFF" and verdicts["two-pages.tiff"]["read_pages"] == [1, 2]


def pdf_part(data: bytes, name="scan.pdf") -> dict:
    return {"type": "file", "file": {"filename": name,
                                     "file_data": "data:application/pdf;base64," + base64.b64encode(data).decode()}}


def test_the_openai_client_sends_a_pdf_as_a_file_part(tiny_model, tmp_path, three_pages):
    from openai import BadRequestError, OpenAI

    from .test_api import start_server

    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What do pages 1-2 say?"}, pdf_part(three_pages)]}], extra_body={"max_pages": 2})
        assert reply.choices[0].message.content is not None
        assert RENDER_PAGES in reply.model_extra["metrics"]["stages"]
        record = MetricsStore(tmp_path / "api.db").recent(1, include_warmup=False)[0]
        assert [page["page"] for page in record.document_pages] == [1, 2]
        # a PDF in an image_url part reads the same way
        image_url = {"type": "image_url", "image_url": {"url": "data:application/pdf;base64," +
                                                               base64.b64encode(three_pages).decode()}}
        client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Read"}, image_url]}])
        for bad, reason in ((pdfs.encrypted(), "password"), (pdfs.truncated(three_pages), "not a readable PDF"),
                            (b"\x89PNG not a pdf", "file parts take PDF documents")):
            with pytest.raises(BadRequestError, match=reason):
                client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "text", "text": "Read"}, pdf_part(bad)]}])
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            assert json.loads(response.read())["status"] == "ready"  # no refusal took the server down
    finally:
        process.terminate()
        process.wait(20)
