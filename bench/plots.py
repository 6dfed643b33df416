"""Charts for docs/benchmarks.md from the JSON the benchmarks wrote (no measuring here).

* ``docs/img/bench_relay.png``: events/s of the relay next to its two ceilings, the
  CPU bound of doing both on this machine's cores, and the alternatives.
* ``docs/img/bench_write.png``: the outbox write's overhead per write path.
* ``docs/img/bench_concurrent_writers.png``: throughput kept against no outbox, per mode
  and number of writers.

    python bench/plots.py            # after make bench (run_all runs it at the end)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
IMG = Path(__file__).parent.parent / "docs" / "img"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def relay_chart(relay: dict[str, Any], alt: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars: list[tuple[str, float, str]] = [
        ("ceiling (a): bare Kafka producer", relay["kafka_ceiling"]["rate"], "#9e9e9e"),
        ("bound: both ceilings' CPU on the cores", relay["cpu_bound"]["rate"], "#bdbdbd"),
        ("ceiling (b): bare claim + settle SQL", relay["sql_ceiling"]["rate"], "#9e9e9e"),
        ("outboxkit relay (defaults)", relay["relay"]["rate"], "#1f77b4"),
        ("outboxkit relay, batch 500 x 2", relay["relay_generic"]["rate"], "#6baed6"),
    ]
    if alt is not None:
        best_naive = max(alt["naive"], key=lambda r: r["rate"])
        best_pgq = max(alt["pgqueuer"], key=lambda r: r["rate"])
        bars += [
            (
                f"hand-written relay (batch {best_naive['batch_size']})",
                best_naive["rate"],
                "#fdae6b",
            ),
            (
                f"pgqueuer + Kafka handler (batch {best_pgq['batch_size']})",
                best_pgq["rate"],
                "#e6550d",
            ),
        ]
    bars.append(("outboxkit relay -> NATS JetStream", relay["nats"]["rate"], "#31a354"))
    fig, ax = plt.subplots(figsize=(9, 4.6))
    labels = [b[0] for b in bars][::-1]
    values = [b[1] / 1000 for b in bars][::-1]
    ax.barh(labels, values, color=[b[2] for b in bars][::-1])
    for y, v in enumerate(values):
        ax.text(v + 2, y, f"{v:,.0f}k", va="center", fontsize=8)
    ax.set_xlabel(
        "thousand events/s (200 000 events, 2 cores shared with PostgreSQL and the broker)"
    )
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_title("Relay throughput to Kafka (Tansu), one process")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"-> {path}")


def write_chart(write: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wanted = {
        "psycopg (sync)": [
            "outbox.transaction, notify off",
            "outbox.execute_with, notify off",
            "outbox.put, notify off",
        ],
        "psycopg (async)": [
            "outbox.atransaction, notify off",
            "outbox.aexecute_with, notify off",
            "outbox.aput, notify off",
        ],
        "asyncpg": ["outbox.aexecute_with, notify off", "outbox.aput, notify off"],
        "SQLAlchemy Session (psycopg)": ["outbox.put, notify off"],
        "SQLAlchemy AsyncSession (asyncpg)": ["outbox.aput, notify off"],
    }
    rows = [
        (f"{r['path']}: {r['variant'].split(',')[0]}", r["overhead_pct"], r["ci95_pct"])
        for path_name, variants in wanted.items()
        for variant in variants
        for r in write["results"]
        if r["path"] == path_name and r["variant"] == variant
    ]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels = [r[0] for r in rows][::-1]
    values = [r[1] for r in rows][::-1]
    errors = [[r[1] - r[2][0] for r in rows][::-1], [r[2][1] - r[1] for r in rows][::-1]]
    colors = [
        "#1f77b4" if "transaction" in lab or "execute_with" in lab else "#9ecae1" for lab in labels
    ]
    ax.barh(labels, values, xerr=errors, color=colors, capsize=3)
    ax.axvline(2.0, color="#d62728", linestyle="--", linewidth=1)
    ax.text(2.1, len(labels) - 0.6, "target +2 %", color="#d62728", fontsize=8)
    ax.set_xlabel("extra latency of the reference transaction (median, 95 % CI), notify off")
    ax.set_title("What the outbox write costs, per write path")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"-> {path}")


def concurrent_chart(cw: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in cw["results"] if r["mode"] != "none" and not r.get("diagnostic")]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    counts = sorted({r["writers"] for r in rows})
    width = 0.8 / len(counts)
    fig, ax = plt.subplots(figsize=(9, 4.6))
    palette = ["#c6dbef", "#6baed6", "#2171b5", "#08306b"]
    for j, n in enumerate(counts):
        values = [
            next((r["ratio_vs_none"] for r in rows if r["mode"] == m and r["writers"] == n), 0)
            for m in modes
        ]
        ys = [i + (j - (len(counts) - 1) / 2) * width for i in range(len(modes))]
        ax.barh(ys, values, height=width, color=palette[j % len(palette)], label=f"{n} writers")
    ax.axvline(0.9, color="#d62728", linestyle="--", linewidth=1)
    ax.text(0.905, len(modes) - 0.5, "target 0.90", color="#d62728", fontsize=8)
    ax.set_yticks(range(len(modes)), modes)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3)
    ax.set_xlabel("throughput / no-outbox throughput, same moments (median of paired rounds)")
    ax.set_title("Many writers: the reference transaction plus one event")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"-> {path}")


def main() -> int:
    IMG.mkdir(parents=True, exist_ok=True)
    relay, alt, write = _load("relay_throughput"), _load("alternatives"), _load("write_overhead")
    if relay is not None:
        relay_chart(relay, alt, IMG / "bench_relay.png")
    if write is not None:
        write_chart(write, IMG / "bench_write.png")
    cw = _load("concurrent_writers")
    if cw is not None:
        concurrent_chart(cw, IMG / "bench_concurrent_writers.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
