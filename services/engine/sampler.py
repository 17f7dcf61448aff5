"""Turning a batch of logits into tokens: vectorised over rows, seeded per position.

Order of operations on each row (the usual one: vLLM's, transformers'):
penalties -> logit_bias -> min_tokens masking (or, for a sequence with a grammar, the
grammar's token mask: the grammar decides where the output may end) -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> one draw.

Determinism (docs/design.md): the draw for the token at position t of a sequence seeded s uses a
uniform number derived from (s, t) alone, by inverse-CDF sampling, so it does not depend on
the batch the row sits in, its slot, or the step.

Speculative decoding: a row may stand for a sequence with proposed tokens appended (`ahead`):
its position, penalties, min_tokens and grammar state are those of the sequence as it would be
with them, so its token is the one the sequence would draw there.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from services.engine.params import SamplingParams
from services.engine.request import Sequence, TokenLogprobs
from services.engine.seeds import uniforms as numpy_uniforms
from services.engine.structured import Grammars
from services.model.batch import on_device


def uniforms(
    seeds: Seq[int], positions: Seq[int], device: torch.device | None = None
) -> torch.Tensor:
    """One number in [0, 1) per (seed, position), float64 [R] (services/engine/seeds.py),
    computed on the host (the same numbers on every device), on `device`."""
    u = torch.from_numpy(numpy_uniforms(seeds, positions))
    return u if device is None else on_device(u, device)


# rows asking for logprobs, their log-softmax, and their top values and token ids
LogprobRows = tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(
        self, vocab_size: int, eos_token_ids: Seq[int], grammars: Grammars | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars  # needed only for sequences with a grammar

    def __call__(
        self, logits: torch.Tensor, seqs: Seq[Sequence], ahead: Seq[Seq[int]] | None = None
    ) -> SampleResult:
        """logits: [R, vocab] float32, row i for seqs[i] followed by the tokens ahead[i]
        (proposed ones, being verified; none by default)."""
        ahead = ahead or [()] * len(seqs)
        params = [s.params for s in seqs]
        logprobs = self.logprob_rows(logits, params)
        token_list = self.choose(logits, seqs, ahead).tolist()  # the step's one wait on a GPU
        return SampleResult(token_list, pick_logprobs(logprobs, token_list, params))

    def choose(
        self, logits: torch.Tensor, seqs: Seq[Sequence], ahead: Seq[Seq[int]]
    ) -> torch.Tensor:
        """The rows' tokens, [R] int64 on the logits' device: every tensor on it (the
        penalties, biases, masks, temperatures and uniforms are moved there first)."""
        params = [s.params for s in seqs]
        x = self._process(logits, seqs, params, ahead)
        device = x.device
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if len(greedy) == len(seqs):
            return x.argmax(dim=-1)
        if greedy:
            g = _index(greedy, device)
            tokens[g] = x[g].argmax(dim=-1)
        if drawn:
            positions = [seqs[i].num_tokens + len(ahead[i]) for i in drawn]
            u = uniforms([seqs[i].seed for i in drawn], positions, device)
            d = _index(drawn, device)
            tokens[d] = sample_rows(x[d], [params[i] for i in drawn], u)
        return tokens

    def distributions(
        self, logits: torch.Tensor, seqs: Seq[Sequence], ahead: Seq[Seq[int]]
    ) -> torch.Tensor:
        """What each row's token is drawn from, [R, V] float64 (rows of sampled requests)."""
        params = [s.params for s in seqs]
        return distributions(self._process(logits, seqs, params, ahead), params)

    def _process(
        self,
        logits: torch.Tensor,
        seqs: Seq[Sequence],
        params: list[SamplingParams],
        ahead: Seq[Seq[int]],
    ) -> torch.Tensor:
        """Penalties, biases, min_tokens masking and grammars' masks, on a copy only when
        something applies."""
        x = logits
        penalised = [i for i, p in enumerate(params) if p.uses_penalties]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None and not ahead[i]]
        masked = [
            i
            for i, p in enumerate(params)
            if seqs[i].num_output_tokens + len(ahead[i]) < p.min_tokens and seqs[i].matcher is None
        ]
        if penalised or biased or masked or constrained:
            x = logits.clone()
        if penalised:
            chosen = _index(penalised, x.device)
            x[chosen] = apply_penalties(
                x[chosen], [seqs[i] for i in penalised], [ahead[i] for i in penalised]
            )
        if biased:  # one scatter for every (row, token, bias) of the batch
            pairs = [(i, t, b) for i in biased for t, b in params[i].logit_bias.items()]
            rows, cols, values = zip(*pairs, strict=True)
            x.index_put_(
                (_index(rows, x.device), _index(cols, x.device)),
                on_device(torch.tensor(values, dtype=x.dtype), x.device),
                accumulate=True,
            )
        if masked:
            cells = [(i, t) for i in masked for t in self._stops_before_min_tokens(params[i])]
            if cells:
                rows, cols = zip(*cells, strict=True)
                x[_index(rows, x.device), _index(cols, x.device)] = -float("inf")
        if constrained:  # a sequence's first row; its rows with tokens ahead follow it
            assert self.grammars is not None, "a sequence has a grammar, the sampler none"
            drafts = [_draft_after(seqs, ahead, i) for i in constrained]
            self.grammars.mask(x, constrained, [seqs[i].matcher for i in constrained], drafts)
        return x

    def _stops_before_min_tokens(self, p: SamplingParams) -> list[int]:
        """Tokens that would end the sequence, masked until min_tokens are out."""
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        return sorted(stops)

    def logprob_rows(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> LogprobRows | None:
        """Log-softmax of the model's own logits (before any processing) where asked."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        logp = torch.log_softmax(logits[rows], dim=-1)
        top_vals, top_ids = top_k(logp, max(params[i].logprobs or 0 for i in rows))
        return rows, logp, top_vals, top_ids


def _index(values: Seq[int], device: torch.device) -> torch.Tensor:
    return on_device(torch.tensor(values, dtype=torch.int64), device)


def _draft_after(seqs: Seq[Sequence], ahead: Seq[Seq[int]], i: int) -> Seq[int]:
    """The tokens ahead of the last of the rows following row i for the same sequence (the
    whole draft being verified; empty when row i stands alone)."""
    j = i
    while j + 1 < len(seqs) and seqs[j + 1] is seqs[i] and len(ahead[j + 1]) == j + 1 - i:
        j += 1
    return ahead[j]


def pick_logprobs(
    lp: LogprobRows | None,
    tokens: list[int],
    params: list[SamplingParams],
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    if lp is None:
        return out
    rows, logp, top_vals, top_ids = lp
    picked = _index([tokens[i] for i in rows], logp.device)
    chosen = logp[torch.arange(len(rows), device=logp.device), picked].tolist()
    vals, ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        top = tuple(zip(ids[j][:k], vals[j][:k], strict=True))
        out[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return out


def top_k(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values per row and their token ids (empty [R, 0] for k = 0)."""
    return logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())


