"""Batched token sampling: penalties, bans, masks, temperature/top-k/top-p/min-p/typical-p,
per-sequence seeded generators and logprobs, vectorised over the rows of one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from llmserve import StepItem
from llmserve import SamplingParams

NEG_INF = float("-inf")
LOGPROB_FLOOR = -9999.0  # what -inf (or NaN) logprobs are reported as: JSON has no infinities
_DEFAULT = SamplingParams()

TopList = list[tuple[int, float]]


@dataclass(slots=True)
class SampleOutput:
    token_id: int
    logprob: float
    top: TopList | None


def _clean(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


def _top_lists(logprobs: torch.Tensor, ks: Sequence[int]) -> list[TopList]:
    """Top ``ks[i]`` (token, logprob) pairs of row i, best first, with one topk over the rows."""
    kmax = max(ks)
    if kmax <= 0:
        return [[] for _ in ks]
    values, ids = logprobs.topk(min(kmax, logprobs.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [[(t, _clean(v)) for t, v in zip(ids[i][:k], values[i][:k])] for i, k in enumerate(ks)]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[tuple[float, TopList]]:
    """Raw log-probabilities of ``targets[i]`` under ``logits[i]`` plus the top ``k`` of each row."""
    return ranked_prompt_logprobs(logits, targets, k)[0]


def ranked_prompt_logprobs(logits: torch.Tensor, targets: list[int],
                           k: int) -> tuple[list[tuple[float, TopList]], list[int]]:
    """``prompt_logprobs`` and each target's rank in its row (1 = best; ties count, as vLLM's)."""
    lsm = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    picked_t = lsm.gather(1, torch.tensor(targets, device=lsm.device)[:, None])
    ranks = (lsm >= picked_t).sum(-1).clamp_(min=1).tolist()
    tops = _top_lists(lsm, [k] * len(targets))
    return [(_clean(lp), top) for lp, top in zip(picked_t[:, 0].tolist(), tops)], ranks


def _row_tops(lsm: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> list[TopList]:
    """The alternatives of each row of ``lsm`` (``rows`` index ``params``): the best
    ``logprobs``, or the tokens of ``logprob_token_ids`` in their order."""
    tops = _top_lists(lsm, [0 if params[i].logprob_token_ids else params[i].logprobs or 0 for i in rows])
    for j, i in enumerate(rows):
        chosen = params[i].logprob_token_ids
        if chosen:
            values = lsm[j, torch.tensor(chosen, device=lsm.device)].tolist()
            tops[j] = [(t, _clean(v)) for t, v in zip(chosen, values)]
    return tops


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Non-empty id lists padded to one width by repeating each row's first id."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def plain(params: SamplingParams) -> bool:
    """Whether ``sample_on_device`` can draw for these parameters: temperature, top-k and top-p
    only, unseeded, and no logprobs beyond the chosen token's raw one."""
    return (params.seed is None and not params.logprobs and not params.logprob_token_ids
            and params.logprobs_mode == "raw" and params.min_p == 0.0 and params.typical_p == 1.0)


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams],
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their raw logprobs for ``plain`` rows, computed where the logits are, with no
    host synchronisation: greedy rows take the argmax; the rest are scaled by temperature, cut
    to top-k and to the top-p nucleus (HF semantics), then drawn by an exponential race
    (``argmax(p / E)``, ``E ~ Exp(1)``), which samples ``p`` exactly without a cumulative sum."""
    V, dev = logits.shape[1], logits.device
    tokens = logits.argmax(-1)
    if not all(p.greedy for p in params):
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        x = logits / temps[:, None]
        ks = [p.top_k if 0 < p.top_k < V else V for p in params]
        if min(ks) < V:
            kth = x.topk(max(ks), dim=-1).values.gather(1, torch.tensor(ks, device=dev)[:, None] - 1)
            x.masked_fill_(x < kth, NEG_INF)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
            ordered, order = x.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            # A token goes once the mass strictly above it reaches top_p; the best always stays.
            ordered.masked_fill_(probs.cumsum(-1) - probs >= top_p, NEG_INF)
            x = torch.empty_like(x).scatter_(1, order, ordered)
        race = x.softmax(-1) / torch.empty_like(x).exponential_(generator=generator)
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        tokens = torch.where(greedy, tokens, race.argmax(-1))
    lps = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
    return tokens, lps


class Sampler:
    """Samples one token per row of a ``[B, V]`` float32 logits tensor."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self._generators: dict[int, tuple[int, torch.Generator]] = {}
        self._global = torch.Generator(device=self.device)
        self._global.seed()
        # Optional native greedy pick (token + its logprob in one pass), set by the backend on
        # CPU fp32: ``logits -> (tokens, logprobs) | None`` (None: use the torch path).
        self.greedy_kernel: Callable[[torch.Tensor], tuple[torch.Tensor, list[float]] | None] | None = None

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def _generator(self, item: StepItem, seed: int) -> torch.Generator:
        value = (seed + item.seed_offset) % 2**64
        known = self._generators.get(item.seq_id)
        if known is None or known[0] != value:  # a reused seq_id with another seed starts afresh
            known = (value, torch.Generator(device=self.device))
            known[1].manual_seed(value)
            self._generators[item.seq_id] = known
        return known[1]

    # ------------------------------------------------------------------ constraints
    def _penalise(self, logits: torch.Tensor, items: list[StepItem], params: list[SamplingParams]) -> None:
        """Repetition (HF), frequency/presence (OpenAI) penalties and logit_bias, in place.

        Works on the [rows, seen ids] entries only (gather/scatter), never on whole vocab rows.
        """
        V, dev = logits.shape[1], logits.device
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
               and (items[i].prompt_ids or items[i].output_ids)]
        if rep:
            ids = _padded([list(items[i].prompt_ids) + list(items[i].output_ids) for i in rep], dev)
            rows = torch.tensor(rep, device=dev)[:, None]
            penalty = torch.tensor([params[i].repetition_penalty for i in rep], device=dev)[:, None]
            seen = logits[rows, ids]  # duplicates (and padding) read the same value: idempotent write
            logits[rows, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        freq = [i for i, p in enumerate(params) if (p.frequency_penalty or p.presence_penalty) and items[i].output_ids]
        if freq:
            ids = _padded([list(items[i].output_ids) for i in freq], dev)
            lens = torch.tensor([len(items[i].output_ids) for i in freq], device=dev)
            ids, order = ids.sort(-1)  # equal ids become neighbours: first occurrences are easy to spot
            real = (torch.arange(ids.shape[1], device=dev)[None, :] < lens[:, None]).gather(1, order)
            first = torch.ones_like(real)
            first[:, 1:] = ids[:, 1:] != ids[:, :-1]
            f = torch.tensor([params[i].frequency_penalty for i in freq], device=dev)[:, None]
            p = torch.tensor([params[i].presence_penalty for i in freq], device=dev)[:, None]
            delta = -(f * real + p * first)  # frequency once per occurrence, presence once per token
            logits.index_put_((torch.tensor(freq, device=dev)[:, None].expand_as(ids), ids), delta, accumulate=True)
        rows, cols, vals = [], [], []
        for i, prm in enumerate(params):
            for tok, bias in prm.logit_bias.items():
                if 0 <= int(tok) < V:
                    rows.append(i), cols.append(int(tok)), vals.append(float(bias))
        if rows:
            logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                              torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)

    def _ban(self, logits: torch.Tensor, items: list[StepItem], params: list[SamplingParams]) -> None:
        """allowed_token_ids, bad_words_token_ids, min_tokens and the LogitsMask hook: set
        forbidden tokens to -inf."""
        V = logits.shape[1]
        for i, prm in enumerate(params):
            if prm.allowed_token_ids is not None:  # before the rest: every later fallback keeps it
                ids = [t for t in prm.allowed_token_ids if 0 <= t < V]
                if ids:
                    ok = torch.zeros(V, dtype=torch.bool, device=logits.device)
                    ok[torch.tensor(ids, device=logits.device)] = True
                    logits[i].masked_fill_(~ok, NEG_INF)
        rows, cols = [], []
        for i, (item, prm) in enumerate(zip(items, params)):
            out = item.output_ids
            for word in prm.bad_words_token_ids:
                # A multi-token word is banned only once its prefix has been generated.
                if word and (len(word) == 1 or (len(out) >= len(word) - 1
                                               and list(out[len(out) - len(word) + 1:]) == list(word[:-1]))):
                    rows.append(i), cols.append(word[-1])
            if len(out) < prm.min_tokens:
                for tok in self.eos_token_ids + prm.stop_token_ids:
                    rows.append(i), cols.append(tok)
        # Rows that are both banned and constrained keep their unbanned logits aside (rare).
        unbanned = {i: logits[i].clone() for i in set(rows) if items[i].mask is not None}
        if rows:
            keep = [(r, c) for r, c in zip(rows, cols) if 0 <= c < V]
            if keep:
                r, c = zip(*keep)
                logits[torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device)] = NEG_INF
        for i, item in enumerate(items):
            allowed = item.mask.allowed(list(item.output_ids)) if item.mask is not None else None
            if allowed is not None:
                ok = torch.zeros(V, dtype=torch.bool, device=logits.device)
                ids = [t for t in allowed if 0 <= t < V]
                if ids:
                    ok[torch.tensor(ids, device=logits.device)] = True
                logits[i].masked_fill_(~ok, NEG_INF)
                if i in unbanned and ids and bool(torch.isneginf(logits[i]).all()):
                    # The constraint allows only what min_tokens or bad words forbid (EOS once a
                    # forced JSON value is complete): the constraint wins, so the output stays valid.
                    logits[i] = unbanned[i].masked_fill_(~ok, NEG_INF)

    # ------------------------------------------------------------------ warpers
    @staticmethod
    def _top_p(x: torch.Tensor, top_p: torch.Tensor, candidates: int = 512) -> None:
        """Keep the smallest set of best tokens whose mass reaches ``top_p`` (HF semantics), in place.

        A full vocab sort is slow on CPU (~80 ms for 32 x 49k), so look at the best
        ``candidates`` first and sort only the rows whose nucleus is larger than that.
        """
        probs = x.softmax(-1)
        k = min(candidates, x.shape[1])
        vals = probs.topk(k, dim=-1).values                     # descending
        keep = (vals.cumsum(-1) - vals) < top_p                 # mass strictly above each token
        n_keep = keep.sum(-1, keepdim=True).clamp_(min=1)
        threshold = vals.gather(1, n_keep - 1)
        wide_rows = n_keep[:, 0] >= k if k < x.shape[1] else torch.zeros_like(n_keep[:, 0], dtype=torch.bool)
        threshold[wide_rows] = 0.0                              # handled by the full sort below
        x.masked_fill_(probs < threshold, NEG_INF)
        wide = wide_rows.nonzero()[:, 0].tolist()
        if wide:
            sub = x[wide]
            sorted_x, order = sub.sort(dim=-1)
            remove = sorted_x.softmax(-1).cumsum(-1) <= 1 - top_p[wide]
            remove[:, -1] = False
            x[wide] = sub.masked_fill(remove.scatter(1, order, remove), NEG_INF)

    @staticmethod
    def _warp(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, typical-p (HF order) on the sampled rows; returns a new tensor."""
        V, dev = x.shape[1], x.device
        x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]  # new tensor: caller's is kept
        ks = [p.top_k if 0 < p.top_k < V else V for p in params]
        if min(ks) < V:
            k = torch.tensor(ks, device=dev)[:, None]
            kth = x.topk(max(ks), dim=-1).values.gather(1, k - 1)
            x.masked_fill_(x < kth, NEG_INF)
        if any(p.top_p < 1.0 for p in params):
            Sampler._top_p(x, torch.tensor([p.top_p for p in params], device=dev)[:, None])
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
            probs = x.softmax(-1)
            x.masked_fill_(probs < min_p * probs.amax(-1, keepdim=True), NEG_INF)
        typ = [i for i, p in enumerate(params) if p.typical_p < 1.0]
        if typ:
            sub = x[typ]
            mass = torch.tensor([params[i].typical_p for i in typ], device=dev)[:, None]
            lsm = sub.log_softmax(-1)
            ent = -(lsm * lsm.exp()).nansum(-1, keepdim=True)
            shifted, order = (-lsm - ent).abs().sort(dim=-1)
            cum = sub.gather(1, order).softmax(-1).cumsum(-1)
            last = (cum < mass).sum(-1, keepdim=True).clamp_(max=V - 1)
            remove = shifted > shifted.gather(1, last)
            remove[:, 0] = False
            x[typ] = sub.masked_fill(remove.scatter(1, order, remove), NEG_INF)
        return x

    # ------------------------------------------------------------------ main entry
    def sample(self, logits: torch.Tensor, items: list[StepItem]) -> list[SampleOutput]:
        """One token per row of ``logits`` (``[B, V]`` float32) for the matching ``items``."""
        B = logits.shape[0]
        if B == 0:
            return []
        params = [it.sampling or _DEFAULT for it in items]
        raw = logits
        proc = raw
        edits = any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias
                    or p.bad_words_token_ids or len(it.output_ids) < p.min_tokens or it.mask is not None
                    or p.allowed_token_ids is not None
                    for it, p in zip(items, params))
        if edits:
            proc = raw.clone()
            self._penalise(proc, items, params)
            self._ban(proc, items, params)
            # Contradictory constraints (e.g. a mask allowing only banned tokens): fall back to
            # the raw row rather than sampling from an all -inf row (NaN probabilities).
            dead = torch.isneginf(proc).all(-1)
            if bool(dead.any()):
                proc[dead] = raw[dead]

        if self.device.type == "cuda" and not edits and all(plain(p) for p in params):
            tokens, lps = sample_on_device(raw, params, self._global)
            picked = torch.stack((tokens.double(), lps.double())).tolist()  # the step's one sync
            return [SampleOutput(int(t), _clean(lp), None if p.logprobs is None else [])
                    for t, lp, p in zip(picked[0], picked[1], params)]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled and proc is raw and self.greedy_kernel is not None:
            picked = self.greedy_kernel(raw)
            if picked is not None:
                return self._outputs(raw, proc, None, sampled, picked[0], params, picked[1])
        warped = None
        if len(sampled) == B:
            tokens = torch.empty(B, dtype=torch.long, device=raw.device)
        else:
            tokens = proc.argmax(-1)                      # greedy rows need nothing else
        if sampled:
            sub_params = [params[i] for i in sampled]
            warped = self._warp(proc[sampled] if len(sampled) < B else proc, sub_params)
            tokens[torch.tensor(sampled, device=tokens.device)] = self._draw(warped, [items[i] for i in sampled])

        return self._outputs(raw, proc, warped, sampled, tokens, params)

    def _draw(self, x: torch.Tensor, items: list[StepItem]) -> torch.Tensor:
        """Sample one token per row of (warped) logits ``x``.

        Unseeded rows: inverse CDF with one uniform each (cheap). Seeded rows: exponential race,
        ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn from the sequence's own generator, so the
        token depends only on that row and seed (never on the batch) and, unlike a CDF lookup,
        only flips when the two best ``p / E`` nearly tie: robust to the tiny logit differences
        that batch shape causes in the forward.
        """
        probs = x.softmax(-1)
        picked = torch.empty(len(items), dtype=torch.long, device=x.device)
        seeded = [j for j, it in enumerate(items) if it.sampling is not None and it.sampling.seed is not None]
        free = sorted(set(range(len(items))) - set(seeded))
        if seeded:
            noise = torch.empty(len(seeded), x.shape[1], device=x.device)
            for k, j in enumerate(seeded):
                torch.rand(x.shape[1], generator=self._generator(items[j], items[j].sampling.seed), out=noise[k])
            noise.log_().neg_()                                  # -log U ~ Exp(1)
            sub = probs if len(seeded) == len(items) else probs[seeded]
            picked[torch.tensor(seeded, device=x.device)] = (sub / noise).argmax(-1)
        if free:
            sub = probs if len(free) == len(items) else probs[free]
            cdf = sub.cumsum(-1)
            u = torch.rand(len(free), 1, generator=self._global, device=x.device)
            idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=x.shape[1] - 1)
            # Rounding can push the target past the last kept token; fall back to the row's best.
            bad = sub.gather(1, idx)[:, 0] <= 0
            if bool(bad.any()):
                idx[bad, 0] = sub[bad].argmax(-1)
            picked[torch.tensor(free, device=x.device)] = idx[:, 0]
        return picked

    def _outputs(self, raw: torch.Tensor, proc: torch.Tensor, warped: torch.Tensor | None, sampled: list[int],
                 tokens: torch.Tensor, params: list[SamplingParams],
                 lps: list[float] | None = None) -> list[SampleOutput]:
        """Sampled token ids with their logprob (raw or processed) and top alternatives.
        ``lps``: the raw logprobs of ``tokens`` when already known."""
        tok_col = tokens[:, None]
        # Raw logprob of the sampled token for every row: cheap (logsumexp) and what best_of ranks by.
        if lps is None:
            lps = (raw.gather(1, tok_col)[:, 0] - torch.logsumexp(raw, -1)).tolist()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        tops: dict[int, TopList] = {}
        if want:
            processed = [i for i in want if params[i].logprobs_mode == "processed"]
            if processed:
                src = proc.clone() if warped is not None else proc
                if warped is not None:
                    src[torch.tensor(sampled, device=src.device)] = warped
                lsm_p = torch.log_softmax(src[processed], -1)
                for i, lp in zip(processed, lsm_p.gather(1, tok_col[processed])[:, 0].tolist()):
                    lps[i] = lp
                tops.update(zip(processed, _row_tops(lsm_p, processed, params)))
            rawrows = [i for i in want if params[i].logprobs_mode != "processed"]
            if rawrows and any(params[i].logprobs for i in rawrows):
                lsm_r = torch.log_softmax(raw[rawrows], -1)
                # Take the sampled token's value from the same tensor as its alternatives: the
                # logsumexp form above can differ in the last digits, and clients compare the two
                # (a greedy token must equal the best alternative).
                for i, lp in zip(rawrows, lsm_r.gather(1, tok_col[rawrows])[:, 0].tolist()):
                    lps[i] = lp
                tops.update(zip(rawrows, _row_tops(lsm_r, rawrows, params)))
            for i in want:
                tops.setdefault(i, [])
        return [SampleOutput(t, _clean(lp), tops.get(i)) for i, (t, lp) in enumerate(zip(tokens.tolist(), lps))]
