"""Image intake: every accepted format becomes RGB at the right size; every bad input is an InvalidImage."""
from __future__ import annotations

import io
import json
import random
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from engine.errors import InvalidImage
from engine.inputs.images import load_image
from engine.inputs.limits import fit_to_budget, vision_token_count

from .conftest import ROOT

LIMITS = dict(max_pixels=64_000_000, max_bytes=50 * 1024 * 1024)
MIN_PIXELS, MAX_PIXELS = 64 * 1024, 1024 * 1024


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def photo(size=(120, 80)) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def test_real_images_are_accepted_with_sizes_and_tokens(images_dir):
    files = sorted(p for p in images_dir.iterdir() if p.suffix in (".png", ".jpg"))
    assert len(files) >= 5
    for path in files:
        loaded = load_image(path, **LIMITS)
        assert loaded.image.mode == "RGB"
        with Image.open(path) as original:
            assert loaded.original_size == original.size
        width, height = fit_to_budget(*loaded.image.size, MIN_PIXELS, MAX_PIXELS)
        assert width % 32 == 0 and height % 32 == 0
        assert MIN_PIXELS <= width * height <= MAX_PIXELS
        assert vision_token_count((width, height)) == (width // 32) * (height // 32)


def test_budget_keeps_aspect_and_caps_tokens():
    assert fit_to_budget(448, 448, MIN_PIXELS, MAX_PIXELS) == (448, 448)
    assert vision_token_count((448, 448)) == 196
    width, height = fit_to_budget(4000, 3000, MIN_PIXELS, MAX_PIXELS)
    assert vision_token_count((width, height)) <= 1024
    assert abs(width / height - 4 / 3) < 0.05
    # tiny images are scaled up to the minimum budget
    width, height = fit_to_budget(10, 10, MIN_PIXELS, MAX_PIXELS)
    assert width * height >= MIN_PIXELS


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "TIFF", "GIF"])
def test_formats_decode_to_rgb(fmt):
    loaded = load_image(encode(photo(), fmt), **LIMITS)
    assert loaded.image.mode == "RGB" and loaded.image.size == (120, 80)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "1", "CMYK", "P", "I;16", "I", "F"])
def test_modes_convert_to_rgb(mode):
    base = photo()
    image = base.convert(mode) if mode not in ("I;16", "I", "F") else Image.fromarray(
        (np.asarray(base.convert("L"), dtype=np.float64) * 257).astype({"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode])
    )
    fmt = "TIFF" if mode in ("CMYK", "I", "F") else "PNG"
    loaded = load_image(encode(image, fmt), **LIMITS)
    assert loaded.image.mode == "RGB"
    # brightness survives the conversion (16-bit and float are rescaled, not clipped to white)
    assert 40 < np.asarray(loaded.image).mean() < 215


def test_transparent_pixels_become_white():
    image = Image.new("RGBA", (50, 50), (255, 0, 0, 0))
    loaded = load_image(encode(image, "PNG"), **LIMITS)
    assert np.asarray(loaded.image)[0, 0].tolist() == [255, 255, 255]


def test_animated_gif_uses_first_frame():
    frames = [Image.new("RGB", (40, 30), color) for color in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    pixel = np.asarray(load_image(buffer.getvalue(), **LIMITS).image)[0, 0]
    assert pixel[0] > 200 and pixel[2] < 50


def test_exif_orientation_is_applied():
    image = photo((120, 80))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    loaded = load_image(encode(image, "JPEG", exif=exif), **LIMITS)
    assert loaded.original_size == (120, 80)
    assert loaded.image.size == (80, 120)


def png_with_header_size(width: int, height: int) -> bytes:
    """A valid tiny PNG whose header claims another size: a decompression bomb's signature, cheaply."""
    data = bytearray(encode(Image.new("L", (8, 8)), "PNG"))
    ihdr = 8 + 8  # signature, then length and type of the first chunk
    data[ihdr:ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[12:ihdr + 13]))
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: b"", "empty"),
        (lambda: b"hello, this is plain text and not an image\n" * 10, "not an image"),
        (lambda: encode(photo(), "JPEG")[:400], "truncated or corrupt"),
        (lambda: encode(photo(), "PNG")[:300], "truncated or corrupt"),
        (lambda: png_with_header_size(100_000, 100_000), "megapixel limit"),
        (lambda: encode(Image.new("RGB", (4000, 10)), "PNG"), "aspect ratio"),
    ],
    ids=["empty", "text", "truncated-jpeg", "truncated-png", "bomb", "aspect"],
)
def test_bad_input_is_refused_with_a_reason(make, reason):
    with pytest.raises(InvalidImage, match=reason):
        load_image(make(), **LIMITS)


def test_oversized_file_and_missing_path(tmp_path):
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * 2048)
    with pytest.raises(InvalidImage, match="limit"):
        load_image(big, max_pixels=10**6, max_bytes=1024)
    with pytest.raises(InvalidImage, match="cannot read"):
        load_image(tmp_path / "missing.png", **LIMITS)


def test_mutated_files_never_escape_as_other_errors():
    rng = random.Random(1234)
    seeds = [encode(photo((64, 48)), fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP")]
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(300):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 12)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(1, len(data))]
        try:
            load_image(bytes(data), **LIMITS)
            outcomes["ok"] += 1
        except InvalidImage:
            outcomes["refused"] += 1
    assert outcomes["ok"] + outcomes["refused"] == 300 and outcomes["refused"] > 0


def test_check_images_cli(images_dir, tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    run = subprocess.run(
        [sys.executable, "-m", "engine", "check-images", str(images_dir / "page.png"), str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines[0]["ok"] is True and lines[0]["size"] == [384, 191]
    width, height = lines[0]["resized"]
    assert lines[0]["vision_tokens"] == width * height // 1024
    assert lines[1] == {"file": str(bad), "ok": False, "error": lines[1]["error"]} and "not an image" in lines[1]["error"]
    ok = subprocess.run([sys.executable, "-m", "engine", "check-images", str(images_dir / "rocket.jpg")],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True


def test_every_format_pillow_can_write_is_accepted_or_refused_cleanly():
    from PIL import Image as PILImage

    PILImage.init()
    tried = 0
    for fmt in sorted(PILImage.SAVE):
        try:
            data = encode(photo((64, 48)), fmt)
        except Exception:  # a format Pillow cannot write an RGB picture in (or needs options) is not input here
            continue
        tried += 1
        try:
            loaded = load_image(data, **LIMITS)
        except InvalidImage as exc:
            assert exc.message
        else:
            assert loaded.image.mode == "RGB" and loaded.image.size[0] > 0
    assert tried >= 10


def test_file_type_comes_from_content_not_name(tmp_path):
    misnamed = tmp_path / "holiday.jpg"
    misnamed.write_bytes(encode(photo(), "PNG"))
    assert load_image(misnamed, **LIMITS).format == "PNG"
    fake = tmp_path / "scan.png"
    fake.write_text("%PDF-1.4 not really an image")
    with pytest.raises(InvalidImage, match="not an image"):
        load_image(fake, **LIMITS)
