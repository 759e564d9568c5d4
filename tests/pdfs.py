"""PDFs for the tests, made here: from real photos and scans (Pillow writes PDFs), with pypdfium2 itself, and by hand
where a hostile one needs a structure no writer makes (a password, a page tree that claims 100,000 pages)."""
from __future__ import annotations

import io
from pathlib import Path

from PIL import Image


def from_images(paths: list[Path], resolution: float = 150.0) -> bytes:
    """One page per picture, as a scanner's PDF holds them."""
    pages = [Image.open(path).convert("RGB") for path in paths]
    buffer = io.BytesIO()
    pages[0].save(buffer, "PDF", save_all=True, append_images=pages[1:], resolution=resolution)
    return buffer.getvalue()


def mixed_sizes_rotated() -> bytes:
    """Three pages made by PDFium: A4 portrait, US letter, and a landscape page stored rotated by 90 degrees."""
    import pypdfium2 as pdfium

    document = pdfium.PdfDocument.new()
    document.new_page(595, 842)
    document.new_page(612, 792)
    document.new_page(300, 600).set_rotation(90)
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def handmade(objects: list[bytes], trailer_extra: bytes = b"") -> bytes:
    """A PDF from numbered objects (1 is the catalog), with a correct cross-reference table."""
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R %s>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, trailer_extra, xref)
    return bytes(out)


def one_page(media_box: bytes = b"[0 0 612 792]") -> bytes:
    return handmade([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                     b"<< /Type /Page /Parent 2 0 R /MediaBox " + media_box + b" >>"])


def no_pages() -> bytes:
    return handmade([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"])


def many_pages(count: int = 100_000) -> bytes:
    """A page tree of `count` pages that all are one page object: 100,000 pages in well under a megabyte."""
    kids = b" ".join(b"3 0 R" for _ in range(count))
    return handmade([b"<< /Type /Catalog /Pages 2 0 R >>",
                     b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % count,
                     b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>"])


def encrypted() -> bytes:
    """Standard security handler with an owner and a user password: the empty password does not open it."""
    o, u = b"<" + b"ab" * 32 + b">", b"<" + b"cd" * 32 + b">"
    encrypt = b"<< /Filter /Standard /V 1 /R 2 /O " + o + b" /U " + u + b" /P -44 >>"
    return handmade([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                     b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>", encrypt],
                    b"/Encrypt 4 0 R /ID [<0123456789abcdef0123456789abcdef> <0123456789abcdef0123456789abcdef>] ")


def truncated(data: bytes) -> bytes:
    """The first third of a PDF: its pages' content and its cross-reference table are gone."""
    return data[: len(data) // 3]
