"""Guided (constrained) decoding: the dialect-neutral spec, the decoder plugin interface and the
server's front door that picks a decoder and caches compiled constraints.

A dialect reads its own request fields into a ``GuidedSpec`` (``json_schema_spec`` and
``only_one`` are shared helpers; its spellings stay in the dialect) and awaits
``context.guided.compile_async(spec)``. The room:

- ``spec.py``: ``GuidedSpec``, its shape checks, the shared helpers;
- ``decoder.py``: ``GuidedDecoder``, what a ``register_guided_decoders`` plugin implements;
- ``service.py``: ``GuidedDecoding``, the decoder choice and the cache of compiled constraints;
- ``structure.py``: ``Structure``, the pieces of a ``structure`` constraint, and its checks;
- ``bounds.py``: ``GuidedLimits`` (the ``--guided-*`` flags) and the linear checks before compiling;
- ``worker.py``: the one compile worker and its wall-clock budget (``check_deadline``).
"""

from llmserve.guided.bounds import GuidedLimits
from llmserve.guided.decoder import GuidedDecoder
from llmserve.guided.service import GuidedDecoding
from llmserve.guided.spec import KINDS, GuidedSpec, MaskFactory, check_value, json_schema_spec, only_one
from llmserve.guided.structure import Structure
from llmserve.guided.worker import check_deadline

__all__ = ["KINDS", "GuidedDecoder", "GuidedDecoding", "GuidedLimits", "GuidedSpec", "MaskFactory", "Structure",
           "check_deadline", "check_value", "json_schema_spec", "only_one"]
