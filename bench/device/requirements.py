"""What the GPU machine needs carried, worked out from llmserve's own dependency list.

    python bench/device/requirements.py                # pinned specs of the missing wheels, one line
    python bench/device/requirements.py --tokenizer D  # the embedded model's tokenizer and config into D

The device image has PyTorch, Triton, transformers and many common packages (``IMAGE``), and no
network. Everything else llmserve needs (its ``[project] dependencies``, their extras and their
own dependencies, followed recursively through this venv's metadata) goes over as wheels at the
versions installed here. A dependency added to pyproject.toml is picked up by the next run; the
device script checks that every module imports before it measures anything.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

# The image's packages that llmserve's dependencies reach (bench/device/README.md says where the
# list comes from). Using the image's own builds keeps torch, Triton and their CUDA libraries
# consistent and keeps the carried wheels far under the 64 MiB a call may carry.
IMAGE = {
    "torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet",
    "accelerate", "jinja2", "markupsafe", "pyyaml", "pluggy", "typer", "click", "rich", "shellingham",
    "markdown-it-py", "mdurl", "pygments", "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sniffio",
    "filelock", "fsspec", "packaging", "psutil", "regex", "requests", "urllib3", "charset-normalizer",
    "tqdm", "typing-extensions", "sympy", "mpmath", "networkx", "setuptools", "uvloop", "protobuf",
    "sentencepiece", "pytest", "iniconfig", "pytest-timeout", "nvidia-ml-py", "cuda-bindings",
    "cuda-pathfinder", "typing-inspect", "mypy-extensions", "annotated-doc",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str) -> dict[str, str]:
    """name -> installed version of every distribution ``root`` needs here, extras followed."""
    found: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a platform-only dependency not installed here
        key = norm(dist.metadata["Name"])
        if key in found and not extras:
            continue
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    found.pop("llmserve", None)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="write the embedded model's tokenizer and config here")
    args = ap.parse_args()
    if args.tokenizer:
        from llmserve.plugins.backends.torch.gguf_model import _File, metadata_dir
        from llmserve.plugins.backends.torch.loader import embedded_model_path

        path = embedded_model_path()
        src = metadata_dir(path, _File(path).header, None)
        shutil.copytree(src, args.tokenizer, dirs_exist_ok=True)
        return
    need = {n: v for n, v in closure("llmserve").items() if n not in IMAGE}
    sys.stdout.write(" ".join(f"{n}=={v}" for n, v in sorted(need.items())) + "\n")


if __name__ == "__main__":
    main()
