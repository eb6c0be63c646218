"""Refresh the architecture table of docs/engine.md from plugins/backends/torch/architectures.py.

Run `.venv/bin/python docs/tools/refresh_architectures.py` from the repository root;
tests/backends/test_architecture_conformance.py fails while the page and the lists differ.
"""
import re

from llmserve.plugins.backends.torch.architectures import markdown_table

p = "docs/engine.md"
s = open(p).read()
s, n = re.subn(r"(<!-- architectures -->\n).*?(<!-- /architectures -->)",
               lambda m: m.group(1) + markdown_table() + m.group(2), s, flags=re.S)
assert n == 1, "docs/engine.md has no <!-- architectures --> block"
open(p, "w").write(s)
