"""``outboxkit relay`` (the CLI process, defaults) next to the in-process ``Relay``, one run.

Both contenders run as child processes on the same preloaded rows (~230-byte JSON, 1 000
keys), round after round, interleaved (A B A B ..., reversed every other round), so machine
load hits both alike. bench/_measure.py is the method (shared with
bench/relay_throughput.py --focus): the rate is first message to last as a consumer in this
process reads the topic; CPU per event is the difference of two whole lives of the child
(rusage, every thread) on n and n0 rows, over the n - n0 extra events, so start-up,
connecting and shutdown cancel.

* ``cli``: ``python -m outboxkit relay`` with its defaults (log level info, summary log,
  batch tracing when opentelemetry is installed, no metrics port);
* ``inproc``: a child process running ``Relay(dsn, from_url(broker))`` with the same
  defaults and no observer.

    python bench/cli_relay.py --dsn postgresql://postgres@127.0.0.1/bench [--events N]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from typing import Any

from _common import TOPIC, ensure_topic, kafka_broker, prepare, save, server_facts
from _measure import OwnCpu, measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, default=60_000)
    ap.add_argument("--small", type=int, help="the n0 run's events (default: events / 10)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--out", default="cli_relay")
    ap.add_argument(
        "--baseline-src",
        help="A/B: also run `outboxkit relay` from this src directory (e.g. an older"
        " commit's, from `git worktree add`) as contender cli_baseline",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="A/B/C: also run `outboxkit relay` from SRC as contender cli_NAME (repeatable;"
        " one change per src copy measures each change in the same run)",
    )
    ap.add_argument(
        "--options",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="also run `outboxkit relay ARGS` as contender cli_NAME (repeatable), e.g."
        " wide='--batch-size 2000 --max-in-flight 8'",
    )
    args = ap.parse_args()
    options = {}
    for spec in args.options:
        name, _, rest = spec.partition("=")
        options[f"cli_{name}"] = tuple(shlex.split(rest))
    variants = {"cli_baseline": args.baseline_src} if args.baseline_src else {}
    for spec in args.variant:
        name, _, src = spec.partition("=")
        variants[f"cli_{name}"] = src

    size = prepare(args.dsn, args.events)
    n0 = args.small or args.events // 10
    runs: dict[str, list[dict[str, Any]]] = {"cli": [], "inproc": []}
    for kind in [*variants, *options]:
        runs[kind] = []
    kinds = list(runs)
    with kafka_broker(args.kafka) as bootstrap:
        ensure_topic(bootstrap, TOPIC)
        own = OwnCpu(bootstrap, args.dsn)
        for i in range(args.rounds):
            order = kinds if i % 2 == 0 else kinds[::-1]
            for kind in order:
                r = measure(
                    kind,
                    args.dsn,
                    bootstrap,
                    args.events,
                    n0,
                    own,
                    variants.get(kind),
                    options.get(kind, ()),
                )
                r["cpu_us_per_event"] = r["us"]["cpu"]
                runs[kind].append(r)
                print(
                    f"round {i + 1} {kind:12s} {r['rate']:>10,.0f} events/s"
                    f"  {r['us']['cpu']:6.1f} µs CPU/event (own {r['us']['own']:.1f};"
                    f" old window {r['runs'][1]['window_cpu_us_per_event']:.1f})",
                    flush=True,
                )
    summary = {
        kind: {
            "median_rate": statistics.median(r["rate"] for r in rs),
            "median_cpu_us_per_event": statistics.median(r["cpu_us_per_event"] for r in rs),
            "rates": [round(r["rate"]) for r in rs],
        }
        for kind, rs in runs.items()
    }
    ratio = summary["cli"]["median_rate"] / summary["inproc"]["median_rate"]
    cpu_ratio = (
        summary["cli"]["median_cpu_us_per_event"] / summary["inproc"]["median_cpu_us_per_event"]
    )
    print(f"cli / in-process: rate {ratio:.3f}, CPU per event {cpu_ratio:.3f}")
    for kind in [*variants, *options]:
        other, inproc = summary[kind], summary["inproc"]
        print(
            f"{kind} / in-process: rate {other['median_rate'] / inproc['median_rate']:.3f},"
            " CPU per event"
            f" {other['median_cpu_us_per_event'] / inproc['median_cpu_us_per_event']:.3f}"
        )
    # Same-round pairs (the machine's load swings between rounds): cli over each variant.
    for kind in [*variants, *options]:
        for what in ("cpu", "own"):  # the relay process; it + broker + PostgreSQL
            pairs = [
                a["us"][what] / b["us"][what] for a, b in zip(runs["cli"], runs[kind], strict=True)
            ]
            print(
                f"cli / {kind}, {what} CPU per event, per round: {[round(x, 3) for x in pairs]},"
                f" median {statistics.median(pairs):.3f}"
            )
    save(
        args.out,
        {
            "what": "outboxkit relay (CLI process, defaults) vs in-process Relay, interleaved;"
            " rate: broker-side window (consumer: first to last message); CPU: difference of"
            " the relay process's whole-life rusage on events and small rows (bench/_measure.py)",
            "events": args.events,
            "small": n0,
            "variants": variants,
            "options": options,
            "payload_bytes": size,
            "server": server_facts(args.dsn),
            "summary": summary,
            "rate_ratio_cli_over_inproc": ratio,
            "cpu_ratio_cli_over_inproc": cpu_ratio,
            "runs": runs,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    )


if __name__ == "__main__":
    main()
