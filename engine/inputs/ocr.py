"""Enhance a picture for reading its text, as document scanners do: find the page and flatten it, straighten its
lines, and threshold each neighbourhood on its own. OpenCV does each step (docs/decisions.md)."""
from __future__ import annotations

import cv2
import numpy as np
from PIL import Image

# The page is searched for on a copy this long on its longer side: corners to a pixel or two of the full picture.
SEARCH_SIDE = 640
# A page covers at least this share of the picture; at more than PAGE_FILLS it already fills it and is left alone.
MIN_PAGE_SHARE, PAGE_FILLS = 0.15, 0.9
# The share of its four-cornered outline that a region must fill to be taken for a page.
QUAD_FIT = 0.95
EDGE_INSET = 0.01
# The side of a neighbourhood, in pixels, and how much darker than its paper a pixel must be, at least, to be ink.
NEIGHBOURHOOD, INK_SHARE = (15, 51), 0.12
# More ink than this and the picture may be light on dark: a page of text inks a tenth or so of it.
DENSE_INK = 0.25
# Below this many pixels on a side there is no page, no line and no neighbourhood to speak of.
MIN_SIDE = 32
# Lines are straightened when they lean more than this, and measured only up to MAX_SKEW.
MIN_SKEW, MAX_SKEW = 0.2, 30.0


def enhance_for_ocr(image: Image.Image) -> Image.Image:
    """The page found and flattened (where the picture holds one), its lines made horizontal, then black ink on
    white by neighbourhood, so a shadow or a gradient keeps its text; light text on a dark ground comes out black on
    white too. A picture with no page keeps its size."""
    grey = np.asarray(image.convert("L"))
    if min(grey.shape) < MIN_SIDE:
        return Image.fromarray(threshold_by_neighbourhood(grey)).convert("RGB")
    corners = find_page(grey)
    if corners is not None:
        grey = flatten_page(grey, corners)
    binary = threshold_by_neighbourhood(grey)
    if (binary == 0).mean() > DENSE_INK:  # light on dark, perhaps (a slide, a terminal): text is the sparser reading
        inverted = threshold_by_neighbourhood(255 - grey)
        binary = min(binary, inverted, key=lambda reading: (reading == 0).mean())
    angle = skew_angle(binary)
    if abs(angle) >= MIN_SKEW:
        binary = rotate_keeping_size(binary, -angle)
    return Image.fromarray(binary).convert("RGB")


def find_page(grey: np.ndarray) -> np.ndarray | None:
    """The four corners (top-left, top-right, bottom-right, bottom-left; full-size pixels) of the largest
    four-cornered bright region that is a page, or None when there is none or it already fills the picture."""
    scale = SEARCH_SIDE / max(grey.shape)
    small = cv2.resize(grey, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA) if scale < 1 else grey
    scale = min(scale, 1.0)
    # Closing with a kernel wider than a letter paints the text over with its paper, so the page is one region.
    kernel = cv2.getStructuringElement(cv2.MORPH_RECT, (15, 15))
    paper = cv2.morphologyEx(cv2.GaussianBlur(small, (5, 5), 0), cv2.MORPH_CLOSE, kernel)
    area = small.shape[0] * small.shape[1]
    best, best_area = None, 0.0
    for mask in _page_masks(paper):
        contours, _ = cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
        for contour in contours:
            region = cv2.contourArea(contour)
            if region < MIN_PAGE_SHARE * area:
                continue
            quad = _quadrilateral(contour)
            if quad is None or _along_the_frame(quad.reshape(4, 2), small.shape):
                continue
            share = cv2.contourArea(quad) / area
            # A page fills its four corners and no more: a bright page merged with a bright cup beside it does not.
            if QUAD_FIT <= region / cv2.contourArea(quad) <= 1 / QUAD_FIT and share > best_area:
                best, best_area = quad, share
    if best is None or best_area >= PAGE_FILLS:
        return None
    return _order_corners(best.reshape(4, 2).astype(np.float32) / scale)


