"""Do two benchmark runs agree? Compares every fsdp_plus / FSDP2-loop ratio of two ``results.json`` files.

    python -m benchmarks.compare outputs/benchmarks/a/results.json outputs/benchmarks/b/results.json

Two runs agree on a ratio when the difference of their medians is within their spreads: at most the sum
of their half-ranges (min-max over repetitions). Exits 1 if any ratio disagrees or is missing from one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def agree(a: dict[str, float], b: dict[str, float]) -> bool:
    """True when |median_a - median_b| <= half of a's range + half of b's range."""
    slack = (a["max"] - a["min"]) / 2 + (b["max"] - b["min"]) / 2
    return abs(a["median"] - b["median"]) <= slack


def compare(first: dict[str, Any], second: dict[str, Any]) -> tuple[bool, str]:
    """(all agree, a Markdown table) for the overhead ratios of two results documents."""
    ra, rb = first["overhead_vs_best_reference"], second["overhead_vs_best_reference"]
    lines = ["| ratio | run A median (min-max) | run B median (min-max) | agree |", "|---|---|---|---|"]
    ok = set(ra) == set(rb)
    for name in sorted(set(ra) | set(rb)):
        if name not in ra or name not in rb:
            presence = ["present" if name in r else "-" for r in (ra, rb)]
            lines.append(f"| {name} | {presence[0]} | {presence[1]} | no |")
            continue
        a, b = ra[name], rb[name]
        same = agree(a, b)
        ok &= same
        cells = [f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" for r in (a, b)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {'yes' if same else 'NO'} |")
    return ok, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Print the comparison; exit 1 when the runs disagree."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    ok, table = compare(*(json.loads(path.read_text()) for path in (args.first, args.second)))
    print(table + ("every ratio agrees within the runs' spread" if ok else "the runs disagree"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
