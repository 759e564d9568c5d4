"""`python -m bench.ocr [--out F.json]`: what Enhance for OCR costs on 12-megapixel pictures, and OpenCV against
scikit-image for each of its steps at that size, with what each library installs. docs/decisions.md keeps a run.

Pictures: a photo (coffee.png enlarged) and a page photographed at a 20-degree tilt and 10-degree turn on a desk
(fixtures/scenes.py). Each time is the best of --repeats runs.
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import time
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from engine.inputs.ocr import enhance_for_ocr, find_page
from fixtures.scenes import photographed, the_page

from .cli import machine_line, write_results
from .harness import default_images_dir

TWELVE_MP = (4000, 3000)


def best_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def installed_mb(distribution: str) -> float | None:
    """The bytes a distribution put on disk, from its RECORD, in MB (None when it is not installed)."""
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return None
    return sum(file.size or 0 for file in files) / 1e6


def library_steps(grey: np.ndarray, corners: np.ndarray, repeats: int) -> list[dict]:
    """Each step of the enhancement in OpenCV and, where it imports, scikit-image, on the same 12 MP picture."""
    width, height = 2400, 1200
    target = np.float32([[0, 0], [width - 1, 0], [width - 1, height - 1], [0, height - 1]])
    warp = cv2.getPerspectiveTransform(corners, target)
    small = cv2.resize(grey, (640, 480), interpolation=cv2.INTER_AREA)
    mask = cv2.threshold(small, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)[1]
    rows = [
        {"step": "paper of each neighbourhood (closing, 51 px square)", "library": "opencv",
         "ms": best_ms(lambda: cv2.morphologyEx(grey, cv2.MORPH_CLOSE, np.ones((51, 51), np.uint8)), repeats)},
        {"step": "mean of each neighbourhood (51 px square)", "library": "opencv",
         "ms": best_ms(lambda: cv2.blur(grey, (51, 51)), repeats)},
        {"step": "perspective warp to 2400x1200", "library": "opencv",
         "ms": best_ms(lambda: cv2.warpPerspective(grey, warp, (width, height), flags=cv2.INTER_CUBIC), repeats)},
        {"step": "outlines and four corners (640x480 mask)", "library": "opencv",
         "ms": best_ms(lambda: [cv2.approxPolyDP(c, 5, True) for c in
                                cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)[0]], repeats)},
        {"step": "rotate by 2 degrees", "library": "opencv",
         "ms": best_ms(lambda: cv2.warpAffine(grey, cv2.getRotationMatrix2D((2000, 1500), 2, 1), TWELVE_MP), repeats)},
    ]
    try:
        from skimage import filters, measure, morphology, transform
    except ImportError:
        return rows + [{"step": "all", "library": "scikit-image", "ms": None, "note": "not installed"}]
    projective = transform.ProjectiveTransform.from_estimate(target, corners)
    rows += [
        {"step": "paper of each neighbourhood (closing, 51 px square)", "library": "scikit-image",
         "ms": best_ms(lambda: morphology.closing(grey, morphology.footprint_rectangle((51, 51),
                                                                                   decomposition="separable")),
                       repeats)},
        {"step": "mean of each neighbourhood (51 px square)", "library": "scikit-image",
         "ms": best_ms(lambda: filters.threshold_local(grey, 51, method="mean"), repeats)},
        {"step": "perspective warp to 2400x1200", "library": "scikit-image",
         "ms": best_ms(lambda: transform.warp(grey, projective, output_shape=(height, width), order=3), repeats)},
        {"step": "outlines and four corners (640x480 mask)", "library": "scikit-image",
         "ms": best_ms(lambda: [measure.approximate_polygon(c, 5) for c in measure.find_contours(mask, 128)],
                       repeats)},
        {"step": "rotate by 2 degrees", "library": "scikit-image",
         "ms": best_ms(lambda: transform.rotate(grey, 2), repeats)},
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ocr", description=__doc__.splitlines()[0])
    parser.add_argument("--images", help="folder with page.png and coffee.png (default ../shared/images)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench-results/ocr.json")
    args = parser.parse_args(argv)
    images = Path(args.images) if args.images else default_images_dir()
    photo = Image.open(images / "coffee.png").convert("RGB").resize(TWELVE_MP, Image.BICUBIC)
    page, corners = photographed(the_page(images / "page.png", scale=6.0), 20, 10, size=TWELVE_MP)
    stage = [{"picture": name, "ms": best_ms(lambda: enhance_for_ocr(picture), args.repeats),
              "page found": find_page(np.asarray(picture.convert("L"))) is not None}
             for name, picture in (("photo, 4000x3000", photo), ("photographed page, 4000x3000", page))]
    steps = library_steps(np.asarray(page.convert("L")), corners, args.repeats)
    sizes = {name: installed_mb(name) for name in ("opencv-python-headless", "scikit-image", "scipy", "networkx",
                                                   "imageio", "tifffile", "lazy-loader")}
    lines = [machine_line() + f"; OpenCV {cv2.__version__}; best of {args.repeats}", "",
             "| picture | Enhance for OCR ms | page found |", "|---|---|---|"]
    lines += [f"| {row['picture']} | {row['ms']:.0f} | {row['page found']} |" for row in stage]
    lines += ["", "| step, 12 MP | library | ms |", "|---|---|---|"]
    lines += [f"| {row['step']} | {row['library']} | {_ms(row['ms'])} |"
              for row in steps]
    lines += ["", "| distribution | installed MB |", "|---|---|"]
    lines += [f"| {name} | {'not installed' if size is None else f'{size:.1f}'} |" for name, size in sizes.items()]
    text = "\n".join(lines) + "\n"
    write_results(args.out, {"stage": stage, "steps": steps, "installed_mb": sizes}, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