def score_tokens(logits: torch.Tensor, targets: Seq[int], k: int) -> list[TokenLogprobs]:
    """Each target token's log-probability under its row of logits [R, vocab], with its rank
    and the k most likely tokens (scoring a prompt)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    t = _index(list(targets), logp.device)
    chosen = logp[torch.arange(len(t), device=logp.device), t]
    ranks = ((logp > chosen[:, None]).sum(dim=-1) + 1).tolist()
    vals, ids = top_k(logp, k)
    return [
        TokenLogprobs(target, lp, tuple(zip(i, v, strict=True)), rank)
        for target, lp, i, v, rank in zip(
            targets, chosen.tolist(), ids.tolist(), vals.tolist(), ranks, strict=True
        )
    ]


def apply_penalties(
    x: torch.Tensor, seqs: Seq[Sequence], ahead: Seq[Seq[int]] | None = None
) -> torch.Tensor:
    """Presence and frequency penalties (over the output) and the repetition penalty (over
    prompt and output), for rows x[i] of seqs[i] followed by ahead[i]. x: [R, vocab]."""
    vocab = x.shape[1]
    ahead = ahead or [()] * len(seqs)
    outputs = [[*s.output_ids, *a] for s, a in zip(seqs, ahead, strict=True)]
    out_counts = _counts(outputs, vocab, x.device)
    seen = _counts([[*s.token_ids, *a] for s, a in zip(seqs, ahead, strict=True)], vocab, x.device)
    seen = seen > 0

    def column(values: list[float]) -> torch.Tensor:
        return on_device(torch.tensor(values), x.device)[:, None]

    presence = column([s.params.presence_penalty for s in seqs])
    frequency = column([s.params.frequency_penalty for s in seqs])
    repetition = column([s.params.repetition_penalty for s in seqs])
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * out_counts - presence * (out_counts > 0)


def _counts(rows: Seq[Seq[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] occurrence counts of each row's token ids (built on the host, one copy)."""
    width = max((len(r) for r in rows), default=0)
    padded = [[*r, *[vocab] * (max(width, 1) - len(r))] for r in rows]  # vocab = padding
    ids = on_device(torch.tensor(padded, dtype=torch.int64), device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def sample_rows(x: torch.Tensor, params: Seq[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One draw per row of x [R, V] (processed logits) with uniforms u [R]; a row's token
    depends on that row alone (_by_order)."""

    def rows(x: torch.Tensor, params: Seq[SamplingParams], u: torch.Tensor) -> torch.Tensor:
        probs, order = _final_probs(x, params)
        cdf = probs.cumsum(dim=-1)
        target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
        index = torch.searchsorted(cdf, target, right=True).clamp_(max=x.shape[1] - 1)[:, 0]
        return index if order is None else order.gather(1, index[:, None])[:, 0]

    return _by_order(rows, x, params, u)


def distributions(x: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """What sample_rows draws from, per row of x [R, V]: [R, V] float64 summing to 1, in
    vocabulary order (speculative decoding's rejection sampling)."""

    def rows(x: torch.Tensor, params: Seq[SamplingParams], _: torch.Tensor) -> torch.Tensor:
        probs, order = _final_probs(x, params)
        if order is not None:
            probs = torch.zeros_like(probs).scatter_(1, order, probs)
        return probs / probs.sum(dim=-1, keepdim=True)

    return _by_order(rows, x, params, x.new_empty(len(params)))


def _by_order(
    fn: Callable[[torch.Tensor, Seq[SamplingParams], torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Seq[SamplingParams],
    u: torch.Tensor,
) -> torch.Tensor:
    """fn over the rows with top-p (whose draw runs over the vocabulary sorted by
    probability) and, apart, over the others (in vocabulary order): one inverse CDF over
    another order picks another token for the same uniform, so a seeded request's token
    would depend on whether a top-p request shares its batch."""
    sorted_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if len(sorted_rows) in (0, len(params)):
        return fn(x, params, u)
    plain_rows = [i for i, p in enumerate(params) if p.top_p >= 1.0]
    parts = []
    for rows in (sorted_rows, plain_rows):
        index = on_device(torch.tensor(rows), x.device)
        parts.append((index, fn(x[index], [params[i] for i in rows], u[index.to(u.device)])))
    first = parts[0][1]
    out = first.new_empty((len(params), *first.shape[1:]))
    for index, values in parts:
        out[index] = values
    return out


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [R, V] (vocabulary order, any scale) by inverse CDF."""
    cdf = probs.cumsum(dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)[:, 0]


def _final_probs(
    x: torch.Tensor, params: Seq[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, top-k, top-p and min-p: float64 weights per row (not normalised), sorted
    descending when top-p needed it (then with the order: sorted position -> token)."""
    temps = on_device(torch.tensor([p.temperature for p in params], dtype=x.dtype), x.device)[
        :, None
    ]
    x = x / temps
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    order: torch.Tensor | None = None
    if any(p < 1.0 for p in top_p):
        x, order = x.sort(dim=-1, descending=True)
    if any(top_k):
        x = _top_k(x, top_k, is_sorted=order is not None)
    probs = torch.softmax(x.double(), dim=-1)
    if order is not None:
        probs = _top_p(probs, top_p)
    if any(min_p):
        floor = on_device(torch.tensor(min_p, dtype=probs.dtype), probs.device)[:, None]
        threshold = probs.max(dim=-1, keepdim=True).values * floor
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs, order


def _top_k(x: torch.Tensor, ks: list[int], is_sorted: bool) -> torch.Tensor:
    kmax = max(ks)
    kth = x[:, :kmax] if is_sorted else x.topk(kmax, dim=-1).values  # [R, kmax], descending
    index = on_device(torch.tensor([(k or kmax) - 1 for k in ks]), x.device)[:, None]
    cutoff = kth.gather(1, index)
    keep_all = on_device(torch.tensor([k == 0 for k in ks]), x.device)[:, None]
    return x.masked_fill(~keep_all & (x < cutoff), -float("inf"))


def _top_p(sorted_probs: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Keep the smallest prefix (of probabilities sorted descending) holding mass >= p."""
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
    p = on_device(torch.tensor(ps, dtype=sorted_probs.dtype), sorted_probs.device)[:, None]
    return sorted_probs.masked_fill(before >= p, 0.0)