def _page_masks(paper: np.ndarray):
    """Candidate outlines of the page: the bright region (Otsu), and the closed edges, which a shadow across the
    page does not break."""
    _, bright = cv2.threshold(paper, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    yield cv2.morphologyEx(bright, cv2.MORPH_OPEN, cv2.getStructuringElement(cv2.MORPH_RECT, (9, 9)))
    edges = cv2.Canny(paper, 30, 90)
    yield cv2.dilate(edges, cv2.getStructuringElement(cv2.MORPH_RECT, (3, 3)))


def _along_the_frame(corners: np.ndarray, shape: tuple[int, int], margin: float = 0.01) -> bool:
    """Whether a side runs along the picture's edge: the region is cut by the frame, so it is not a page seen
    whole (a lighter part of a scan that fills the picture is not a page within it)."""
    height, width = shape
    near = margin * max(shape)
    for (x1, y1), (x2, y2) in zip(corners, np.roll(corners, -1, axis=0)):
        if (max(x1, x2) < near or min(x1, x2) > width - 1 - near or max(y1, y2) < near
                or min(y1, y2) > height - 1 - near):
            return True
    return False


def _quadrilateral(contour: np.ndarray) -> np.ndarray | None:
    """Four corners that the contour's hull follows within 2-3% of its perimeter, each side then fitted to the
    contour's points along it; None when no four-cornered convex polygon fits."""
    hull = cv2.convexHull(contour)
    perimeter = cv2.arcLength(hull, True)
    for tolerance in (0.02, 0.03):
        polygon = cv2.approxPolyDP(hull, tolerance * perimeter, True)
        if len(polygon) == 4 and cv2.isContourConvex(polygon):
            return _fit_sides(polygon.reshape(4, 2).astype(np.float64), contour.reshape(-1, 2).astype(np.float64),
                              tolerance * perimeter)
        if len(polygon) < 4:
            return None
    return None


def _fit_sides(corners: np.ndarray, points: np.ndarray, reach: float) -> np.ndarray:
    """Corners where lines fitted to each side's points meet: a corner hidden or rounded off moves the polygon's
    vertex, not the straight edges either side of it."""
    lines = []
    for start, end in zip(corners, np.roll(corners, -1, axis=0)):
        along = end - start
        length = np.linalg.norm(along)
        direction = along / length
        offset = points - start
        position = offset @ direction
        distance = np.abs(offset @ np.array([-direction[1], direction[0]]))
        near = points[(distance < reach) & (position > 0.1 * length) & (position < 0.9 * length)]
        if len(near) < 2:
            lines.append((direction, start))
            continue
        vx, vy, x0, y0 = cv2.fitLine(near.astype(np.float32), cv2.DIST_HUBER, 0, 0.01, 0.01).ravel()
        lines.append((np.array([vx, vy]), np.array([x0, y0])))
    fitted = []
    for (d1, p1), (d2, p2) in zip(lines[-1:] + lines[:-1], lines):  # the side before each corner, and after it
        matrix = np.array([d1, -d2], dtype=np.float64).T
        if abs(np.linalg.det(matrix)) < 1e-6:
            return corners.astype(np.float32).reshape(4, 1, 2)
        t = np.linalg.solve(matrix, p2 - p1)[0]
        fitted.append(p1 + t * d1)
    return np.array(fitted, dtype=np.float32).reshape(4, 1, 2)


def _order_corners(points: np.ndarray) -> np.ndarray:
    """Top-left, top-right, bottom-right, bottom-left: clockwise around their centre (y grows downwards), from the
    corner nearest the picture's top-left, for a page turned less than 45 degrees."""
    centre = points.mean(axis=0)
    clockwise = points[np.argsort(np.arctan2(points[:, 1] - centre[1], points[:, 0] - centre[0]))]
    return np.roll(clockwise, -int(np.argmin(clockwise.sum(axis=1))), axis=0).astype(np.float32)


def flatten_page(grey: np.ndarray, corners: np.ndarray) -> np.ndarray:
    """The page warped to a rectangle with its own proportions, as far as a photo tells them: the mean lengths of
    its opposite edges."""
    # A hair inside the found edges, so no sliver of the desk becomes a black frame round the page.
    corners = corners.mean(axis=0) + (corners - corners.mean(axis=0)) * (1 - EDGE_INSET)
    top_left, top_right, bottom_right, bottom_left = corners
    width = int(round((np.linalg.norm(top_right - top_left) + np.linalg.norm(bottom_right - bottom_left)) / 2))
    height = int(round((np.linalg.norm(bottom_left - top_left) + np.linalg.norm(bottom_right - top_right)) / 2))
    target = np.array([[0, 0], [width - 1, 0], [width - 1, height - 1], [0, height - 1]], dtype=np.float32)
    warp = cv2.getPerspectiveTransform(corners, target)
    return cv2.warpPerspective(grey, warp, (width, height), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)


def threshold_by_neighbourhood(grey: np.ndarray) -> np.ndarray:
    """Black ink on white: each pixel against its own neighbourhood's paper, the brightest that a square about two
    text lines wide holds (closing takes the letters out), smoothed. A shadow, soft or sharp, darkens a pixel and its
    paper alike. Ink is what is darker than its paper by INK_SHARE, or by Otsu's cut of those ratios if that is
    deeper, so an empty page or a flat sky stays white."""
    side = min(NEIGHBOURHOOD[1], max(NEIGHBOURHOOD[0], (min(grey.shape[:2]) // 8) | 1))
    square = cv2.getStructuringElement(cv2.MORPH_RECT, (side, side))
    paper = np.maximum(cv2.blur(cv2.morphologyEx(grey, cv2.MORPH_CLOSE, square), (side, side)), grey)
    ratio = cv2.divide(grey, paper, scale=255)
    otsu, _ = cv2.threshold(ratio, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    return np.where(ratio < min(otsu, 255 * (1 - INK_SHARE)), 0, 255).astype(np.uint8)


def skew_angle(binary: np.ndarray) -> float:
    """The angle, in degrees counterclockwise, that the text lines lean: each line smeared into one blob, and the
    median of the long blobs' angles (0 when the picture has no lines of text)."""
    ink = 255 - binary
    height, width = ink.shape
    word = max(9, width // 40)
    lines = cv2.morphologyEx(ink, cv2.MORPH_CLOSE, cv2.getStructuringElement(cv2.MORPH_RECT, (word, 3)))
    lines = cv2.morphologyEx(lines, cv2.MORPH_OPEN, cv2.getStructuringElement(cv2.MORPH_RECT, (word, 1)))
    contours, _ = cv2.findContours(lines, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    angles, weights = [], []
    for contour in contours:
        (_, _), (w, h), angle = cv2.minAreaRect(contour)
        if w < h:
            w, h, angle = h, w, angle - 90
        if w < width / 8 or w < 4 * h:
            continue  # not a line of text: a letter, a blot or a picture
        angle = (angle + 90) % 180 - 90
        if abs(angle) <= MAX_SKEW:
            angles.append(angle)
            weights.append(w)
    if len(angles) < 2:
        return 0.0
    order = np.argsort(angles)
    cumulative = np.cumsum(np.asarray(weights)[order])
    return -float(np.asarray(angles)[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def rotate_keeping_size(binary: np.ndarray, angle: float) -> np.ndarray:
    """Rotated about its centre by `angle` degrees counterclockwise, in a frame of the same size filled white."""
    height, width = binary.shape
    turn = cv2.getRotationMatrix2D((width / 2, height / 2), angle, 1.0)
    return cv2.warpAffine(binary, turn, (width, height), flags=cv2.INTER_NEAREST, borderValue=255)
