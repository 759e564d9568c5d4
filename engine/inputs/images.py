"""Turning untrusted image input into RGB pictures the model can take, and sizing them to the token budget.

Every failure becomes InvalidImage with a message a user understands; nothing here lets a decoder error escape.
"""
from __future__ import annotations

import hashlib
import io
import math
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from ..errors import InvalidImage, PromptTooLong
from .documents import Page, RenderClock, as_document, pick_pages
from .limits import fit_to_budget, read_source, vision_token_count

# Truncated files are refused, never padded with grey.
ImageFile.LOAD_TRUNCATED_IMAGES = False

MAX_ASPECT_RATIO = 200  # the vision tower's limit


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # RGB, EXIF orientation applied
    original_size: tuple[int, int]  # (width, height) as stored in the file; a document page: as rendered
    format: str
    sha256: str
    page: int | None = None  # a document's page: its number
    document: str | None = None  # and the document's name


@dataclass
class ImageHeader:
    """What an image file says about itself before any pixel is decoded."""

    name: str
    size: tuple[int, int]  # (width, height) as stored
    format: str
    data: bytes | None  # the file's bytes; None for a PIL image handed in
    image: Image.Image | None  # opened, not decoded; None for a document's page
    page: "Page | None" = None  # a document's page (documents.py), rendered when decoded


# One image decodes at a time in the whole process: concurrent requests cannot multiply the peak of a large one.
_DECODE_LOCK = threading.Lock()


def read_header(source, *, max_pixels: int, max_bytes: int, name: str | None = None) -> ImageHeader:
    """Open an image and check what its header declares (size, aspect, pixel count), decoding nothing. Raises
    InvalidImage with a readable reason, naming `name`."""
    if isinstance(source, Page):
        width, height = source.size
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise InvalidImage(f"{source.name}: aspect ratio {width}x{height} is too extreme (over {MAX_ASPECT_RATIO}:1)")
        if width * height > max_pixels:
            raise InvalidImage(f"{source.name}: {width}x{height} is {width * height / 1e6:.0f} megapixels, over the "
                               f"{max_pixels / 1e6:.0f} megapixel limit")
        return ImageHeader(source.name, source.size, source.document.kind, None, None, source)
    data, image, source_name = read_source(source, max_bytes)
    name = name or source_name
    with _readable(name, max_pixels):
        if image is None:
            image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width <= 0 or height <= 0:
            raise InvalidImage(f"{name}: the image has zero size")
        # Checked before decoding, so a small file that expands to gigabytes is never decoded.
        if width * height > max_pixels:
            raise InvalidImage(
                f"{name}: {width}x{height} is {width * height / 1e6:.0f} megapixels, over the "
                f"{max_pixels / 1e6:.0f} megapixel limit"
            )
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise InvalidImage(f"{name}: aspect ratio {width}x{height} is too extreme (over {MAX_ASPECT_RATIO}:1)")
        return ImageHeader(name, (width, height), image.format or "unknown", data, image)


