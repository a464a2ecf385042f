#!/usr/bin/env python3
"""Reads the load lines of scripts/scaling and writes an SVG line chart of
ops/s against concurrency (log scale), one line per backend and mix, and
prints a Markdown table of the same figures.

    python3 scripts/scaling_plot.py docs/perf/scaling.txt docs/perf/scaling.svg
"""

import math
import sys


def parse(path):
    series = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("load "):
                continue
            r = dict(p.split("=", 1) for p in line.split()[1:])
            name = f"{r['backend']} {r['mix']}"
            series.setdefault(name, []).append(
                (int(r["concurrency"]), float(r["ops_per_sec"]), int(r.get("max_rss_kb", 0)))
            )
    return series


COLORS = ["#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#2ca02c", "#98df8a"]


def svg(series, path):
    w, h, left, right, top, bottom = 720, 420, 80, 190, 30, 50
    conc = sorted({c for pts in series.values() for c, _, _ in pts})
    ymax = max(v for pts in series.values() for _, v, _ in pts)
    # a round top for the axis
    mag = 10 ** math.floor(math.log10(ymax))
    ytop = math.ceil(ymax / mag) * mag
    lx0, lx1 = math.log(conc[0]), math.log(conc[-1])

    def x(c):
        return left + (math.log(c) - lx0) / ((lx1 - lx0) or 1) * (w - left - right)

    def y(v):
        return top + (1 - v / ytop) * (h - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="14">ops/s through Idempotency::process against concurrency</text>',
    ]
    for i in range(6):
        v = ytop * i / 5
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{w - right}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:,.0f}</text>')
    for c in conc:
        out.append(f'<line x1="{x(c):.1f}" y1="{top}" x2="{x(c):.1f}" y2="{h - bottom}" stroke="#eee"/>')
        out.append(f'<text x="{x(c):.1f}" y="{h - bottom + 16}" text-anchor="middle">{c}</text>')
    out.append(f'<text x="{(left + w - right) / 2:.0f}" y="{h - 12}" text-anchor="middle">concurrent tasks</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        pts = sorted(pts)
        color = COLORS[i % len(COLORS)]
        d = " ".join(f"{'M' if j == 0 else 'L'}{x(c):.1f},{y(v):.1f}" for j, (c, v, _) in enumerate(pts))
        out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        for c, v, _ in pts:
            out.append(f'<circle cx="{x(c):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>')
        ly = top + 20 + i * 20
        out.append(f'<line x1="{w - right + 15}" y1="{ly}" x2="{w - right + 40}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{w - right + 46}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def table(series):
    conc = sorted({c for pts in series.values() for c, _, _ in pts})
    print("| backend, keys | " + " | ".join(f"c={c}" for c in conc) + " | c=256 / best | RSS at c=256 |")
    print("|---|" + "---|" * (len(conc) + 2))
    for name, pts in sorted(series.items()):
        by = {c: (v, rss) for c, v, rss in pts}
        best = max(v for v, _ in by.values())
        last = by.get(conc[-1], (0, 0))
        cells = " | ".join(f"{by[c][0]:,.0f}" if c in by else "" for c in conc)
        print(f"| {name} | {cells} | {last[0] / best:.2f} | {last[1] / 1024:.0f} MiB |")


if __name__ == "__main__":
    s = parse(sys.argv[1])
    svg(s, sys.argv[2])
    table(s)
