"""The trainer's own model as an inference engine: continuous batching over every in-flight sample.

`HFEngine` serves `GenerationRequest`s with the Hugging Face model being trained. Every `poll` is one
decode step of *all* live rows together, whichever request, tree or task they belong to: the requests that
arrived since the last step are encoded together in one forward and join the batch, and finished rows leave
it. Rows of different lengths share one cache through padding, with a 2-D attention mask and explicit
position ids (as `generate` batches prompts), for every model whose cache is plain full-attention KV; other
caches (sliding windows, recurrent state) are batched per request instead, with no padding at all.

A request's context is encoded once, then repeated for its `n` rows. When a row finishes,
the KV of its context plus every sampled token but the last is kept, keyed by those token ids: the next
request whose context extends them (the branch's next turn, after the tool result) encodes only the new
tokens. That is the engine's prefix cache; `GenerationRequest.children` says how many requests will use a
kept prefix, and `release_group` drops what a finished tree left behind.

**Memory.** The `n` rows of a request each hold their own copy of the context's KV: transformers' caches
keep one dense `[rows, heads, length, dim]` tensor per layer and grow every row in place, so rows cannot
share a prefix (a stride-0 view would be copied by the first decode step). The engine bounds the bytes
instead: `max_kv_bytes` caps the KV it holds, live rows and kept prefixes together. A request waits
while the KV its rows and the live rows may reach (context plus turn budget, as wide as the widest row of
the padded batch, with the growth room a growing layer reserves: `_reserve`) would exceed the cap; kept
prefixes are dropped oldest first to make room, and one request always runs. `held_bytes` is what it
holds, counted from the tensors' actual storage (`cache_bytes`), and `peak_kv_bytes` the most it held
between decode steps. The reservation assumes plain attention KV (`token_kv_bytes`, from the config);
for recurrent state it is an estimate.

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

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from treetrain.rollout.engines.batch_cache import (
    adopt,
    cache_bytes,
    cache_of,
    layers_of,
    mask_left,
    mergeable,
    new_cache,
    pad_left,
    token_kv_bytes,
)
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
from treetrain.rollout.prefix_sampler import fork_cache, sampling_logprobs, select_rows
from treetrain.rollout.sampling import Sampling

MAX_ROWS = 64
"""Most live rows decoded together; a request waits while admitting it would exceed this (one always
fits). Finished rows awaiting compaction are not counted."""
MAX_KEPT = 512
"""Most kept prefixes; the least recently used go first."""
MAX_KV_BYTES = 1 << 30
"""Default cap on the KV bytes the engine holds (the trainer passes `rollout.hf_kv_budget`)."""


@dataclass
class _Kept:
    cache: Any  # batch size 1, no padding
    uses: int
    group: str
    nbytes: int = 0


@dataclass
class _Row:
    request: int
    sample: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False


@dataclass
class _Job:
    request: GenerationRequest
    rid: int
    stops: StopMatcher
    generator: torch.Generator
    results: list[Completion | None]
    version: int
    cached: int = 0


@dataclass
class _Batch:
    """Rows decoded together over one cache of `width` columns; `mask` says which columns hold each row's
    tokens (the rest is padding), `positions` is each row's next position (its token count)."""

    cache: Any
    rows: list[_Row]
    mask: torch.Tensor  # [R, W] long
    positions: torch.Tensor  # [R] long
    logits: torch.Tensor  # [R, V]

    @property
    def dead(self) -> int:
        return sum(r.done for r in self.rows)


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
    ) -> None:
        if isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, int) or max_kv_bytes < 1:
            raise EngineError(
                f"rollout.engine=hf: max_kv_bytes must be a positive integer, got {max_kv_bytes!r}"
            )
        self.model = model
        self.version = version
        self.stats = EngineStats()
        self.max_rows, self.max_kept, self.keep_prefixes = max_rows, max_kept, keep_prefixes
        self.max_kv_bytes = max_kv_bytes
        self.peak_kv_bytes = 0
        """The most KV bytes held at once since the engine was made."""
        self.device = next(model.parameters()).device
        self.merge = mergeable(new_cache(model))
        """Whether rows of different requests share one padded batch (plain full-attention caches)."""
        self._next_id = 0
        self._waiting: list[_Job] = []
        self._jobs: dict[int, _Job] = {}
        self._batches: list[_Batch] = []
        self._kept: OrderedDict[tuple[int, ...], _Kept] = OrderedDict()
        self._token_bytes: int | None = None

    # ----- GenerationEngine -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> int:
        rid = self._next_id
        self._next_id += 1
        generator = torch.Generator(device=self.device).manual_seed(request.seed)
        job = _Job(request, rid, StopMatcher.of(request.stop), generator, [None] * request.n, self.version)
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
        """KV bytes held now: every live batch's cache and every kept prefix (their actual storage)."""
        return sum(cache_bytes(b.cache) for b in self._batches) + self._kept_bytes()

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
        self.model = model
        self.version = version
        self._kept.clear()
        self.stats.weight_syncs += 1

    def release_group(self, group: str) -> None:
        """Drop the kept prefixes of `group` (its tree is finished)."""
        for key in [k for k, e in self._kept.items() if e.group == group]:
            del self._kept[key]

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
        jobs: list[_Job] = []
        while self._waiting:
            request = self._waiting[0].request
            need = self._reserve([*live, *(job.request for job in jobs), request])
            while need + self._kept_bytes() > self.max_kv_bytes and self._kept:  # oldest kept prefix first
                self._kept.popitem(last=False)
            idle = not live and not jobs
            if not idle and (rows + request.n > self.max_rows or need > self.max_kv_bytes):
                break
            jobs.append(self._waiting.pop(0))
            rows += request.n
        if not jobs:
            return
        if not self.merge:
            self._batches += [self._prefill([job]) for job in jobs]
            return
        new = self._prefill(jobs)
        into = self._batches.pop() if self._batches else None
        self._batches.append(new if into is None else self._join(into, new))

    def _reserve(self, requests: list[GenerationRequest]) -> int:
        """KV bytes `requests`' rows may hold at their longest, growth room included: a growing layer
        reserves up to twice its length, and rows in one padded batch are as wide as its widest."""
        if self._token_bytes is None:
            self._token_bytes = token_kv_bytes(self.model)
        spans = [max(r.prompt_tokens + r.max_new_tokens, 32) for r in requests]
        if self.merge:
            return 2 * self._token_bytes * sum(r.n for r in requests) * max(spans, default=0)
        return sum(2 * self._token_bytes * r.n * span for r, span in zip(requests, spans))

    def _kept_bytes(self) -> int:
        return sum(e.nbytes for e in self._kept.values())

    def _trim_kept(self) -> None:
        """Drop kept prefixes, oldest first, beyond `max_kept` or the bytes the live rows leave."""
        live = self._reserve(self._live())
        while self._kept and (
            len(self._kept) > self.max_kept or live + self._kept_bytes() > self.max_kv_bytes
        ):
            self._kept.popitem(last=False)

    def _lookup(self, context: tuple[int, ...]) -> tuple[int, Any]:
        """The longest kept prefix of `context` (leaving at least one token to encode), as a cache to use."""
        best, found = 0, None
        for key in self._kept:
            if best < len(key) < len(context) and context[: len(key)] == key:
                best, found = len(key), key
        if found is None:
            return 0, None
        entry = self._kept[found]
        entry.uses -= 1
        if entry.uses <= 0:
            del self._kept[found]
            return best, entry.cache
        self._kept.move_to_end(found)
        return best, fork_cache(entry.cache, [0])

    def _prefill(self, jobs: list[_Job]) -> _Batch:
        """Encode the uncached part of every job's context in one forward, then repeat each row `n` times.

        Row b is [padding | kept prefix b | padding | pending tokens b]: kept prefixes are left-padded to
        a common width, pending tokens right-aligned to a common length, so every row's last token is last.
        """
        kept = [self._lookup(job.request.context) for job in jobs]
        pending = [job.request.context[hit:] for job, (hit, _) in zip(jobs, kept)]
        for job, (hit, _) in zip(jobs, kept):
            job.cached = hit
            self.stats.cached_tokens += hit
        width = max(hit for hit, _ in kept)
        if len(jobs) == 1:
            cache = kept[0][1] if kept[0][1] is not None else new_cache(self.model)
        elif width == 0:
            cache = new_cache(self.model)
        else:
            ref = next(layers_of(c) for _, c in kept if c is not None)
            layers = []
            for i, (k0, v0) in enumerate(ref):
                ks = [pad_left(c.layers[i].keys, width) if c is not None else k0.new_zeros(1, k0.shape[1], width, k0.shape[3]) for _, c in kept]  # fmt: skip
                vs = [pad_left(c.layers[i].values, width) if c is not None else v0.new_zeros(1, v0.shape[1], width, v0.shape[3]) for _, c in kept]  # fmt: skip
                layers.append((torch.cat(ks), torch.cat(vs)))
            cache = cache_of(self.model, layers)
        hits = torch.tensor([hit for hit, _ in kept])  # [B]
        lengths = torch.tensor([len(p) for p in pending])  # [B]
        span = int(lengths.max())
        ids = torch.zeros(len(jobs), span, dtype=torch.long)  # [B, P]
        for b, p in enumerate(pending):
            ids[b, span - len(p) :] = torch.tensor(p)
        cols = torch.arange(width)[None, :]
        mask = torch.cat(
            [
                (cols >= width - hits[:, None]).long(),
                (torch.arange(span)[None, :] >= span - lengths[:, None]).long(),
            ],
            dim=1,
        )  # [B, width + P]
        kwargs: dict[str, Any] = {}
        if not bool(mask.all()):
            positions = (hits[:, None] + torch.arange(span)[None, :] - (span - lengths[:, None])).clamp(min=0)
            kwargs = {"attention_mask": mask.to(self.device), "position_ids": positions.to(self.device)}
        out = self.model(
            input_ids=ids.to(self.device), cache=cache, use_cache=True, logits_to_keep=1, **kwargs
        )
        self.stats.forward_calls += 1
        self.stats.encoded_tokens += int(lengths.sum())
        logits = out.logits[:, -1, :].float()  # [B, V]
        counts = torch.tensor([job.request.n for job in jobs])
        index = torch.repeat_interleave(torch.arange(len(jobs)), counts)  # [R]
        if len(index) > len(jobs):
            select_rows(cache, index.to(self.device))
        rows = [_Row(job.rid, i) for job in jobs for i in range(job.request.n)]
        return _Batch(cache, rows, mask[index], (hits + lengths)[index], logits[index])

    def _join(self, a: _Batch, b: _Batch) -> _Batch:
        width = max(a.mask.shape[1], b.mask.shape[1])
        layers = [
            (torch.cat([pad_left(ka, width), pad_left(kb, width)]), torch.cat([pad_left(va, width), pad_left(vb, width)]))
            for (ka, va), (kb, vb) in zip(layers_of(a.cache), layers_of(b.cache))
        ]  # fmt: skip
        return _Batch(
            cache_of(self.model, layers),
            a.rows + b.rows,
            torch.cat([mask_left(a.mask, width), mask_left(b.mask, width)]),
            torch.cat([a.positions, b.positions]),
            torch.cat([a.logits, b.logits]),
        )

    # ----- decoding ---------------------------------------------------------------------------------
    def _step(self, batch: _Batch, finished: list[GenerationResult]) -> None:
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
            keep = self._compact(batch)
            tokens = [tokens[j] for j in keep]
        fed = torch.tensor([0 if r.done else 1 for r in batch.rows])  # [R]
        batch.mask = torch.cat([batch.mask, fed[:, None]], dim=1)  # [R, W + 1]
        kwargs: dict[str, Any] = {}
        if not bool(batch.mask.all()):
            kwargs = {
                "attention_mask": batch.mask.to(self.device),
                "position_ids": batch.positions[:, None].to(self.device),  # [R, 1]
            }
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [R, 1]
        out = self.model(input_ids=ids, cache=batch.cache, use_cache=True, logits_to_keep=1, **kwargs)
        self.stats.forward_calls += 1
        self.stats.encoded_tokens += int(fed.sum())
        batch.logits = out.logits[:, -1, :].float()  # [R, V]
        batch.positions = batch.positions + fed

    def _draw(self, batch: _Batch, live: list[int]) -> list[tuple[int, float]]:
        """One token per live row: rows that share sampling settings are drawn together, each from its own
        request's generator (an inverse-CDF draw of one uniform per row), so a row's draw depends only on
        its request, never on what shares the batch."""
        out: dict[int, tuple[int, float]] = {}
        by_sampling: dict[Sampling, list[int]] = {}
        for j in live:
            by_sampling.setdefault(self._jobs[batch.rows[j].request].request.sampling, []).append(j)
        for sampling, rows in by_sampling.items():
            logits = batch.logits[rows]  # [R, V]
            if sampling.greedy:
                out.update((j, (int(t), 0.0)) for j, t in zip(rows, logits.argmax(dim=-1).tolist()))
                continue
            logp = sampling_logprobs(logits, sampling)  # [R, V]
            gens = [self._jobs[batch.rows[j].request].generator for j in rows]
            u = 1 - torch.cat(
                [torch.rand(1, generator=g, device=logits.device) for g in gens]
            )  # [R] in (0, 1]
            cdf = logp.exp().cumsum(dim=-1)  # [R, V]
            tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1)  # [R] never a 0-mass token
            tok = tok.clamp(max=logits.shape[-1] - 1)
            lp = logp.gather(-1, tok[:, None]).squeeze(-1)  # [R]
            out.update((j, (int(t), float(x))) for j, t, x in zip(rows, tok.tolist(), lp.tolist()))
        return [out[j] for j in live]

    def _finish(
        self, batch: _Batch, j: int, job: _Job, stopped: bool, finished: list[GenerationResult]
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
            self._kept[key] = _Kept(kept, request.children, request.group, cache_bytes(kept))
            self._trim_kept()
        job.results[row.sample] = Completion(
            tuple(row.tokens), tuple(row.logprobs), "stop" if stopped else "length", job.version
        )
        if all(c is not None for c in job.results):
            del self._jobs[job.rid]
            completions = tuple(c for c in job.results if c is not None)
            finished.append(GenerationResult(job.rid, completions, job.cached))

    def _compact(self, batch: _Batch) -> list[int]:
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
        dev = index.to(self.device)
        layers = [(k[dev, :, first:], v[dev, :, first:]) for k, v in layers_of(batch.cache)]
        batch.cache = cache_of(self.model, layers)
        return keep
