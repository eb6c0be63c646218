"""The acme-replay proposer: guesses that the output repeats the prompt from its start.

Output token i is proposed to be prompt token i. A model that repeats its input (llmserve's
echo test backend) confirms every guess; another model confirms few, and then costs one extra
position per step. Whatever the guesses, the model verifies each one, so the output is the
same as without it.
"""

from llmserve import DraftRequest, Proposer


class ReplayProposer(Proposer):
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            done = len(r.token_ids) - r.num_prompt_tokens  # output tokens so far
            out.append(list(r.token_ids[done:min(done + r.k, r.num_prompt_tokens)]))
        return out
