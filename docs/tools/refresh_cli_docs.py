"""Refresh the generated blocks of docs/cli.md.

Run `.venv/bin/python docs/tools/refresh_cli_docs.py` from the repository root.
"""
import os
import re
import subprocess
import sys
root = os.getcwd()
table = subprocess.run([sys.executable, os.path.join(root, "docs/tools/flag_table.py")], capture_output=True,
                       text=True, check=True).stdout
env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
env.update(LLMSERVE_HOST="0.0.0.0", COLUMNS="200")
show = subprocess.run([os.path.join(root, ".venv/bin/llmserve"), "config", "show", "--port", "9000"],
                      capture_output=True, text=True, check=True, env=env).stdout
block = "```console\n$ LLMSERVE_HOST=0.0.0.0 llmserve config show --port 9000\n" + show + "```\n"
narrow = {**env, "COLUMNS": "80"}


def helped(*args):
    """`llmserve ARGS --help` at 80 columns, as a console block (a text block for `serve`, whose
    sample tests/test_cli_help.py compares: the docs' example runner would start a server)."""
    out = subprocess.run([os.path.join(root, ".venv/bin/llmserve"), *args, "--help"], capture_output=True,
                         text=True, check=True, env=narrow).stdout
    fence = "text" if args else "console"
    return f"```{fence}\n$ " + " ".join(["llmserve", *args, "--help"]) + "\n" + out + "```\n"


p = "docs/cli.md"
s = open(p).read()
for marker, args in (("top-help", ()), ("serve-help", ("serve",))):
    sample = helped(*args)
    s = re.sub(rf"(<!-- {marker} -->\n).*?(<!-- /{marker} -->)",
               lambda m, sample=sample: m.group(1) + sample + m.group(2), s, flags=re.S)
s = re.sub(r"(<!-- flag-table -->\n).*?(<!-- /flag-table -->)", lambda m: m.group(1) + table + m.group(2), s,
           flags=re.S)
s = re.sub(r"(<!-- config-show -->\n).*?(<!-- /config-show -->)", lambda m: m.group(1) + block + m.group(2), s,
           flags=re.S)
open(p, "w").write(s)
