#!/usr/bin/env python3
"""Draw a PNG chart from the JSON that `bench/tcp_vs_mooncake.py --json FILE` writes: operations
per second of every engine (Mooncake, Ferry, and Ferry with authentication or a baseline build
when measured) for each case (operation, block size, batch, threads), medians of the rounds on a
log scale, with each round's value as a tick so the spread shows.

Usage:
  python3 bench/chart.py RESULTS.json CHART.png [--title TEXT]
  python3 bench/tcp_vs_mooncake.py ... --json r.json --chart chart.png   (the same, at the end)

Plotting needs matplotlib, which the benchmarks themselves do not: `pip install matplotlib`
(or `apt install python3-matplotlib`). Without it this script says so and exits with status 2;
the benchmark's table and JSON are written regardless.
"""
import argparse
import json
import statistics
import sys

MISSING = ("the chart needs matplotlib: pip install matplotlib (or apt install python3-matplotlib); "
           "the results are in the JSON file")


def chart(results_path, png_path, title=None):
    """Writes the chart; returns False (after saying why) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING, file=sys.stderr)
        return False
    with open(results_path) as f:
        data = json.load(f)
    engines = data["engines"]
    results = data["results"]
    labels = []
    for r in results:
        c = r["case"]
        block = c["block"]
        size = f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"
        labels.append(f"{c['op']} {size}\nbatch {c['batch']} x{c['threads']}")
    n = len(results)
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * n + 2), 5.5))
    for k, name in enumerate(engines):
        xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(n)]
        medians = [statistics.median(run[0] for run in r["runs"][name]) for r in results]
        ax.bar(xs, medians, width, label=name)
        for x, r in zip(xs, results):
            for run in r["runs"][name]:
                ax.plot([x - width / 3, x + width / 3], [run[0], run[0]], color="black", linewidth=0.6)
    ax.set_yscale("log")
    ax.set_ylabel("operations per second (median of rounds; ticks: each round)")
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, fontsize=8)
    ax.legend()
    rounds = data.get("rounds")
    ax.set_title(title or f"Ferry vs Mooncake over loopback TCP ({rounds} alternating rounds)")
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"chart written to {png_path}")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="JSON written by tcp_vs_mooncake.py --json")
    ap.add_argument("png", help="the PNG to write")
    ap.add_argument("--title")
    a = ap.parse_args()
    return 0 if chart(a.results, a.png, a.title) else 2


if __name__ == "__main__":
    sys.exit(main())
