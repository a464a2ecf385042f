#!/usr/bin/env python3
"""Reads the lines of the load command (scripts/load-table writes them to
docs/perf/load.txt), prints docs/guide/performance.md's per-backend table in Markdown and
writes an SVG bar chart of duplicate-hit latency per tier.

    python3 scripts/perf_report.py docs/perf/load.txt docs/perf/tier-latency.svg
"""

import math
import sys


def parse(path):
    runs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("load "):
                continue
            fields = dict(p.split("=", 1) for p in line.split()[1:])
            runs.append(fields)
    return runs


def ops(r):
    return f"{float(r['ops_per_sec']):,.0f}"


def us(v):
    v = float(v)
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f} µs"


def table(runs):
    by = {(r["backend"], r["mix"], r["concurrency"]): r for r in runs}
    backends = [b for b in ["memory", "postgres", "postgres-tx", "redis", "redis-cluster", "tiered"]
                if any(k[0] == b for k in by)]
    out = ["| backend | keys | c=1 ops/s | c=1 p50 / p99 | c=64 ops/s | c=64 p50 / p99 |",
           "|---|---|---|---|---|---|"]
    for b in backends:
        for mix in ["fresh", "duplicate", "contended"]:
            cells = []
            for c in ["1", "64"]:
                r = by.get((b, mix, c))
                if r is None:
                    cells += ["", ""]
                else:
                    cells += [ops(r), f"{us(r['p50_us'])} / {us(r['p99_us'])}"]
            out.append(f"| {b} | {mix} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def svg(runs, path):
    tiers = [("tiered", "moka"), ("tiered-redis", "Redis"), ("tiered-postgres", "PostgreSQL")]
    data = []
    for backend, label in tiers:
        r = next((r for r in runs if r["backend"] == backend and r["mix"] == "duplicate"
                  and r["concurrency"] == "1"), None)
        if r is not None:
            data.append((label, float(r["p50_us"]), float(r["p99_us"])))
    if not data:
        sys.exit("no tier runs (duplicate, concurrency 1) in the input")
    width, height = 640, 360
    left, right, top, bottom = 80, 20, 50, 60
    plot_w, plot_h = width - left - right, height - top - bottom
    lo, hi = 0.1, 10 ** math.ceil(math.log10(max(p99 for _, _, p99 in data)))

    def y(v):
        v = max(v, lo)
        return top + plot_h * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="15">'
             'Duplicate of a completed key, by the tier that answers (concurrency 1)</text>']
    decade = lo
    while decade <= hi * 1.0001:
        yy = y(decade)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd"/>')
        label = f"{decade:g} µs" if decade < 1000 else f"{decade / 1000:g} ms"
        parts.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">{label}</text>')
        decade *= 10
    group_w = plot_w / len(data)
    bar_w = group_w / 4
    for i, (label, p50, p99) in enumerate(data):
        x0 = left + i * group_w + group_w / 4
        for j, (v, color, name) in enumerate([(p50, "#4e79a7", "p50"), (p99, "#f28e2b", "p99")]):
            x = x0 + j * bar_w
            yy = y(v)
            parts.append(f'<rect x="{x:.1f}" y="{yy:.1f}" width="{bar_w - 4:.1f}" '
                         f'height="{top + plot_h - yy:.1f}" fill="{color}"><title>{name} {v} µs</title></rect>')
            parts.append(f'<text x="{x + (bar_w - 4) / 2:.1f}" y="{yy - 4:.1f}" text-anchor="middle" '
                         f'font-size="10">{us(v)}</text>')
        parts.append(f'<text x="{x0 + bar_w:.1f}" y="{top + plot_h + 18}" text-anchor="middle">{label}</text>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="black"/>')
    lx = width - right - 110
    parts.append(f'<rect x="{lx}" y="{top - 8}" width="10" height="10" fill="#4e79a7"/>'
                 f'<text x="{lx + 14}" y="{top + 1}">p50</text>')
    parts.append(f'<rect x="{lx + 50}" y="{top - 8}" width="10" height="10" fill="#f28e2b"/>'
                 f'<text x="{lx + 64}" y="{top + 1}">p99</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle" fill="#555" font-size="10">'
                 'latency per duplicate, log scale; cargo run --release --example load -- --mix duplicate '
                 '--concurrency 1</text>')
    parts.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts) + "\n")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    runs = parse(sys.argv[1])
    print(table(runs))
    svg(runs, sys.argv[2])
    print(f"\nwrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
