"""The chat page's documents: a PDF's (or multi-page TIFF's) page picker, with each page's thumbnail and cost."""
from __future__ import annotations

import hashlib
import io

import streamlit as st

from engine import EngineConfig, InvalidImage, PromptTooLong
from engine.inputs.documents import Document, as_document, page_tokens, pick_pages
from engine.inputs.images import to_rgb


@st.cache_data(max_entries=32, show_spinner=False)
def _facts(data: bytes, name: str, config: EngineConfig) -> tuple[int, tuple[int, int]] | str:
    """(page count, the first and last page a question reads by default: the first that fit), or the reason the
    document is refused. Reads the document's outline only: nothing is rendered."""
    try:
        pages = pick_pages(Document(data, name), config)
    except (InvalidImage, PromptTooLong) as exc:
        return exc.message
    return pages[0].count, (pages[0].number, pages[-1].number)


@st.cache_data(max_entries=128, show_spinner=False)
def _thumbnail(data: bytes, name: str, number: int, config: EngineConfig) -> tuple[bytes | None, int]:
    """A page's PNG thumbnail and its vision tokens."""
    try:
        page = pick_pages(Document(data, name, (number,)), config)[0]
        picture = to_rgb(page.render())
    except (InvalidImage, PromptTooLong):
        return None, 0
    return png_thumbnail(picture, 560), page_tokens(page.size, config) - 2


def png_thumbnail(picture, side: int) -> bytes:
    """A PNG of the picture at most `side` pixels on its longer side: what the page hands the browser."""
    picture.thumbnail((side, side))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def document_of(data: bytes, max_bytes: int) -> bool:
    try:
        return as_document(data, max_bytes) is not None
    except InvalidImage:
        return True  # a document over the size limit: the picker says so


def preview(document: Document, config: EngineConfig) -> bytes | None:
    """The first chosen page's thumbnail, for the conversation."""
    return _thumbnail(document.data, document.name, (document.pages or (1,))[0], config)[0]


PAGES_A_ROW = 3  # thumbnails across the page's width: a page's text stays readable


def page_picker(column, gallery, name: str, data: bytes, config: EngineConfig) -> tuple[Document, list[int]] | None:
    """Which pages of the document go with the question: a range, by default the first that fit, picked in `column`;
    each chosen page with its vision tokens in `gallery`, a row as wide as the page. The document and each page's
    tokens, or None (with the reason shown) when the document or the range is refused."""
    facts = _facts(data, name, config)
    if isinstance(facts, str):
        column.error(f"Not used: {facts}", icon=":material/broken_image:")
        return None
    count, (first, last) = facts
    key = hashlib.sha256(data).hexdigest()[:12]
    if count > 1:
        left, right = column.columns(2)
        first = left.number_input(f"{name}: first page", 1, count, first, key=f"first_page_{key}")
        last = right.number_input(f"last page (of {count})", 1, count, max(first, last), key=f"last_page_{key}")
    document = Document(data, name, tuple(range(first, max(first, last) + 1)))
    try:
        pages = pick_pages(document, config)
    except (InvalidImage, PromptTooLong) as exc:
        column.error(exc.message, icon=":material/description:")
        return None
    shown = [_thumbnail(data, name, page.number, config) for page in pages]
    total = sum(tokens for _, tokens in shown)
    column.caption(f"{name}: pages {pages[0].number}-{pages[-1].number} of {count}, {total:,} vision tokens")
    cells = gallery.columns(PAGES_A_ROW)
    for index, (page, (picture, tokens)) in enumerate(zip(pages, shown)):
        if picture is not None:
            cells[index % len(cells)].image(picture, caption=f"p. {page.number} · {tokens:,} tokens")
    return document, [tokens for _, tokens in shown]
