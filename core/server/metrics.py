"""Prometheus metrics: vLLM-compatible names, written in the text exposition format by hand.

Two kinds of numbers end up on ``GET /metrics``:

* values the engine already keeps (queue lengths, KV usage, prefix-cache and preemption
  counters, token totals) come from ``EngineClient.stats()`` at scrape time: one snapshot
  that the engine thread publishes after each iteration, read without locks;
* per-request observations (latency histograms, finished-request counts) are recorded by
  the engine thread through ``Metrics.token_step`` / ``Metrics.request_finished``, and the
  admission rejection count by the event loop through ``Metrics.rejected``. Each series has
  exactly one writer thread, so plain ``+=`` is enough; a scrape may see a histogram's sum
  one observation ahead of its count, which Prometheus tolerates.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from typing import Iterable, Mapping

from llmserve.engine.stats import EngineObserver, EngineStats
from llmserve.outputs import Timings

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds follow vLLM's, so dashboards built for it read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens run through the model in one engine step; preemptions of one request; its n.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")
# Why requests wait (vLLM's two reasons; they add up to vllm:num_requests_waiting). Here every
# waiting request waits for capacity: nothing defers one for a transient reason.
WAITING_REASONS = ("capacity", "deferred")


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1-2-5 steps up to ``max_len`` (vLLM's buckets for token-count histograms)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class Histogram:
    """Fixed buckets; ``counts[i]`` holds observations in (bounds[i-1], bounds[i]], the last +Inf."""

    __slots__ = ("name", "help", "bounds", "counts", "sum", "count")

    def __init__(self, name: str, help_text: str, bounds: Iterable[float]) -> None:
        self.name = name
        self.help = help_text
        self.bounds = tuple(float(b) for b in bounds)  # le="1.0", as prometheus_client writes it
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is inclusive).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        counts = list(self.counts)  # one snapshot, so the buckets are monotonic
        for bound, n in zip(self.bounds, counts):
            running += n
            out.append(f'{self.name}_bucket{{{labels},le="{_num(bound)}"}} {running}')
        running += counts[-1]
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {running}')
        out.append(f"{self.name}_sum{{{labels}}} {_num(self.sum)}")
        out.append(f"{self.name}_count{{{labels}}} {running}")
        return out


def _num(value: float) -> str:
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return "+Inf" if value > 0 else ("-Inf" if value < 0 else "NaN")
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"{value:.1f}"
    return repr(value)


def _cache_config_info(stats: EngineStats) -> list[str]:
    """vLLM's info-style gauge (always 1) whose labels carry the KV-cache configuration; like
    vLLM's it has no model_name label, and an unknown value reads "None"."""
    loaded = stats.kv_blocks_total > 0
    info = {"block_size": str(stats.block_size) if loaded else "None",
            "cache_dtype": stats.cache_dtype,  # --kv-cache-dtype as configured, as vLLM reports it
            "enable_prefix_caching": str(stats.prefix_caching),
            "engine": "0",
            "num_cpu_blocks": "None",  # no CPU swap space
            "num_gpu_blocks": str(stats.kv_blocks_total) if loaded else "None"}
    labels = ",".join(f'{key}="{_escape(value)}"' for key, value in info.items())
    return ["# HELP vllm:cache_config_info Information of the KV-cache configuration (the labels; the value "
            "is always 1).", "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{labels}}} 1.0"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics(EngineObserver):
    """The server's metrics. ``rejected(reason)`` is the admission-control entry point; the
    engine reports into it as its ``EngineObserver`` (``token_step``, ``iteration``,
    ``request_finished``)."""

    def __init__(self, max_model_len: int = 8192) -> None:
        self.success: dict[str, int] = {r: 0 for r in FINISH_REASONS}
        self.last_finished: float | None = None  # wall time of the newest finished request
        self.rejections: dict[str, int] = {}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two output steps of a request "
                             "in seconds.", TOKEN_LATENCY_BUCKETS)
        # The older vLLM name of the same per-token interval, kept for existing dashboards.
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds "
                              "(same observations as vllm:inter_token_latency_seconds).", TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in the engine "
                             "in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time spent waiting before the first "
                               "engine step in seconds.", REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Time from the first engine step to "
                                 "the first token in seconds.", REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram("vllm:request_decode_time_seconds", "Time from the first to the last token "
                                "in seconds.", REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram("vllm:request_inference_time_seconds", "Time from the first engine step "
                                   "to the end (prefill and decode) in seconds.", REQUEST_LATENCY_BUCKETS)
        self.step_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step, as vLLM counts them: "
                                     "the prompts of sequences that produced their first token plus the tokens "
                                     "generated.", STEP_TOKEN_BUCKETS)
        self.preempted = Histogram("vllm:request_num_preemptions", "Preemptions per finished request.",
                                   PREEMPTION_BUCKETS)
        self.n = Histogram("vllm:request_params_n", "The n request parameter of finished requests.", N_BUCKETS)
        self.resize(max_model_len)

    def resize(self, max_model_len: int) -> None:
        """Set the token-count buckets from the context length (called once the model is known)."""
        bounds = token_buckets(max(1, int(max_model_len)))
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", bounds)
        self.gen_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request.", bounds)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens request parameter of "
                                    "finished requests.", bounds)

    # -- writers ---------------------------------------------------------------------------------
    def rejected(self, reason: str) -> None:
        """Count one request refused by admission control (e.g. reason "queue_full")."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def token_step(self, seconds: float) -> None:
        """Engine thread: one output step of a request, ``seconds`` after its previous one."""
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def iteration(self, tokens: int) -> None:
        """Engine thread: one engine step; ``tokens`` is the prompt length of every sequence that produced
        its first token in it plus the tokens it generated (vLLM's count)."""
        self.step_tokens.observe(tokens)

    def request_finished(self, reason: str, timings: Timings, prompt_tokens: int, generation_tokens: int,
                         now: float | None = None, n: int = 1, max_tokens: int | None = None,
                         preemptions: int = 0) -> None:
        """Engine thread: a generate request ended (``reason`` is stop/length/abort/error);
        ``n``, ``max_tokens`` are its parameters, ``preemptions`` those of its sequences."""
        now = now or time.time()
        self.success[reason] = self.success.get(reason, 0) + 1
        self.last_finished = now
        arrival = timings.arrival or now
        end = timings.finished or now
        self.e2e.observe(max(0.0, end - arrival))
        if timings.scheduled is not None:
            self.queue.observe(max(0.0, timings.scheduled - arrival))
            self.inference.observe(max(0.0, end - timings.scheduled))
        if timings.first_token is not None:
            self.ttft.observe(max(0.0, timings.first_token - arrival))
            self.decode.observe(max(0.0, end - timings.first_token))
            if timings.scheduled is not None:
                self.prefill.observe(max(0.0, timings.first_token - timings.scheduled))
        self.prompt_len.observe(prompt_tokens)
        self.gen_len.observe(generation_tokens)
        self.n.observe(n)
        self.preempted.observe(preemptions)
        if max_tokens:  # as vLLM: only a request that has one
            self.max_tokens.observe(max_tokens)

    # -- exposition -----------------------------------------------------------------------------
    def render(self, model_name: str, engine: EngineStats | None = None) -> str:
        """The whole scrape, in the Prometheus text format (version 0.0.4); ``engine`` is
        ``EngineClient.stats()`` (None before the model has loaded: zeros)."""
        labels = f'model_name="{_escape(model_name)}"'
        out: list[str] = []

        def gauge(name: str, help_text: str, value: float) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                        f"{name}{{{labels}}} {_num(float(value))}"])

        def counter(name: str, help_text: str, values: Mapping[str, float] | float, label: str | None = None) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} counter"])
            if not isinstance(values, Mapping):
                out.append(f"{name}{{{labels}}} {_num(float(values))}")
                return
            for key, value in sorted(dict(values).items()):
                out.append(f'{name}{{{labels},{label}="{_escape(key)}"}} {_num(float(value))}')

        stats = engine if engine is not None else EngineStats()
        gauge("vllm:num_requests_running", "Sequences in the running batch.", stats.running)
        gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", stats.waiting)
        out.extend(["# HELP vllm:num_requests_waiting_by_reason Waiting sequences by reason: capacity (no room "
                    "in the batch or the KV cache yet) or deferred; they add up to vllm:num_requests_waiting.",
                    "# TYPE vllm:num_requests_waiting_by_reason gauge"])
        for reason in WAITING_REASONS:
            waiting = stats.waiting if reason == "capacity" else 0
            out.append(f'vllm:num_requests_waiting_by_reason{{{labels},reason="{reason}"}} {_num(float(waiting))}')
        gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", stats.kv_usage)
        gauge("vllm:gpu_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1); older name of "
              "vllm:kv_cache_usage_perc.", stats.kv_usage)
        if stats.state_slots_total:  # a hybrid model: recurrent states beside the KV blocks
            gauge("llmserve:state_slots_used", "Recurrent-state slots held by running sequences (a hybrid "
                  "model's linear-attention or convolution layers keep one per sequence).", stats.state_slots_used)
            gauge("llmserve:state_slots_total", "Recurrent-state slots allocated beside the KV cache.",
                  stats.state_slots_total)
        counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                stats.prefix_queried_tokens)
        counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens)
        if stats.encoder_queries:  # a vision model has encoded or looked up an image
            counter("vllm:mm_cache_queries_total", "Request images looked up in the encoder cache (the vision tower's "
                    "output by image digest).", stats.encoder_queries)
            counter("vllm:mm_cache_hits_total", "Request images whose features the encoder cache held.",
                    stats.encoder_hits)
        counter("vllm:num_preemptions_total", "Sequences preempted (KV blocks reclaimed, recomputed later).",
                stats.preemptions)
        if stats.spec_accepted_per_pos:  # speculative decoding is on
            counter("vllm:spec_decode_num_drafts_total", "Decode steps of a sequence that verified proposed "
                    "tokens.", stats.spec_drafts)
            counter("vllm:spec_decode_num_draft_tokens_total", "Tokens proposed for verification.",
                    stats.spec_draft_tokens)
            counter("vllm:spec_decode_num_accepted_tokens_total", "Proposed tokens the model confirmed.",
                    stats.spec_accepted_tokens)
            counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Proposed tokens the model confirmed, "
                    "by position in the proposal (0: the first).",
                    {str(i): n for i, n in enumerate(stats.spec_accepted_per_pos)}, "position")
        counter("vllm:prompt_tokens_total", "Prompt tokens of finished requests.", stats.prompt_tokens)
        counter("vllm:generation_tokens_total", "Generated tokens.", stats.generation_tokens)
        counter("vllm:request_success_total", "Finished requests by finish reason.", self.success, "finished_reason")
        for hist in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode,
                     self.inference, self.prompt_len, self.gen_len, self.step_tokens, self.preempted, self.n,
                     self.max_tokens):
            out.extend(hist.lines(labels))
        out.extend(_cache_config_info(stats))
        counter("vllm:admission_rejections_total", "Requests refused by admission control, by reason.",
                self.rejections, "reason")
        # The name this counter had first, kept for the dashboards built on it.
        counter("llmserve:admission_rejections_total", "Requests refused by admission control, by reason (older "
                "name of vllm:admission_rejections_total).", self.rejections, "reason")
        return "\n".join(out) + "\n"


def merge_scrapes(scrapes: list[str]) -> str:
    """One exposition from several ``Metrics.render`` outputs (one per model, each with its own
    ``model_name`` label): every family once, with the samples of every model under it."""
    if len(scrapes) == 1:
        return scrapes[0]
    families: dict[str, list[str]] = {}
    for text in scrapes:
        name = ""
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                if name in families:
                    continue
                families[name] = [line]
            elif line.startswith("# TYPE ") and line.split(" ", 3)[2] == name and len(families[name]) > 1:
                continue  # the family's TYPE line came with its first model
            elif name:
                families[name].append(line)
    return "\n".join(line for lines in families.values() for line in lines) + "\n"
