"""Built-in speculative-decoding proposers: ``ngram`` (prompt lookup) and ``draft`` (a smaller model).

Only the records live here; a proposer's module is imported when ``--speculative-config`` names it.
"""

from llmserve import ProposerSpec, hookimpl


@hookimpl
def register_proposers() -> list[ProposerSpec]:
    return [ProposerSpec(name="ngram", target="llmserve.plugins.proposers.ngram:NgramProposer",
                         description="prompt lookup: what followed the latest earlier occurrence of the last "
                                     "prompt_lookup_max..min tokens"),
            ProposerSpec(name="draft", target="llmserve.plugins.proposers.draft:DraftModelProposer",
                         description="a smaller model with the same tokenizer (\"model\": its path or Hugging "
                                     "Face id) proposes greedily", loads_model=True)]
