"""The trainer's own model as an inference engine: continuous batching over every in-flight sample.

`HFEngine` serves `GenerationRequest`s with the Hugging Face model being trained. Every `poll` is one
decode step of *all* live rows together, whichever request, tree or task they belong to: the requests that
arrived since the last step are encoded together in one forward and join the batch, and finished rows leave
it. Rows of different lengths share one cache through padding, with a 2-D attention mask and explicit
position ids (as `generate` batches prompts), for every model whose cache is plain full-attention KV; other
caches (sliding windows, recurrent state) are batched per request instead, with no padding at all.

**Shared pieces.** Where the model's attention is plain (`cascade.cascade_reason`), contexts are not
copied per row. Requests admitted together whose contexts start alike (a system prompt and tools) encode
their common prefix once, as a piece; a request with `n > 1` makes its remaining context a piece its `n`
rows share; the padded per-row cache holds only each row's own tokens, and every layer attends over the
pieces once per step for all the rows that share them (`cascade`). Other models repeat a request's
context for its `n` rows. When a row finishes, its pieces and the KV of its own tokens but the last are
kept, keyed by those token ids: the next request whose context extends them (the branch's next turn,
after the tool result) encodes only the new tokens. That is the engine's prefix cache;
`GenerationRequest.children` says how many requests will use a kept prefix, and `release_group` drops what
a finished tree left behind.

**Memory.** `max_kv_bytes` caps the KV the engine holds: live rows, kept prefixes and pieces together. A
request waits while the KV its rows and the live rows may reach (context plus turn budget, as wide as the
widest row of the padded batch, with a growing layer's room, and a fork's piece: `_reserve`) would exceed
the cap; kept prefixes are dropped oldest first to make room, and one request always runs. `held_bytes`
is what it holds, counted from the tensors' storage (`cache_bytes`, a piece once), and `peak_kv_bytes`
the most it held between decode steps. The reservation assumes plain attention KV (`token_kv_bytes`);
for recurrent state it is an estimate.

This module decides which requests run and what becomes of a row's tokens; how rows sit in one padded
cache, and the forwards over it, are `treetrain.rollout.engines.hf_encoder`'s.

Each request draws from its own `torch.Generator` seeded by `GenerationRequest.seed` (one uniform per row
and step, inverted through the row's CDF), so its samples do not depend on what else shares the batch, up
to float rounding: the logits of a row in a padded batch can differ from its logits alone in the last bits,
which moves its logprobs there and, very rarely, a draw that falls on a boundary. Logprobs are those of the
distribution actually sampled from (`treetrain.rollout.prefix_sampler.sampling_logprobs`): 0 under greedy decoding.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from treetrain.rollout.engines.generation import GenerationRequest
    >>> from treetrain.rollout.sampling import Sampling
    >>> _ = torch.manual_seed(0)
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    >>> engine = HFEngine(model)
    >>> a = engine.submit(GenerationRequest((5, 6, 7), 2, 4, Sampling(), ((1,),), seed=0))
    >>> b = engine.submit(GenerationRequest((9, 8), 3, 4, Sampling(), ((1,),), seed=1))
    >>> done = []
    >>> while engine.busy:
    ...     done += engine.poll()
    >>> sorted((r.request_id, len(r.completions)) for r in done)
    [(0, 2), (1, 3)]
"""

from __future__ import annotations

from typing import Any

import torch

from treetrain.rollout.engines.batch_cache import (
    adopt,
    cache_bytes,
    layers_of,
    mergeable,
    new_cache,
    token_kv_bytes,
)
from treetrain.rollout.engines.cascade import cascade_reason, cascade_runs
from treetrain.rollout.engines.generation import (
    Completion,
    Draft,
    EngineError,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    Interrupted,
    StopMatcher,
)
from treetrain.rollout.engines.hf_batch import Batch, Job, Kept, KeptPrefixes, draw_rows, pieces_bytes
from treetrain.rollout.engines.hf_encoder import BatchEncoder
from treetrain.rollout.prefix_sampler import fork_cache
from treetrain.rollout.sampling import Sampling

MAX_ROWS = 64
"""Most live rows decoded together; a request waits while admitting it would exceed this (one always
fits). Finished rows awaiting compaction are not counted."""
MAX_KEPT = 512
"""Most kept prefixes; the least recently used go first."""
MAX_KV_BYTES = 1 << 30
"""Default cap on the KV bytes the engine holds (the trainer passes `rollout.hf_kv_budget`)."""