def decode(header: ImageHeader, budget_pixels: int | None = None, clock: RenderClock | None = None) -> LoadedImage:
    """Decode one image to RGB (EXIF orientation applied). With `budget_pixels` (what the model will see), an image
    far larger is decoded smaller where the format allows it (JPEG's DCT scaling) and reduced right after decoding,
    before it is widened to RGB, so its full-size RGB copy never exists; it keeps at least twice the budget's side."""
    if header.page is not None:
        with _DECODE_LOCK, _readable(header.name, header.size[0] * header.size[1]):
            rgb = to_rgb((clock or RenderClock()).render(header.page))
        return LoadedImage(image=rgb, original_size=rgb.size, format=header.format, sha256=header.page.sha256,
                           page=header.page.number, document=header.page.document.name)
    image, name = header.image, header.name
    width, height = header.size
    with _DECODE_LOCK, _readable(name, width * height):
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)  # animated: the first frame
        factor = 1
        if budget_pixels:
            factor = int(math.sqrt(width * height / budget_pixels) / 2)
        if factor > 1 and header.format == "JPEG":
            image.draft(image.mode, (width // factor, height // factor))
        image.load()
        if factor > 1:
            if image.mode in ("1", "P"):
                image = image.convert("L" if image.mode == "1" else "RGBA")
            factor = int(math.sqrt(image.width * image.height / budget_pixels) / 2)  # after any draft
            if factor > 1:
                image = _reduced(image, factor)
        image = ImageOps.exif_transpose(image)
        rgb = to_rgb(image)
    digest = hashlib.sha256(header.data if header.data is not None else rgb.tobytes()).hexdigest()
    return LoadedImage(image=rgb, original_size=header.size, format=header.format, sha256=digest)


def _reduced(image: Image.Image, factor: int) -> Image.Image:
    """The image `factor` times smaller on each side, each pixel the mean of its block (Image.reduce), 16-bit greys
    too (which reduce() does not take): averaged by OpenCV in 16 bits, so no wider full-size copy is made."""
    if not image.mode.startswith("I;16"):
        return image.reduce(factor)
    import cv2

    pixels = np.asarray(image).astype(np.uint16, copy=False)  # big-endian 16-bit greys to this machine's order
    size = (image.width // factor, image.height // factor)
    return Image.fromarray(cv2.resize(pixels[:size[1] * factor, :size[0] * factor], size,
                                      interpolation=cv2.INTER_AREA))


@contextmanager
def _readable(name: str, max_pixels: int):
    """Any decoder failure becomes InvalidImage naming the image: bad input, never a server fault."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except InvalidImage:
        raise
    except UnidentifiedImageError:
        raise InvalidImage(f"{name}: not an image, or a format that cannot be read") from None
    except Image.DecompressionBombError:
        # Pillow's own guard fired while reading the header: same verdict as ours.
        raise InvalidImage(f"{name}: the image declares too many pixels, over the "
                           f"{max_pixels / 1e6:.0f} megapixel limit") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError) as exc:
        raise InvalidImage(f"{name}: the image data is truncated or corrupt ({exc})") from None
    except MemoryError:
        raise InvalidImage(f"{name}: not enough memory to decode this image") from None
    except Exception as exc:  # any other decoder failure is still bad input, not a server fault
        raise InvalidImage(f"{name}: the image could not be decoded ({type(exc).__name__}: {exc})") from None


def load_image(source, *, max_pixels: int, max_bytes: int, name: str | None = None) -> LoadedImage:
    """Check and decode one image at full size. Raises InvalidImage with a readable reason, naming `name`."""
    return decode(read_header(source, max_pixels=max_pixels, max_bytes=max_bytes, name=name))


def load_request_images(request, config, admit: Callable[[], None] | None = None,
                        clock: RenderClock | None = None) -> list[LoadedImage]:
    """Every image of a conversation, earlier turns first. The request is admitted from the images' headers before
    any is decoded: each image's and the request's pixels, its vision tokens against the prompt limit, and then
    `admit()` (the queue's room, say), which raises to turn it away. Then one image at a time is decoded, at the size
    the token budget allows. A document's pages (documents.expand_documents) are rendered here, timed by `clock`."""
    sources = [source for turn in request.history for source in turn.images] + list(request.images)
    headers = [read_header(source, max_pixels=config.max_image_pixels, max_bytes=config.max_image_bytes)
               for source in sources]
    total = sum(width * height for width, height in (header.size for header in headers))
    if total > config.max_request_pixels:
        raise InvalidImage(f"the request's {len(headers)} images hold {total / 1e6:.0f} megapixels together, over "
                           f"the {config.max_request_pixels / 1e6:.0f} megapixel limit per request")
    sizes = [fit_to_budget(*header.size, config.min_pixels, config.max_pixels) for header in headers]
    # Two tokens per image mark where it starts and ends: a lower bound of the prompt before any text.
    least = sum(vision_token_count(size) + 2 for size in sizes)
    if least > config.max_input_tokens:
        raise PromptTooLong(f"The images alone take {least} tokens; the prompt limit is {config.max_input_tokens}. "
                            "Send fewer or smaller images, or lower the image token budget.")
    if admit is not None:
        admit()
    return [decode(header, config.max_pixels, clock) for header in headers]


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB: alpha composited on white, 16/32-bit and float scaled, CMYK and palettes converted."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") else float(array.max()) if array.size else 1.0
        low = 0.0 if mode.startswith("I;16") else min(0.0, float(array.min()))
        scale = 255.0 / max(top - low, 1e-12)
        grey = np.clip((array - low) * scale, 0, 255).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def check_image(source, config) -> dict:
    """The verdict `check-images` prints: accepted with sizes and token counts (a document: its pages, those a
    request would read, and each one's size and tokens), or refused with the reason."""
    name = str(source) if isinstance(source, (str, Path)) else "upload"
    try:
        document = as_document(source, config.max_image_bytes)
        if document is not None:
            pages = pick_pages(document, config)
            clock = RenderClock()
            for page in pages:  # a page that cannot be rendered is found here, not at the first question
                decode(read_header(page, max_pixels=config.max_image_pixels, max_bytes=config.max_image_bytes),
                       clock=clock)
            resized = [fit_to_budget(*page.size, config.min_pixels, config.max_pixels) for page in pages]
            return {"file": name, "ok": True, "format": document.kind, "pages": pages[0].count,
                    "read_pages": [page.number for page in pages],
                    "page_sizes": [[round(side, 1) for side in page.points] for page in pages],
                    "rendered": [list(page.size) for page in pages], "resized": [list(size) for size in resized],
                    "vision_tokens": [vision_token_count(size) for size in resized],
                    "render_s": round(clock.seconds, 3)}
        loaded = load_image(source, max_pixels=config.max_image_pixels, max_bytes=config.max_image_bytes)
    except (InvalidImage, PromptTooLong) as exc:
        return {"file": name, "ok": False, "error": exc.message}
    except Exception as exc:  # the verdict is always printed, whatever the input
        return {"file": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    resized = fit_to_budget(*loaded.image.size, config.min_pixels, config.max_pixels)
    return {
        "file": name,
        "ok": True,
        "format": loaded.format,
        "size": list(loaded.original_size),
        "resized": list(resized),
        "vision_tokens": vision_token_count(resized),
    }
