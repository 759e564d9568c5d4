"""Enhance for OCR on pictures made here from the bundled scans: each page pasted on a textured desk, photographed at
known tilts and turns (homographies), a shadow laid across; and photos with no page, and hostile shapes."""
from __future__ import annotations

import time

import cv2
import numpy as np
import pytest
from PIL import Image

from engine import ChatRequest
from engine.inputs.ocr import enhance_for_ocr, find_page
from engine.records.stages import OCR_ENHANCE
from fixtures.scenes import photographed, the_page


def line_angle(picture: Image.Image) -> float:
    """The turn, in degrees, that makes the ink's row profile sharpest: text lines lie along rows there. Measured
    apart from the enhancement's own method, on a fine grid."""
    ink = Image.fromarray(((np.asarray(picture.convert("L")) < 128) * 255).astype(np.uint8))
    ink.thumbnail((800, 800))
    scores = {}
    for angle in np.arange(-6.0, 6.01, 0.1):
        rows = np.asarray(ink.rotate(angle, resample=Image.BILINEAR)).sum(axis=1, dtype=np.float64)
        scores[round(float(angle), 1)] = float(np.var(rows))
    return max(scores, key=scores.get)


def ink_share(picture: Image.Image, box: tuple[float, float, float, float]) -> float:
    """The share of dark pixels inside a box given as fractions of the picture (left, top, right, bottom)."""
    grey = np.asarray(picture.convert("L"))
    height, width = grey.shape
    left, top, right, bottom = box
    return float((grey[int(top * height):int(bottom * height), int(left * width):int(right * width)] < 128).mean())


def overlap(quad: np.ndarray, other: np.ndarray) -> float:
    return cv2.intersectConvexConvex(quad.astype(np.float32), other.astype(np.float32))[0]


@pytest.mark.parametrize("scan", ["page.png", "text.png"])
@pytest.mark.parametrize("tilt, turn", [(0, 0), (30, 0), (0, 20), (20, 10), (30, -20), (15, -12)])
def test_a_photographed_page_is_found_and_flattened(images_dir, scan, tilt, turn):
    page = the_page(images_dir / scan)
    picture, corners = photographed(page, tilt, turn)
    found = find_page(np.asarray(picture.convert("L")))
    assert found is not None
    # The flattened picture is the found quadrilateral: the page fills at least 90% of it, and little of the page
    # is left out.
    shared = overlap(found, corners)
    assert shared >= 0.9 * cv2.contourArea(found) and shared >= 0.9 * cv2.contourArea(corners)
    enhanced = enhance_for_ocr(picture)
    assert set(np.unique(np.asarray(enhanced)).tolist()) <= {0, 255}
    height, width = page.shape
    if tilt == 0:  # a turned page keeps its proportions; a tilted one is as long as the photo shows it
        assert enhanced.width / enhanced.height == pytest.approx(width / height, rel=0.05)
    if scan == "page.png":  # its lines run along the page: they lie along the rows, as in the scan itself
        flat = enhance_for_ocr(Image.fromarray(page).convert("RGB"))
        assert abs(line_angle(enhanced) - line_angle(flat)) <= 1.0


def test_a_shadow_across_the_page_keeps_its_ink(images_dir):
    page = the_page(images_dir / "page.png")
    plain, _ = photographed(page, 10, 8)
    shaded, _ = photographed(page, 10, 8, shadow=True)
    in_light, in_shadow = enhance_for_ocr(plain), enhance_for_ocr(shaded)
    text = (0.05, 0.1, 0.95, 0.75)  # the heading and the paragraph
    dark_half = (0.55, 0.1, 0.95, 0.75)
    assert ink_share(in_shadow, dark_half) == pytest.approx(ink_share(in_light, dark_half), rel=0.35)
    assert ink_share(in_shadow, text) == pytest.approx(ink_share(in_light, text), rel=0.25)
    # one threshold for the whole picture, as before, blackens the shaded side
    grey = np.asarray(shaded.convert("L"))
    _, global_binary = cv2.threshold(grey, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    assert (global_binary[:, -200:] < 128).mean() > 3 * ink_share(in_shadow, dark_half)


@pytest.mark.parametrize("name", ["coffee.png", "astronaut.png", "hubble_deep_field.jpg", "page.png", "text.png"])
def test_a_picture_with_no_page_in_it_keeps_its_shape_and_size(images_dir, name):
    """Photos hold no page; the scans are a page that already fills the picture."""
    picture = Image.open(images_dir / name).convert("RGB")
    assert find_page(np.asarray(picture.convert("L"))) is None
    enhanced = enhance_for_ocr(picture)
    assert enhanced.size == picture.size
    assert ink_share(enhanced, (0, 0, 1, 1)) < 0.45  # black ink on white, not a speckled or inverted picture


def test_light_text_on_a_dark_ground_comes_out_black_on_white(images_dir):
    scan = Image.open(images_dir / "page.png").convert("RGB")
    dark = Image.fromarray(255 - np.asarray(scan))  # a slide or a terminal: light letters on black
    assert ink_share(enhance_for_ocr(dark), (0, 0, 1, 1)) == pytest.approx(
        ink_share(enhance_for_ocr(scan), (0, 0, 1, 1)), abs=0.05)


def test_twelve_megapixels_are_enhanced_within_two_seconds(images_dir):
    photo = Image.open(images_dir / "coffee.png").convert("RGB").resize((4000, 3000), Image.BICUBIC)
    page, _ = photographed(the_page(images_dir / "page.png", scale=6.0), 20, 10, size=(4000, 3000))
    for picture in (photo, page):
        started = time.perf_counter()
        enhanced = enhance_for_ocr(picture)
        assert time.perf_counter() - started < 2.0  # about 0.15 s on 2 cores; a shared machine is slower at times
    assert enhanced.width < 4000  # the page was found and flattened


@pytest.mark.parametrize("size, colour", [((1, 20000), "white"), ((20000, 1), "black"), ((2, 2), "grey"),
                                          ((800, 600), "white"), ((800, 600), "black")])
def test_hostile_shapes_come_back_as_pictures(size, colour):
    enhanced = enhance_for_ocr(Image.new("RGB", size, colour))
    assert enhanced.size == size and enhanced.mode == "RGB"


def test_the_engine_times_the_enhancement_and_keys_the_cache_by_it(make_engine, images_dir, tmp_path):
    picture, _ = photographed(the_page(images_dir / "page.png"), 20, 10)
    path = tmp_path / "photo.png"
    picture.save(path)
    engine = make_engine()
    first = engine.ask(ChatRequest("Read the text", images=(str(path),), enhance_for_ocr=True,
                                        max_new_tokens=2))
    assert first.metrics.status == "ok" and first.metrics.stages[OCR_ENHANCE] > 0
    again = engine.ask(ChatRequest("Read the text", images=(str(path),), enhance_for_ocr=True,
                                        max_new_tokens=2))
    plain = engine.ask(ChatRequest("Read the text", images=(str(path),), max_new_tokens=2))
    assert again.metrics.cached_prompt_tokens > first.metrics.vision_tokens  # the same enhanced picture: reused
    assert OCR_ENHANCE not in plain.metrics.stages
    assert plain.metrics.cached_prompt_tokens < plain.metrics.prompt_tokens - plain.metrics.vision_tokens  # not reused
