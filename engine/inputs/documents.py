"""Documents as the pages the model reads: PDFs (rendered with PDFium) and multi-page TIFFs.

A document is admitted before any page is rendered: its page count, each chosen page's size in points and the
pixels it would be rendered at are read first, and a document that cannot fit is refused with what would fit.
Each page is then rendered at the resolution the image token budget needs, never a fixed DPI, and enters the
request as one image. Every failure is InvalidImage with a message a user understands.
"""
from __future__ import annotations

import hashlib
import io
import math
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image

from ..errors import InvalidImage, PromptTooLong
from .limits import fit_to_budget, read_source, vision_token_count

PDF_MAGIC = b"%PDF-"
TIFF_MAGICS = (b"II*\x00", b"MM\x00*")
MAX_RENDER_SCALE = 300 / 72  # a small page is rendered at 300 dpi at most: no scan holds more
TEXT_TOKENS_KEPT = 512  # of the prompt limit, left for the question and the template when pages are picked
RENDER_SECONDS = 60.0  # one request's pages together; a document that renders slower is refused
MIN_PAGE_POINTS = 1.0  # a page narrower than a point has nothing to read
MAX_PAGES_READ = 100_000  # a page tree that claims more is not a document this server reads

# PDFium is not thread-safe: every call into it, in the whole process, holds this lock.
_PDFIUM_LOCK = threading.Lock()


@dataclass(frozen=True)
class Document:
    """A document a request carries, and which of its pages to read (1-based; None: the first that fit)."""

    data: bytes
    name: str = "document.pdf"
    pages: tuple[int, ...] | None = None
    max_pages: int | None = None  # with pages None: read at most this many (the API's max_pages)

    @property
    def kind(self) -> str:
        return "PDF" if is_pdf(self.data) else "TIFF"


def is_pdf(data: bytes) -> bool:
    """A PDF's header may follow up to 1 KB of other bytes, as readers allow."""
    return PDF_MAGIC in data[:1024]


@dataclass(frozen=True)
class Page:
    """One page of a document, sized but not rendered: an image source the engine admits like any other."""

    document: Document
    number: int  # 1-based
    count: int  # pages in the document
    points: tuple[float, float]  # (width, height) as the page is shown, rotation applied; pixels for a TIFF
    size: tuple[int, int]  # (width, height) it renders at

    @property
    def name(self) -> str:
        return f"{self.document.name}, page {self.number} of {self.count}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.document.data + f"#page={self.number}".encode()).hexdigest()

    def render(self) -> Image.Image:
        """The page as a picture of exactly `size` pixels."""
        if self.document.kind == "TIFF":
            with Image.open(io.BytesIO(self.document.data)) as tiff:
                tiff.seek(self.number - 1)
                image = tiff.copy()
        else:
            import pypdfium2 as pdfium

            with _PDFIUM_LOCK:
                pdf = pdfium.PdfDocument(self.document.data)
                try:
                    page = pdf[self.number - 1]
                    image = page.render(scale=self.size[0] / self.points[0], may_draw_forms=True).to_pil()
                    page.close()
                finally:
                    pdf.close()
        return image if image.size == self.size else image.resize(self.size, Image.BICUBIC)


def as_document(source, max_bytes: int) -> Document | None:
    """The source as a Document when its content is one (a PDF, or a TIFF of several pages), else None. Decided by
    content, never by name."""
    if isinstance(source, Document):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, name = bytes(source), "upload"
    elif isinstance(source, (str, Path)):
        path = Path(source)
        try:
            with open(path, "rb") as file:
                head = file.read(1024)
        except OSError:
            return None  # the image reader says why
        if PDF_MAGIC not in head and not head.startswith(TIFF_MAGICS):
            return None
        data, _, name = read_source(path, max_bytes)
    else:
        return None
    if is_pdf(data):
        return Document(data, name)
    if data.startswith(TIFF_MAGICS) and _tiff_frames(data) > 1:
        return Document(data, name)
    return None


def _tiff_frames(data: bytes) -> int:
    try:
        with Image.open(io.BytesIO(data)) as tiff:
            return getattr(tiff, "n_frames", 1)
    except Exception:  # not readable as a TIFF: the image reader refuses it with its own reason
        return 1


@dataclass(frozen=True)
class Outline:
    """What a document says about itself before any page is rendered."""

    name: str
    count: int
    sizes: tuple[tuple[float, float], ...]  # the read pages' sizes (points; pixels for a TIFF), page 1 first


def outline(document: Document, first_pages: int) -> Outline:
    """The page count and the sizes of the first `first_pages` pages (and of any page asked for). Raises
    InvalidImage for an encrypted, malformed or empty document, or a page of zero size."""
    wanted = set(range(1, first_pages + 1)) | set(document.pages or ())
    if document.kind == "TIFF":
        return _tiff_outline(document, wanted)
    import pypdfium2 as pdfium

    name = document.name
    with _PDFIUM_LOCK:
        try:
            pdf = pdfium.PdfDocument(document.data)
        except pdfium.PdfiumError as exc:
            reason = str(exc).lower()
            if "password" in reason or "security" in reason:
                raise InvalidImage(f"{name}: the PDF is password-protected; remove the password and send it again")
            raise InvalidImage(f"{name}: not a readable PDF (the file is damaged or truncated)") from None
        try:
            count = len(pdf)
            if count == 0:
                raise InvalidImage(f"{name}: the PDF has no pages")
            if count > MAX_PAGES_READ:
                raise InvalidImage(f"{name}: the PDF claims {count:,} pages, over the {MAX_PAGES_READ:,} this server "
                                   "reads; split it")
            sizes = tuple(pdf.get_page_size(number - 1) for number in range(1, min(count, max(wanted)) + 1)
                          if number in wanted)
        finally:
            pdf.close()
    return Outline(name, count, sizes)


