"""The names a plugin author imports from ``llmserve`` in one line: each is the object its owning
module defines, and importing the package stays light until a name is touched."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import llmserve

NAMES = sorted(set(llmserve.__all__) - {"__version__", "hookimpl"})


@pytest.mark.parametrize("name", NAMES)
def test_each_name_is_its_owners_object(name):
    module = importlib.import_module(llmserve._EXPORTS[name])
    assert getattr(llmserve, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        llmserve.NoSuchThing  # noqa: B018 - the attribute access is the test


def test_import_is_light_until_a_name_is_used():
    code = ("import sys, llmserve\n"
            "heavy = ('torch', 'transformers', 'fastapi', 'pydantic')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "from llmserve import ProtocolSpec, hookimpl\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "from llmserve import WireModel\n"
            "print('fastapi' in sys.modules, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "[]", "True False"]