class HFEngine:
    """Continuous batching over a Hugging Face causal LM; see the module docstring."""

    def __init__(
        self,
        model: Any,
        *,
        version: int = 0,
        max_rows: int = MAX_ROWS,
        max_kept: int = MAX_KEPT,
        max_kv_bytes: int = MAX_KV_BYTES,
        keep_prefixes: bool = True,
        share_contexts: bool = True,
    ) -> None:
        if isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, int) or max_kv_bytes < 1:
            raise EngineError(
                f"rollout.engine=hf: max_kv_bytes must be a positive integer, got {max_kv_bytes!r}"
            )
        self.version = version
        self.stats = EngineStats()
        self.max_rows, self.max_kept, self.keep_prefixes = max_rows, max_kept, keep_prefixes
        self.max_kv_bytes = max_kv_bytes
        self.peak_kv_bytes = 0
        """The most KV bytes held at once since the engine was made."""
        self.device = next(model.parameters()).device
        self.merge = mergeable(new_cache(model))
        """Whether rows of different requests share one padded batch (plain full-attention caches)."""
        self.cascade = self.merge and share_contexts and cascade_reason(model) is None and cascade_runs(model)
        """Whether the rows of a fork read their context from one shared piece (`cascade`)."""
        self._encoder = BatchEncoder(model, self.stats, cascade=self.cascade)
        self._next_id = 0
        self._waiting: list[Job] = []
        self._jobs: dict[int, Job] = {}
        self._batches: list[Batch] = []
        self._kept = KeptPrefixes()
        self._token_bytes: int | None = None

    @property
    def model(self) -> Any:
        """The model sampled from (the trainer's own); its forwards run through `BatchEncoder`."""
        return self._encoder.model

    # ----- GenerationEngine -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> int:
        rid = self._next_id
        self._next_id += 1
        generator = torch.Generator(device=self.device).manual_seed(request.seed)
        job = Job(request, rid, StopMatcher.of(request.stop), generator, [None] * request.n, self.version)
        self._waiting.append(job)
        self._jobs[rid] = job
        self.stats.requests += 1
        self.stats.prompt_tokens += request.prompt_tokens
        return rid

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def held_bytes(self) -> int:
        """KV bytes held now: every live batch's cache, every kept prefix and every shared piece they hold
        (their actual storage, a piece once)."""
        live = sum(cache_bytes(b.cache) for b in self._batches)
        chains = [r.chain for b in self._batches for r in b.rows] + [e.chain for e in self._kept.values()]
        return live + sum(e.nbytes for e in self._kept.values()) + pieces_bytes(chains)

    def _held(self) -> int:
        held = self.held_bytes
        self.peak_kv_bytes = max(self.peak_kv_bytes, held)
        return held

    @torch.no_grad()
    def poll(self) -> list[GenerationResult]:
        """Encode the requests that fit, then draw one token for every live row (one forward per batch)."""
        self._admit()
        finished: list[GenerationResult] = []
        for batch in self._batches:
            self._step(batch, finished)
        self._batches = [b for b in self._batches if b.dead < len(b.rows)]
        self._held()
        return finished

    def sync_weights(self, model: object, version: int) -> None:
        """The engine samples from the trainer's own model: nothing to copy, but prefixes kept under the old
        weights are dropped."""
        if self.busy:
            raise EngineError(
                "rollout.engine=hf: sync_weights while requests are in flight (abort them first)"
            )
        self._encoder.model = model
        self.version = version
        self._kept.clear()
        self.stats.weight_syncs += 1

    def release_group(self, group: str) -> None:
        """Drop the kept prefixes of `group` (its tree is finished)."""
        self._kept.release(group)

    def abort(self) -> None:
        """Drop every request in flight and its rows' KV; kept prefixes stay (they are still valid)."""
        self._waiting.clear()
        self._jobs.clear()
        self._batches.clear()

    def interrupt(self) -> list[Interrupted]:
        """Stop every request in flight; each sample not yet finished comes back as the `Draft` of what its
        row drew (nothing for a request still waiting to be encoded)."""
        rows = {(r.request, r.sample): r for b in self._batches for r in b.rows if not r.done}
        out = []
        for rid, job in self._jobs.items():
            drawn = [rows.get((rid, i)) for i in range(job.request.n)]
            samples = tuple(
                c if c is not None else Draft.drawn(r.tokens, r.logprobs, job.version) if r else Draft()
                for c, r in zip(job.results, drawn)
            )
            out.append(Interrupted(rid, samples))
        self.abort()
        return out

    def close(self) -> None:
        self.abort()
        self._kept.clear()

    # ----- admission --------------------------------------------------------------------------------
    def _live(self) -> list[GenerationRequest]:
        """The requests whose rows are in a batch (admitted, not finished)."""
        waiting = {id(job) for job in self._waiting}
        return [job.request for job in self._jobs.values() if id(job) not in waiting]

    def _admit(self) -> None:
        """Move waiting requests into the batch while the rows and the KV they would reserve fit."""
        live = self._live()
        rows = sum(r.n for r in live)
        jobs: list[Job] = []
        while self._waiting:
            request = self._waiting[0].request
            need = self._reserve([*live, *(job.request for job in jobs), request])
            while need + self._kept.nbytes() > self.max_kv_bytes and self._kept:  # oldest kept prefix first
                self._kept.popitem(last=False)
            idle = not live and not jobs
            if not idle and (rows + request.n > self.max_rows or need > self.max_kv_bytes):
                break
            jobs.append(self._waiting.pop(0))
            rows += request.n
        if not jobs:
            return
        encoder = self._encoder
        if not self.merge:
            self._batches += [
                encoder.prefill([job], [self._kept.lookup(job.request.context)]) for job in jobs
            ]
            return
        new = encoder.prefill(jobs, [self._kept.lookup(job.request.context) for job in jobs])
        into = self._batches.pop() if self._batches else None
        self._batches.append(new if into is None else encoder.join(into, new))

    def _reserve(self, requests: list[GenerationRequest]) -> int:
        """KV bytes `requests`' rows may hold at their longest, growth room included: a growing layer
        reserves up to twice its length, and rows in one padded batch are as wide as its widest; a fork's
        shared piece (`cascade`) holds its context once more."""
        if self._token_bytes is None:
            self._token_bytes = token_kv_bytes(self.model)
        spans = [max(r.prompt_tokens + r.max_new_tokens, 32) for r in requests]
        if self.merge:
            pieces = sum(r.prompt_tokens for r in requests if r.n > 1) if self.cascade else 0
            rows = sum(r.n for r in requests)
            return self._token_bytes * (2 * rows * max(spans, default=0) + pieces)
        return sum(2 * self._token_bytes * r.n * span for r, span in zip(requests, spans))

    def _trim_kept(self) -> None:
        """Drop kept prefixes, oldest first, beyond `max_kept` or the bytes the live rows leave."""
        live = self._reserve(self._live())
        while self._kept and (
            len(self._kept) > self.max_kept or live + self._kept.nbytes() > self.max_kv_bytes
        ):
            self._kept.popitem(last=False)

    # ----- decoding ---------------------------------------------------------------------------------
    def _step(self, batch: Batch, finished: list[GenerationResult]) -> None:
        tokens = [0] * len(batch.rows)  # a finished row is fed padding, masked out
        live = [j for j, row in enumerate(batch.rows) if not row.done]
        drawn = self._draw(batch, live)
        for j, (tok, lp) in zip(live, drawn):
            row = batch.rows[j]
            job = self._jobs[row.request]
            tokens[j] = tok
            row.tokens.append(tok)
            row.logprobs.append(min(lp, 0.0))
            self.stats.sampled_tokens += 1
            stopped = job.stops.stops(row.tokens)
            if stopped or len(row.tokens) >= job.request.max_new_tokens:
                self._finish(batch, j, job, stopped, finished)
        if batch.dead == len(batch.rows):
            return
        if batch.dead and (not self.merge or batch.dead * 4 >= len(batch.rows)):
            keep = self._encoder.compact(batch)
            tokens = [tokens[j] for j in keep]
        fed = torch.tensor([0 if r.done else 1 for r in batch.rows])  # [R]
        batch.mask = torch.cat([batch.mask, fed[:, None]], dim=1)  # [R, W + 1]
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]  # [R, 1]
        chains = [r.chain for r in batch.rows]
        batch.logits = self._encoder.forward(
            ids, batch.cache, batch.mask, batch.positions[:, None], chains, pending=1
        )
        self.stats.encoded_tokens += int(fed.sum())
        batch.positions = batch.positions + fed

    def _draw(self, batch: Batch, live: list[int]) -> list[tuple[int, float]]:
        """One token per live row: rows that share sampling settings are drawn together (`draw_rows`)."""
        out: dict[int, tuple[int, float]] = {}
        by_sampling: dict[Sampling, list[int]] = {}
        for j in live:
            by_sampling.setdefault(self._jobs[batch.rows[j].request].request.sampling, []).append(j)
        for sampling, rows in by_sampling.items():
            gens = [self._jobs[batch.rows[j].request].generator for j in rows]
            tok, lp = draw_rows(batch.logits[rows], sampling, gens)
            out.update((j, (int(t), float(x))) for j, t, x in zip(rows, tok.tolist(), lp.tolist()))
        return [out[j] for j in live]

    def _finish(
        self, batch: Batch, j: int, job: Job, stopped: bool, finished: list[GenerationResult]
    ) -> None:
        row, request = batch.rows[j], job.request
        row.done = True
        key = (*request.context, *row.tokens[:-1])
        keep = self.keep_prefixes and request.children > 0
        if keep and key in self._kept:  # an identical sample (greedy) kept it already
            self._kept[key].uses += request.children
        elif keep:  # keep the KV of context + tokens[:-1] for the branch's next request
            if mergeable(batch.cache):
                cols = batch.mask[j].bool().nonzero().squeeze(-1).to(self.device)
                # indexing by `cols` copies exactly the row's KV, which the kept prefix then owns
                layers = [(k[j : j + 1, :, cols], v[j : j + 1, :, cols]) for k, v in layers_of(batch.cache)]
                kept = adopt(self.model, layers)
            else:
                kept = fork_cache(batch.cache, [j])
            self._kept[key] = Kept(kept, request.children, request.group, cache_bytes(kept), row.chain)
            self._trim_kept()
        job.results[row.sample] = Completion(
            tuple(row.tokens), tuple(row.logprobs), "stop" if stopped else "length", job.version
        )
        if all(c is not None for c in job.results):
            del self._jobs[job.rid]
            completions = tuple(c for c in job.results if c is not None)
            finished.append(GenerationResult(job.rid, completions, job.cached))
