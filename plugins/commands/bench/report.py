"""What ``llmserve bench serve`` shows and writes: the progress of a level (a bar on a terminal,
plain lines at most once a second otherwise), the per-level result in vLLM's names, the
result table, and the latency-against-concurrency plot."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from .loadgen import LevelRun, Sample, describe

METRICS = (("ttft", "TTFT", "Time to First Token"), ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))


class Progress:
    """Requests done out of ``total``: a bar redrawn in place on a terminal (at most ten times a
    second), otherwise one plain line at most once a second and one at the end (log files get no
    ``\\r``)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = self.failed = self.drawn = 0
        self.start = self.last = time.monotonic()

    def update(self, sample: Sample) -> None:
        self.done += 1
        self.failed += sample.error is not None
        now = time.monotonic()
        if self.enabled and (now - self.last >= (0.1 if self.tty else 1.0) or (self.tty and self.done == self.total)):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self.drawn = self.done
        failed = f", {self.failed} failed" if self.failed else ""
        text = f"{self.label}: {self.done}/{self.total} requests{failed}, {now - self.start:.1f} s"
        if self.tty:
            width = 30
            filled = width * self.done // max(1, self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
        elif self.drawn != self.done:  # a level faster than a second still says it finished
            self._draw(time.monotonic())


def level_result(run: LevelRun, detailed: bool = False) -> dict[str, Any]:
    """One concurrency level's figures under the names ``vllm bench serve`` writes (times in ms)."""
    ok = run.ok
    input_tokens = sum(s.prompt_tokens or 0 for s in ok)
    output_tokens = sum(s.output_tokens for s in ok)
    wall = run.wall_s or math.nan
    result: dict[str, Any] = {
        "max_concurrency": run.concurrency, "completed": len(ok), "failed": len(run.failed), "duration": run.wall_s,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / wall, "output_throughput": output_tokens / wall,
        "total_token_throughput": (input_tokens + output_tokens) / wall,
        "usage_reported": sum(s.usage for s in ok),
    }
    values = {"ttft": [s.ttft for s in ok], "itl": [x for s in ok for x in s.itl], "e2el": [s.latency for s in ok]}
    for key, _, _ in METRICS:
        stats = describe(values[key])
        for stat, name in (("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p99", "p99")):
            result[f"{name}_{key}_ms"] = stats[stat] * 1000
    result["errors"] = sorted({s.error for s in run.failed if s.error})[:10]
    if detailed:
        result.update(input_lens=[s.prompt_tokens for s in ok], output_lens=[s.output_tokens for s in ok],
                      ttfts=[s.ttft for s in ok], itls=[s.itl for s in ok], e2els=[s.latency for s in ok])
    return result


def _row(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>12}"


def format_level(result: dict[str, Any]) -> str:
    """One level's result as a block of aligned lines (the layout ``vllm bench serve`` prints)."""
    lines = ["{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="),
             _row("Maximum request concurrency:", result["max_concurrency"]),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"]),
             _row("Benchmark duration (s):", result["duration"]),
             _row("Total input tokens:", result["total_input_tokens"]),
             _row("Total generated tokens:", result["total_output_tokens"]),
             _row("Request throughput (req/s):", result["request_throughput"]),
             _row("Output token throughput (tok/s):", result["output_throughput"]),
             _row("Total token throughput (tok/s):", result["total_token_throughput"])]
    for key, short, title in METRICS:
        lines.append("{s:{c}^52}".format(s=f" {title} ", c="-"))
        for name, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(_row(f"{label} {short} (ms):", result[f"{name}_{key}_ms"]))
    for error in result["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 52)
    return "\n".join(lines)


def format_sweep(results: list[dict[str, Any]]) -> str:
    """One row per concurrency level: the sweep at a glance."""
    head = ("conc", "ok", "fail", "req/s", "out tok/s", "tot tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
            "E2EL p50", "E2EL p99")
    rows: list[tuple[str, ...]] = [head]
    for r in results:
        rows.append((str(r["max_concurrency"]), str(r["completed"]), str(r["failed"]),
                     f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                     f"{r['total_token_throughput']:.1f}",
                     *(f"{r[f'{stat}_{key}_ms']:.1f}" for key in ("ttft", "itl", "e2el")
                       for stat in ("median", "p99"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], "(latencies in ms)"])


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    """A PNG of TTFT, ITL and end-to-end latency (p50 and p99) against concurrency."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (key, short, _) in zip(axes, METRICS):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(conc, [r[f"{stat}_{key}_ms"] for r in results], style, label=f"{short} {stat}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{short} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