def _tiff_outline(document: Document, wanted: set[int]) -> Outline:
    sizes = []
    try:
        with Image.open(io.BytesIO(document.data)) as tiff:
            count = tiff.n_frames
            for number in sorted(wanted):
                if number <= count:
                    tiff.seek(number - 1)
                    sizes.append(tuple(float(side) for side in tiff.size))
    except Exception as exc:  # a decoder failure is bad input
        raise InvalidImage(f"{document.name}: the TIFF's pages cannot be read ({exc})") from None
    return Outline(document.name, count, tuple(sizes))


def render_size(points: tuple[float, float], kind: str, max_pixels: int) -> tuple[int, int]:
    """The pixels a page renders at: as many as the token budget takes, at most 300 dpi; a TIFF page as stored."""
    width, height = points
    if kind == "TIFF":
        return int(width), int(height)
    scale = min(math.sqrt(max_pixels / (width * height)), MAX_RENDER_SCALE)
    return max(1, round(width * scale)), max(1, round(height * scale))


def page_tokens(size: tuple[int, int], config) -> int:
    return vision_token_count(fit_to_budget(*size, config.min_pixels, config.max_pixels)) + 2


def pick_pages(document: Document, config, token_room: int | None = None) -> list[Page]:
    """The document's pages this request reads: those asked for, or the first that fit both the page limit and the
    prompt's token room. Refused, with what would fit, when the asked pages do not."""
    limit = min(config.max_pdf_pages, document.max_pages or config.max_pdf_pages)
    room = (config.max_input_tokens - TEXT_TOKENS_KEPT) if token_room is None else token_room
    asked = document.pages
    if asked is not None and not asked:
        raise InvalidImage(f"{document.name}: no pages were chosen")
    found = outline(document, first_pages=limit if asked is None else 0)
    name = found.name
    if asked is not None:
        wrong = [number for number in asked if not 1 <= number <= found.count]
        if wrong:
            raise InvalidImage(f"{name}: page {wrong[0]} does not exist; the document has {found.count} pages")
        if len(asked) > limit:
            raise InvalidImage(f"{name}: {len(asked)} pages asked, at most {limit} per request; pick fewer pages")
        numbers = list(asked)
    else:
        numbers = list(range(1, min(found.count, limit) + 1))
    sized = dict(zip(sorted(set(numbers)), found.sizes))
    pages = []
    for number in numbers:
        points = sized[number]
        if min(points) < MIN_PAGE_POINTS:
            raise InvalidImage(f"{name}: page {number} is {points[0]:g} x {points[1]:g} points, too small to read")
        pages.append(Page(document, number, found.count, points, render_size(points, document.kind, config.max_pixels)))
    tokens = [page_tokens(page.size, config) for page in pages]
    fitting = 0
    while fitting < len(pages) and sum(tokens[:fitting + 1]) <= room:
        fitting += 1
    if asked is None:
        if fitting == 0:
            raise PromptTooLong(f"{name}: its first page alone takes {tokens[0]} tokens, over the {room} the prompt "
                                "has room for; lower the image token budget")
        return pages[:fitting]
    if fitting < len(pages):
        raise PromptTooLong(f"{name}: pages {_ranges(numbers)} take {sum(tokens)} tokens, over the {room} the prompt "
                            f"has room for; {fitting} of these pages fit (pages {_ranges(numbers[:fitting]) or '-'})")
    return pages


def _ranges(numbers: list[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    parts, start = [], None
    for index, number in enumerate(numbers):
        if start is None:
            start = number
        if index + 1 == len(numbers) or numbers[index + 1] != number + 1:
            parts.append(str(start) if start == number else f"{start}-{number}")
            start = None
    return ", ".join(parts)


def expand_documents(request, config):
    """The request with every document replaced by the pages it reads (sized, not rendered), in order, so each page
    is one image of its turn; the request itself when it carries none. Raises InvalidImage or PromptTooLong."""
    pages_left = config.max_pdf_pages

    def expand(images: tuple) -> tuple:
        nonlocal pages_left
        out = []
        for source in images:
            document = as_document(source, config.max_image_bytes)
            if document is None:
                out.append(source)
                continue
            if pages_left <= 0:
                raise InvalidImage(f"{document.name}: the request already carries {config.max_pdf_pages} pages, the "
                                   "limit per request")
            pages = pick_pages(document, replace(config, max_pdf_pages=pages_left))
            pages_left -= len(pages)
            out.extend(pages)
        return tuple(out)

    history = tuple(replace(turn, images=expand(turn.images)) if turn.images else turn for turn in request.history)
    images = expand(request.images)
    if history == request.history and images == request.images:
        return request
    return replace(request, history=history, images=images)


class RenderClock:
    """The render time of one request's pages together, refused past RENDER_SECONDS."""

    def __init__(self, limit_s: float = RENDER_SECONDS):
        self.limit_s, self.seconds, self.pages, self.pixels = limit_s, 0.0, 0, 0

    def render(self, page: Page) -> Image.Image:
        if self.seconds > self.limit_s:
            raise InvalidImage(f"{page.document.name}: rendering its pages took over {self.limit_s:.0f} s; send fewer "
                               "or simpler pages")
        started = time.perf_counter()
        try:
            image = page.render()
        except InvalidImage:
            raise
        except Exception as exc:  # a renderer failure on one page is bad input
            raise InvalidImage(f"{page.name}: the page could not be rendered ({type(exc).__name__})") from None
        self.seconds += time.perf_counter() - started
        self.pages += 1
        self.pixels += image.width * image.height
        return image
