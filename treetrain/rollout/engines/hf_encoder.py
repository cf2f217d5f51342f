"""The `hf` engine's forwards: requests' contexts into a padded batch of rows, and each decode step's forward.

`HFEngine` (`treetrain.rollout.engines.hf_engine`) decides *which* requests run and what happens to a row's
tokens; this module owns *how* rows sit in one padded cache, so the layout (left-padded kept tokens,
right-aligned pending tokens, the 2-D mask and explicit positions, pieces shared through `cascade`) is
written in one place: prefilling admitted requests, joining a new batch to the running one, compacting
finished rows away, and the forward every step makes over the layout.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from treetrain.rollout.engines.generation import EngineStats, GenerationRequest, StopMatcher
    >>> from treetrain.rollout.engines.hf_batch import Job
    >>> from treetrain.rollout.sampling import Sampling
    >>> _ = torch.manual_seed(0)
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    >>> encoder = BatchEncoder(model, EngineStats(), cascade=False)
    >>> request = GenerationRequest((5, 6, 7), 2, 4, Sampling(), ((1,),), seed=0)
    >>> job = Job(request, 0, StopMatcher.of(request.stop), torch.Generator(), [None, None], 0)
    >>> with torch.no_grad():
    ...     batch = encoder.prefill([job], [(0, None, ())])
    >>> len(batch.rows), batch.positions.tolist(), tuple(batch.logits.shape)
    (2, [3, 3], (2, 64))
"""

from __future__ import annotations

from typing import Any

import torch

from treetrain.rollout.engines.batch_cache import layers_of, mask_left, mergeable, new_cache, with_room
from treetrain.rollout.engines.cascade import (
    Chain,
    Layout,
    Piece,
    cascade,
    chain_key,
    chain_length,
    groups_of,
)
from treetrain.rollout.engines.generation import EngineStats
from treetrain.rollout.engines.hf_batch import Batch, Job, Row, common_prefixes, fork_rows
from treetrain.rollout.prefix_sampler import select_rows

MIN_PIECE = 32
"""Fewest tokens worth a shared piece (`cascade`): requests admitted together share a common prefix this
long, and a fork's rows share their context's own tokens when there are this many (fewer are copied to
each row, cheaper than one more attention call per step)."""

Found = tuple[int, Any, Chain]
"""What a job's context found kept: the tokens it covers, the cache of its own tokens (or None), its chain."""


