"""The `hf` engine's bookkeeping: its rows, requests, padded batches and kept prefixes, and its draws.

A batch is one padded cache of the rows' *own* tokens (`[R, H_kv, W, D]` per layer, `mask` saying which
columns hold a row's tokens) plus, per row, the chain of shared pieces it continues
(`treetrain.rollout.engines.cascade`); a row's next position is its chain's length plus its own tokens.

Example:
    >>> import torch
    >>> from treetrain.rollout.sampling import Sampling
    >>> g = torch.Generator().manual_seed(0)
    >>> draw_rows(torch.tensor([[0.0, 9.0], [9.0, 0.0]]), Sampling(), [g, g])[0].tolist()
    [1, 0]
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from treetrain.rollout.engines.batch_cache import layers_of, with_room
from treetrain.rollout.engines.cascade import Chain, Piece
from treetrain.rollout.engines.generation import Completion, GenerationRequest, StopMatcher
from treetrain.rollout.prefix_sampler import fork_cache, sampling_logprobs
from treetrain.rollout.sampling import Sampling


@dataclass
class Kept:
    """The KV of a finished row's context and tokens, for the branch's next request."""

    cache: Any  # the row's own tokens, batch size 1, no padding
    uses: int
    group: str
    nbytes: int = 0
    """Bytes of `cache` (the chain's pieces are counted once, with every holder's)."""
    chain: Chain = ()


class KeptPrefixes(OrderedDict[tuple[int, ...], Kept]):
    """Kept prefixes by their token ids, least recently used first."""

    def nbytes(self) -> int:
        """Bytes of the kept prefixes and of the pieces they hold (each once)."""
        kept = list(self.values())
        return sum(e.nbytes for e in kept) + pieces_bytes([e.chain for e in kept])

    def lookup(self, context: tuple[int, ...]) -> tuple[int, Any, Chain]:
        """The longest kept prefix of `context` (leaving at least one token to encode): its length, a cache
        of its own tokens to use (the entry's own, once its last use is taken), and the pieces before them."""
        best, found = 0, None
        for key in self:
            if best < len(key) < len(context) and context[: len(key)] == key:
                best, found = len(key), key
        if found is None:
            return 0, None, ()
        entry = self[found]
        entry.uses -= 1
        if entry.uses <= 0:
            del self[found]
            return best, entry.cache, entry.chain
        self.move_to_end(found)
        return best, fork_cache(entry.cache, [0]), entry.chain

    def release(self, group: str) -> None:
        for key in [k for k, e in self.items() if e.group == group]:
            del self[key]


@dataclass
class Row:
    request: int
    sample: int
    chain: Chain = ()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False


@dataclass
class Job:
    request: GenerationRequest
    rid: int
    stops: StopMatcher
    generator: torch.Generator
    results: list[Completion | None]
    version: int
    cached: int = 0


@dataclass
class Batch:
    """Rows decoded together over one cache of `width` own columns; `mask` says which columns hold each
    row's tokens (the rest is padding), `positions` is each row's next position."""

    cache: Any
    rows: list[Row]
    mask: torch.Tensor  # [R, W] long
    positions: torch.Tensor  # [R] long
    logits: torch.Tensor  # [R, V]

    @property
    def dead(self) -> int:
        return sum(r.done for r in self.rows)


def draw_rows(
    logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` `[R, V]` under `sampling`, each from its own request's generator (an
    inverse-CDF draw of one uniform), so a row's draw never depends on what shares the batch: `(tokens [R],
    logprobs [R])` under the distribution sampled from (0 when greedy)."""
    if sampling.greedy:
        return logits.argmax(dim=-1), torch.zeros(logits.shape[0], device=logits.device)
    logp = sampling_logprobs(logits, sampling)  # [R, V]
    u = 1 - torch.cat([torch.rand(1, generator=g, device=logits.device) for g in generators])  # [R] in (0, 1]
    cdf = logp.exp().cumsum(dim=-1)  # [R, V]
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1)  # [R] never a 0-mass token
    tok = tok.clamp(max=logits.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def common_prefixes(contexts: list[tuple[int, ...]], least: int) -> list[tuple[list[int], int]]:
    """Groups of two or more `contexts` (by index) that start with the same `least` tokens, and how many
    leading tokens each group has in common, short of every context's last.

    >>> common_prefixes([(1, 2, 3, 4), (1, 2, 3, 5), (1, 9, 9, 9), (1, 2, 3)], 2)
    [([0, 1, 3], 2)]
    """
    alike: dict[tuple[int, ...], list[int]] = {}
    for i, context in enumerate(contexts):
        if len(context) > least:
            alike.setdefault(context[:least], []).append(i)
    out = []
    for group in alike.values():
        if len(group) < 2:
            continue
        members = [contexts[i] for i in group]
        most, first = min(len(c) for c in members) - 1, members[0]
        out.append(
            (group, next((j for j in range(least, most) if any(c[j] != first[j] for c in members)), most))
        )
    return out


def pieces_bytes(chains: list[Chain]) -> int:
    """Bytes of the distinct pieces `chains` hold, each counted once."""
    return sum({id(p): p.nbytes for chain in chains for p in chain}.values())


def fork_rows(
    model: Any, counts: list[int], cache: Any, mask: torch.Tensor, heads: torch.Tensor, logits: torch.Tensor,
    rows: list[Row], forked: list[int],
) -> Batch:  # fmt: skip
    """The batch of a prefill of `len(counts)` jobs (`counts[b]` rows each, `rows` and `logits` already one per
    row) where each job in `forked` has its own tokens made a piece its rows share: those rows hold no own
    tokens; the other jobs' rows keep theirs (`cache` and `mask` hold one row per job)."""
    layers = layers_of(cache)
    device = layers[0][0].device
    pieces = {}
    for b in forked:
        cols = mask[b].bool().nonzero().squeeze(-1).to(device)
        pieces[b] = Piece(tuple((k[b : b + 1, :, cols], v[b : b + 1, :, cols]) for k, v in layers))
    source = [b for b, n in enumerate(counts) for _ in range(n)]  # [R]
    rows = [
        Row(r.request, r.sample, (*r.chain, pieces[b])) if b in pieces else r for r, b in zip(rows, source)
    ]
    alone = [j for j, b in enumerate(source) if b not in pieces]
    width, own_mask = 0, mask.new_zeros(len(rows), 0)
    if alone:
        own_mask = mask.new_zeros(len(rows), mask.shape[1])
        own_mask[alone] = mask[[source[j] for j in alone]]
        width = mask.shape[1] - int(own_mask.any(dim=0).nonzero()[0])  # pending tokens: never empty
        own_mask = own_mask[:, mask.shape[1] - width :]
    # each row's own tokens: its job's (the last `width` columns), or none (the zero row after the jobs)
    index = torch.tensor([len(counts) if b in pieces else b for b in source], dtype=torch.long, device=device)
    own = [(k[:, :, k.shape[2] - width :], v[:, :, v.shape[2] - width :]) for k, v in layers]
    none = [(k[:1, :, :0], v[:1, :, :0]) for k, v in layers]
    return Batch(with_room(model, [own, none], width, index), rows, own_mask, heads, logits)
