#!/usr/bin/env python3
"""Turns the `reliability ...` lines that tests/faults.rs prints into the
Markdown tables of RELIABILITY.md.

    cargo test --all-features --test faults -- --nocapture | grep '^reliability' > docs/reliability.txt
    python3 scripts/reliability_report.py docs/reliability.txt
"""

import sys

BACKENDS = ["memory", "postgres", "postgres-tx", "redis", "redis-cluster", "tiered"]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    runs = []
    with open(sys.argv[1], encoding="utf-8") as f:
        for line in f:
            if line.startswith("reliability "):
                runs.append(dict(p.split("=", 1) for p in line.split()[1:]))
    order = {b: i for i, b in enumerate(BACKENDS)}
    runs.sort(key=lambda r: (r["scenario"], order.get(r["backend"], 99)))
    groups = {}
    for r in runs:
        groups.setdefault(r["scenario"], []).append(r)
    for scenario, rows in groups.items():
        cols = [k for k in rows[0] if k not in ("scenario", "backend")]
        print(f"\n**{scenario}**\n")
        print("| backend | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for r in rows:
            print(f"| {r['backend']} | " + " | ".join(r.get(c, "") for c in cols) + " |")


if __name__ == "__main__":
    main()
