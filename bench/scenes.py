"""Photographed pages made from a scan: the page on a textured desk, seen at a known tilt and turn, a shadow across
it. The OCR tests and `python -m bench.ocr` share them, so what is timed is what is tested."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
from PIL import Image

DESK = (1400, 1000)


def desk(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A wood-like texture: grain that waves, and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    swirl = cv2.GaussianBlur(rng.normal(0, 1, (height, width)).astype(np.float32), (0, 0), 25) * 60
    return 95 + 25 * np.sin((x + 0.3 * y) / 9 + swirl) + rng.normal(0, 10, (height, width))


def the_page(scan: Path, scale: float = 2.0) -> np.ndarray:
    """The scan enlarged as a phone sees a page, with a margin of its edge's paper round it (greyscale)."""
    page = np.asarray(Image.open(scan).convert("L"))
    page = cv2.resize(page, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
    ring = np.concatenate([page[:5].ravel(), page[-5:].ravel(), page[:, :5].ravel(), page[:, -5:].ravel()])
    return cv2.copyMakeBorder(page, 20, 20, 20, 20, cv2.BORDER_CONSTANT, value=int(np.median(ring)))


def photographed(page: np.ndarray, tilt: float = 0.0, turn: float = 0.0, shadow: bool = False,
                 size: tuple[int, int] = DESK) -> tuple[Image.Image, np.ndarray]:
    """The page on the desk: its far edge shortened as a camera tilted by `tilt` degrees sees it, turned by `turn`
    degrees, and, with `shadow`, darkened towards the right to a third. Returns the picture and the page's corners
    (top-left, top-right, bottom-right, bottom-left)."""
    height, width = page.shape
    frame_width, frame_height = size
    corners = np.float32([[0, 0], [width, 0], [width, height], [0, height]])
    centred = corners - np.float32([width / 2, height / 2])
    lean = np.tan(np.radians(tilt)) * 0.5
    centred = centred * np.float32([[1 - lean, 1], [1 - lean, 1], [1 + lean, 1], [1 + lean, 1]])
    angle = np.radians(turn)
    rotation = np.float32([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    placed = (centred @ rotation.T + np.float32([frame_width / 2, frame_height / 2])).astype(np.float32)
    homography = cv2.getPerspectiveTransform(corners, placed)
    seen = cv2.warpPerspective(page, homography, size, flags=cv2.INTER_CUBIC)
    inside = cv2.warpPerspective(np.full_like(page, 255), homography, size)
    picture = np.where(inside > 0, seen, desk(frame_width, frame_height)).astype(np.float32)
    if shadow:
        picture *= np.linspace(1.0, 0.35, frame_width, dtype=np.float32)[None, :]
    return Image.fromarray(np.clip(picture, 0, 255).astype(np.uint8)).convert("RGB"), placed
