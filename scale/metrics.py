"""The replicas' own metrics (each one's /metrics text) as one Prometheus text, every sample labelled by replica."""
from __future__ import annotations

import re

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$")


def _labelled(line: str, replica: str) -> str:
    match = SAMPLE.match(line)
    if match is None:
        return line
    labels = f'replica="{replica}"' + (f",{match['labels']}" if match["labels"] else "")
    return f"{match['name']}{{{labels}}} {match['value']}"


def cluster_metrics(snapshots: list[dict]) -> str:
    """Each family's HELP and TYPE once, then its samples from every replica, in the order the first names them."""
    families: dict[str, list[str]] = {}  # family name -> its header lines, then its samples
    for snapshot in snapshots:
        family = None
        for line in snapshot["metrics"].splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                lines = families.setdefault(family, [])
                if line not in lines:  # the first replica's header; the others repeat it
                    lines.append(line)
            elif line.strip() and family is not None:
                families[family].append(_labelled(line, snapshot["replica"]))
    lines = ["# HELP vlscope_replicas Replicas that reported in the last seconds.", "# TYPE vlscope_replicas gauge",
             f"vlscope_replicas {len(snapshots)}"]
    for family_lines in families.values():
        lines += family_lines
    return "\n".join(lines) + "\n"
