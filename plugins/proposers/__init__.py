"""Built-in speculative-decoding proposers: ``ngram`` (prompt lookup).

Only the records live here; ``ngram.py`` is imported when ``--speculative-config`` names it.
"""

from llmserve import ProposerSpec, hookimpl


@hookimpl
def register_proposers() -> list[ProposerSpec]:
    return [ProposerSpec(name="ngram", target="llmserve.plugins.proposers.ngram:NgramProposer",
                         description="prompt lookup: what followed the latest earlier occurrence of the last "
                                     "prompt_lookup_max..min tokens")]
