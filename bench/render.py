"""Render a committed run's report as HTML: `python -m bench.render docs/bench/<kind>/bench.json [--out F]`.

Committed runs keep their JSON and markdown only; the HTML carries all of plotly.js (about 4.7 MB), so it is made
on the viewer's machine from the installed plotly."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from speed.tables import html_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.render", description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a bench.json")
    parser.add_argument("--out", help="the HTML file (default: bench.html beside the JSON)")
    args = parser.parse_args(argv)
    source = Path(args.json)
    out = Path(args.out) if args.out else source.with_suffix(".html")
    html_report(json.loads(source.read_text()), out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