class BatchEncoder:
    """The forwards of one `HFEngine` over its model; `cascade` says whether rows share pieces."""

    def __init__(self, model: Any, stats: EngineStats, *, cascade: bool) -> None:
        self.model = model
        self.stats = stats
        self.cascade = cascade
        self.device = next(model.parameters()).device

    def prefill(self, jobs: list[Job], found: list[Found]) -> Batch:
        """Encode the uncached part of every job's context in one forward, then give each its `n` rows.

        Row b is [padding | kept own tokens b | padding | pending tokens b]: kept tokens are left-padded to
        a common width, pending tokens right-aligned to a common length, so every row's last token is last.
        A kept prefix's pieces (`cascade`) are read, not copied. With `cascade`, the context of a job with
        `n > 1` becomes a piece its rows share, and they start with no own tokens.
        """
        if self.cascade:  # rows that share pieces side by side: each piece is read once per step
            found = self._share_common(jobs, found)
            order = sorted(range(len(jobs)), key=lambda b: chain_key(found[b][2]))
            jobs, found = [jobs[b] for b in order], [found[b] for b in order]
        pending = [job.request.context[hit:] for job, (hit, _, _) in zip(jobs, found)]
        chains = [chain for _, _, chain in found]
        bases = torch.tensor([chain_length(c) for c in chains])  # [B]
        owns = torch.tensor([hit for hit, _, _ in found]) - bases  # [B] kept own tokens
        for job, (hit, _, _) in zip(jobs, found):
            job.cached = hit
            self.stats.cached_tokens += hit
        width = int(owns.max())
        if len(jobs) == 1:
            cache = found[0][1] if found[0][1] is not None else new_cache(self.model)
        elif width == 0:
            cache = new_cache(self.model)
        else:
            ref = next(layers_of(c) for _, c, _ in found if c is not None)
            empty = [(k[:1, :, :0], v[:1, :, :0]) for k, v in ref]  # a job with nothing kept: all padding
            cache = with_room(
                self.model, [layers_of(c) if c is not None else empty for _, c, _ in found], width
            )
        lengths = torch.tensor([len(p) for p in pending])  # [B]
        span = int(lengths.max())
        ids = torch.zeros(len(jobs), span, dtype=torch.long)  # [B, P]
        for b, p in enumerate(pending):
            ids[b, span - len(p) :] = torch.tensor(p)
        cols = torch.arange(width)[None, :]
        mask = torch.cat(
            [
                (cols >= width - owns[:, None]).long(),
                (torch.arange(span)[None, :] >= span - lengths[:, None]).long(),
            ],
            dim=1,
        )  # [B, width + P]
        offsets = torch.arange(span)[None, :] - (span - lengths[:, None])  # [B, P]
        positions = ((bases + owns)[:, None] + offsets).clamp(min=0)  # [B, P]
        logits = self.forward(ids, cache, mask, positions, chains, pending=span)
        self.stats.encoded_tokens += int(lengths.sum())
        ns = [job.request.n for job in jobs]
        index = torch.repeat_interleave(torch.arange(len(jobs)), torch.tensor(ns))  # [R]
        heads = (bases + owns + lengths)[index]  # [R] each row's next position
        rows = [Row(job.rid, i, chains[b]) for b, job in enumerate(jobs) for i in range(job.request.n)]
        forked = [b for b, job in enumerate(jobs) if job.request.n > 1 and owns[b] + lengths[b] >= MIN_PIECE]
        if self.cascade and forked:
            return fork_rows(self.model, ns, cache, mask, heads, logits[index], rows, forked)
        if len(index) > len(jobs):
            select_rows(cache, index.to(self.device))
        return Batch(cache, rows, mask[index], heads, logits[index])

    def _share_common(self, jobs: list[Job], found: list[Found]) -> list[Found]:
        """Jobs with nothing kept whose contexts start alike (a system prompt and tools, the same task's
        prompt): their longest common prefix is encoded once, as a piece they all continue."""
        out = list(found)
        fresh = [b for b, (hit, _, _) in enumerate(found) if hit == 0]
        for group, common in common_prefixes([jobs[b].request.context for b in fresh], MIN_PIECE):
            group = [fresh[i] for i in group]
            first = jobs[group[0]].request.context
            cache = new_cache(self.model)
            ids = torch.tensor([first[:common]], dtype=torch.long, device=self.device)  # [1, L]
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            self.stats.forward_calls += 1
            self.stats.encoded_tokens += common
            piece = Piece(tuple((k.clone(), v.clone()) for k, v in layers_of(cache)))  # no growth room
            for b in group:
                out[b] = (common, None, (piece,))
        return out

    def forward(
        self, ids: torch.Tensor, cache: Any, mask: torch.Tensor, positions: torch.Tensor,
        chains: list[Chain], *, pending: int,
    ) -> torch.Tensor:  # fmt: skip
        """The last position's logits `[R, V]` of one forward of `ids` `[R, P]` over the rows' own cache
        (`mask` `[R, W + P]` over its columns and the new ones) and, with `cascade`, their pieces."""
        ids = ids.to(self.device)
        if self.cascade:
            width = mask.shape[1] - pending
            visible = mask.bool()[:, None, :].repeat(1, pending, 1)  # [R, P, W + P]
            causal = torch.ones(pending, pending, dtype=torch.bool).tril()
            visible[:, :, width:] &= causal
            visible[:, :, width:] |= torch.eye(pending, dtype=torch.bool)  # a padding query sees itself
            layout = Layout(groups_of(chains), visible.to(self.device))
            with cascade(self.model, layout):
                out = self.model(
                    input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1,
                    position_ids=positions.to(self.device),
                )  # fmt: skip
        else:
            kwargs: dict[str, Any] = {}
            if not bool(mask.all()):
                kwargs = {"attention_mask": mask.to(self.device), "position_ids": positions.to(self.device)}
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **kwargs)
        self.stats.forward_calls += 1
        return out.logits[:, -1, :].float()  # [R, V]

    def join(self, a: Batch, b: Batch) -> Batch:
        """One padded batch of `a`'s rows and `b`'s, left-padded to the wider; with `cascade`, rows that
        share pieces are put side by side."""
        width = max(a.mask.shape[1], b.mask.shape[1])
        rows = a.rows + b.rows
        mask = torch.cat([mask_left(a.mask, width), mask_left(b.mask, width)])
        positions, logits = torch.cat([a.positions, b.positions]), torch.cat([a.logits, b.logits])
        order = sorted(range(len(rows)), key=lambda j: chain_key(rows[j].chain)) if self.cascade else []
        index = None
        if order and order != list(range(len(rows))):  # rows that share pieces side by side
            index = torch.tensor(order, dtype=torch.long)
            rows = [rows[j] for j in order]
            mask, positions, logits = mask[index], positions[index], logits[index]
            index = index.to(self.device)
        cache = with_room(self.model, [layers_of(a.cache), layers_of(b.cache)], width, index)
        return Batch(cache, rows, mask, positions, logits)

    def compact(self, batch: Batch) -> list[int]:
        """Drop finished rows, and the columns only padding holds; returns the rows kept."""
        keep = [j for j, r in enumerate(batch.rows) if not r.done]
        index = torch.tensor(keep, dtype=torch.long)
        batch.rows = [batch.rows[j] for j in keep]
        batch.mask, batch.positions, batch.logits = (
            batch.mask[index],
            batch.positions[index],
            batch.logits[index],
        )
        if not mergeable(batch.cache):
            select_rows(batch.cache, index.to(self.device))
            return keep
        used = batch.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else batch.mask.shape[1]
        batch.mask = batch.mask[:, first:]
        layers = [(k[:, :, first:], v[:, :, first:]) for k, v in layers_of(batch.cache)]
        batch.cache = with_room(self.model, [layers], batch.mask.shape[1], index.to(self.device))
        return keep
