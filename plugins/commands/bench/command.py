"""``llmserve bench serve``: the closed-loop load generator as a command, against any
OpenAI-compatible server; flags are named as ``vllm bench serve`` names them where they mean
the same. The load generator and its reports are imported when the command runs."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import typer

from ..remote import API_KEY_ENV, RemoteError, pick_model, server_root

bench_cli = typer.Typer(no_args_is_help=True, help="Benchmarks: load a running server and measure it.")


def concurrency_levels(values: list[str]) -> list[int]:
    """``--max-concurrency 1,4 --max-concurrency 16`` -> [1, 4, 16] (each at least 1)."""
    levels = []
    for value in values:
        for part in value.split(","):
            if part.strip():
                try:
                    level = int(part)
                except ValueError:
                    raise typer.BadParameter(f"{part.strip()!r} is not an integer",
                                             param_hint="--max-concurrency") from None
                if level < 1:
                    raise typer.BadParameter("must be at least 1", param_hint="--max-concurrency")
                levels.append(level)
    return levels or [1]


def dataset_kind(name: Optional[str], path: Optional[Path], random_input_len: Optional[int]) -> str:
    """The dataset to use: the one named, else custom with a file, random with a length, else builtin."""
    return name or ("custom" if path else "random" if random_input_len is not None else "builtin")


def make_prompts(kind: str, path: Optional[Path], count: int, input_len: Optional[int],
                 seed: Optional[int]) -> list[Any]:
    import random

    from . import dataset

    rng = random.Random(seed or 0)
    if kind == "custom":
        if not path:
            raise dataset.DatasetError("--dataset-name custom needs --dataset-path FILE.jsonl")
        # File order unless a seed asks for a shuffle: the same file gives the same run.
        return dataset.sample_prompts(dataset.jsonl_prompts(path), count, rng, shuffle=seed is not None)
    if kind == "random":
        return dataset.random_prompts(count, input_len or 128, rng)
    return dataset.builtin_prompts(count)


def _result_path(result_dir: Optional[Path], filename: Optional[str]) -> Path:
    name = filename or f"bench-serve-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    return (result_dir or Path(".")) / name


@bench_cli.command("serve")
def bench_serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", "--url",
                                 help="Server root (a trailing /v1 is accepted)."),
    endpoint: str = typer.Option("/v1/completions", "--endpoint",
                                 help="/v1/completions or /v1/chat/completions."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name.",
                                         show_default="the server's first model"),
    num_prompts: int = typer.Option(100, "--num-prompts", min=1, help="Requests per concurrency level."),
    max_concurrency: list[str] = typer.Option(["8"], "--max-concurrency",
                                              help="Requests in flight; a comma list or repeated flags run a sweep."),
    dataset_name: Optional[str] = typer.Option(
        None, "--dataset-name", help="builtin, random or custom (JSONL).",
        show_default="custom with --dataset-path, random with --random-input-len, else builtin"),
    dataset_path: Optional[Path] = typer.Option(None, "--dataset-path", help="JSONL prompts (see the docs)."),
    random_input_len: Optional[int] = typer.Option(None, "--random-input-len", min=1,
                                                   help="Words per random prompt (about one token each).",
                                                   show_default="128"),
    random_output_len: int = typer.Option(128, "--random-output-len", "--output-len", min=1,
                                          help="max_tokens of every request (a JSONL line may set its own)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Send ignore_eos: every request runs to max_tokens."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="Sampling temperature (0: greedy)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the random prompts; shuffles a JSONL file.",
                                       show_default="0, JSONL in file order"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                          help="API key sent as Authorization: Bearer KEY."),
    save_result: bool = typer.Option(False, "--save-result", help="Write the results as JSON."),
    save_detailed: bool = typer.Option(False, "--save-detailed", help="Add per-request values to the JSON."),
    result_dir: Optional[Path] = typer.Option(None, "--result-dir", help="Folder of the JSON file.",
                                             show_default="."),
    result_filename: Optional[str] = typer.Option(None, "--result-filename",
                                                  help="JSON file name (implies --save-result)."),
    plot_file: Optional[Path] = typer.Option(None, "--plot", help="PNG of latency against concurrency (matplotlib)."),
    disable_tqdm: bool = typer.Option(False, "--disable-tqdm", help="No progress output."),
    request_timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Seconds one request may take."),
) -> None:
    """Closed-loop load against an OpenAI-compatible server: throughput, TTFT, ITL, latency."""
    import asyncio

    from . import dataset, loadgen, report

    if endpoint not in dataset.ENDPOINTS:
        _fail(f"--endpoint must be one of {', '.join(dataset.ENDPOINTS)}")
    if dataset_name not in (None, "builtin", "random", "custom"):
        _fail("--dataset-name must be builtin, random or custom")
    levels = concurrency_levels(max_concurrency)
    if plot_file is not None:
        try:
            import matplotlib  # noqa: F401 - only checked here, before the run, so a missing one fails fast
        except ImportError:
            _fail("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    kind = dataset_kind(dataset_name, dataset_path, random_input_len)
    root = server_root(base_url)
    try:
        prompts = make_prompts(kind, dataset_path, num_prompts, random_input_len, seed)
        name = pick_model(f"{root}/v1", api_key, model)
        bodies = [dataset.request_body(p, endpoint, name, random_output_len, temperature=temperature,
                                       ignore_eos=ignore_eos) for p in prompts]
    except (RemoteError, dataset.DatasetError) as exc:
        _fail(str(exc), 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    print(f"{root}{endpoint}: model {name}, {num_prompts} requests per level, concurrency {levels}", flush=True)
    results = []
    for level in levels:
        progress = report.Progress(num_prompts, f"concurrency {level}", enabled=not disable_tqdm)
        try:
            run = asyncio.run(loadgen.run_closed_loop(root, endpoint, bodies, level, headers=headers,
                                                      raise_errors=False, timeout=request_timeout,
                                                      on_sample=progress.update))
        except KeyboardInterrupt:
            progress.close()
            typer.echo(f"interrupted at concurrency {level}", err=True)
            raise typer.Exit(130) from None
        progress.close()
        result = report.level_result(run, detailed=save_detailed)
        results.append(result)
        print(report.format_level(result), flush=True)
        if result["completed"] == 0:  # the next levels would fail the same way
            print(f"error: every request failed at concurrency {level}", file=sys.stderr)
            break
    if len(results) > 1:
        print(report.format_sweep(results))
    document = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_url": root, "endpoint": endpoint,
                "model_id": name, "num_prompts": num_prompts, "max_concurrency": levels,
                "dataset_name": kind,
                "output_len": random_output_len, "ignore_eos": ignore_eos, "temperature": temperature,
                "total_output_tokens": sum(r["total_output_tokens"] for r in results),
                "total_input_tokens": sum(r["total_input_tokens"] for r in results), "results": results}
    if save_result or result_filename:
        path = _result_path(result_dir, result_filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")
        print(f"results written to {path}")
    if plot_file is not None:
        report.plot(results, str(plot_file), f"{name}: {root}{endpoint}")
        print(f"plot written to {plot_file}")
    if any(r["completed"] == 0 for r in results):
        raise typer.Exit(1)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
