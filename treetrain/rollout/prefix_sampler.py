"""Token-level sampling from a Hugging Face causal LM, with prefix KV reuse across branches.

`Sampler.sample(state, pending, n, max_new_tokens)` draws `n` continuations of one context. The context
is split into what is already encoded (`state`: a `DynamicCache` over its first tokens) and what is
not (`pending`). The pending tokens are encoded once, at batch size 1; the cache is then repeated `n`
times and the `n` rows are decoded together, with no padding because every row has the same length.
A row leaves the batch when it samples a stop token or reaches `max_new_tokens`. At that moment its KV
(context plus every sampled token but the last) is copied out as the `PrefixState` of that sample. The
next call for that branch then only encodes `[last sampled token] + observation tokens`. A shared
prefix is therefore encoded once, however many branches grow from it.

Logprobs are those of the distribution the token was *actually drawn from*: `log_softmax(logits /
temperature)` restricted to the top-p nucleus and renormalised. Greedy decoding (`temperature=0`) draws
from a point mass, so its logprobs are 0. A trainer that wants temperature-1 logprobs under the
current weights gets them from its own scoring pass.

`Sampling` (temperature, top-p) is also the trainer's `rollout.sampling` config section, as it is: its
defaults are the demo's and its field names are the config's keys (`--set rollout.sampling.top_p=0.9`).
`SamplerConfig` adds the seed of one sampler, which the trainer derives per task.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    >>> sampler = Sampler(model, SamplerConfig(Sampling(temperature=1.0), seed=0), stop_token_ids=(1,))
    >>> out = sampler.sample(None, (5, 6, 7), n=2, max_new_tokens=4)
    >>> len(out), all(len(s.tokens) == len(s.logprobs) <= 4 for s in out)
    (2, True)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from treetrain.rollout.sampling import Sampling


@dataclass(frozen=True)
class SamplerConfig:
    """How one sampler draws tokens: the sampling settings and the seed of its own generator."""

    sampling: Sampling = field(default_factory=Sampling)
    """Temperature and top-p."""
    seed: int = 0
    """Seed of the sampler's own torch.Generator (it never touches the global RNG)."""


@dataclass
class PrefixState:
    """The KV of the first `length` tokens of a context. `Sampler.sample` consumes it."""

    cache: Any
    length: int


@dataclass(frozen=True)
class Sample:
    """One sampled turn. `state` covers the context plus `tokens[:-1]` (None when not kept)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stopped: bool
    """True when the last token is a stop token; False when `max_new_tokens` cut the turn."""
    state: PrefixState | None = field(default=None, compare=False, repr=False)


@dataclass
class SamplerStats:
    """Work done so far, for tests and logs."""

    encoded_tokens: int = 0
    """Token positions run through the model, summed over batch rows."""
    forward_calls: int = 0
    sampled_tokens: int = 0


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep batch `rows` [R] of `cache`, in that order (a row may repeat), in place: KV layers select, and
    linear-attention / Mamba layers (conv and recurrent state, which have no `batch_select_indices`) reorder."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):  # a hybrid layer reorders its KV here too
            layer.reorder_cache(rows)  # type: ignore[arg-type]  # a long tensor
        elif hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(rows)


def fork_cache(cache: Any, rows: Sequence[int]) -> Any:
    """A new cache holding only batch `rows` of `cache`, sharing no tensor with it."""
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in twin.layers:  # state dictionaries would be shared by the shallow copy
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.conv_states, layer.recurrent_states = dict(layer.conv_states), dict(layer.recurrent_states)
    keys = next((layer.keys for layer in cache.layers if getattr(layer, "keys", None) is not None), None)
    select_rows(
        twin, torch.tensor(list(rows), dtype=torch.long, device=keys.device if keys is not None else "cpu")
    )
    return twin


def draw(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [R] drawn from `logits` [R, V] under `sampling`, and their logprobs [R] under the distribution
    actually sampled from (tempered, restricted to the top-p nucleus and renormalised; 0 when greedy)."""
    if sampling.greedy:
        return logits.argmax(dim=-1), torch.zeros(logits.shape[0], device=logits.device)
    logp = sampling_logprobs(logits, sampling)  # [R, V]
    tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)  # [R]
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def sampling_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logprobs [R, V] of the distribution tokens are drawn from: `logits` [R, V] tempered, restricted to
    the top-p nucleus and renormalised (not for greedy decoding, which draws from a point mass)."""
    scaled = logits / sampling.temperature  # [R, V]
    if sampling.top_p < 1.0:
        probs, order = scaled.softmax(dim=-1).sort(dim=-1, descending=True)
        outside = probs.cumsum(dim=-1) - probs > sampling.top_p  # mass before the token exceeds p
        scaled = scaled.scatter(-1, order, scaled.gather(-1, order).masked_fill(outside, -math.inf))
    return scaled.log_softmax(dim=-1)


class Sampler:
    """Samples turns from `model` (any HF causal LM taking `cache=`). A turn stops when it ends with one of
    `stop_token_ids`: token ids, or token-id sequences (a multi-token end-of-turn marker)."""

    def __init__(
        self, model: Any, config: SamplerConfig, stop_token_ids: Sequence[int | Sequence[int]]
    ) -> None:
        if not stop_token_ids:
            raise ValueError("Sampler needs at least one stop token id")
        self.model = model
        self.config = config
        seqs = [(int(s),) if isinstance(s, int) else tuple(int(t) for t in s) for s in stop_token_ids]
        if not all(seqs):
            raise ValueError("Sampler: a stop sequence is empty")
        self.stop_token_ids = frozenset(s[0] for s in seqs if len(s) == 1)
        self.stop_sequences = tuple(s for s in seqs if len(s) > 1)
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.stats = SamplerStats()

    def _stops(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.stop_token_ids:
            return True
        return any(len(tokens) >= len(s) and tuple(tokens[-len(s) :]) == s for s in self.stop_sequences)

    def _forward(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        self.stats.forward_calls += 1
        self.stats.encoded_tokens += ids.numel()
        return out.logits[:, -1, :].float()  # [R, V]

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return draw(logits, self.config.sampling, self.generator)

    @torch.no_grad()
    def sample(
        self,
        state: PrefixState | None,
        pending: Sequence[int],
        n: int,
        max_new_tokens: int,
        keep_state: bool = True,
    ) -> list[Sample]:
        """`n` continuations of the context whose KV is `state` (None: nothing encoded) + `pending`.

        `state` is consumed. With `keep_state`, each sample carries the `PrefixState` for its branch.
        """
        if not pending:
            raise ValueError("sample needs at least one pending token (the last context token)")
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {n}, {max_new_tokens}")
        cache = state.cache if state is not None else DynamicCache(config=self.model.config)
        length = (state.length if state is not None else 0) + len(pending)
        ids = torch.tensor([list(pending)], dtype=torch.long, device=self.device)  # [1, P]
        logits = self._forward(ids, cache).expand(n, -1)  # [n, V]
        if n > 1:  # every sample continues the one context row (KV layers and recurrent state alike)
            select_rows(cache, torch.zeros(n, dtype=torch.long, device=self.device))
        rows = list(range(n))  # sample index of each batch row
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        results: list[Sample | None] = [None] * n
        for step in range(max_new_tokens):
            tok, lp = self._draw(logits)
            self.stats.sampled_tokens += len(rows)
            done: list[int] = []
            for j, (r, t, x) in enumerate(zip(rows, tok.tolist(), lp.tolist())):
                tokens[r].append(t)
                logprobs[r].append(min(x, 0.0))
                if self._stops(tokens[r]) or step == max_new_tokens - 1:
                    done.append(j)
            live = [j for j in range(len(rows)) if j not in done]
            for j in done:
                r = rows[j]
                kept = None
                if keep_state:
                    kept = PrefixState(
                        cache if not live and len(done) == 1 else fork_cache(cache, [j]), length + step
                    )
                stopped = self._stops(tokens[r])
                results[r] = Sample(tuple(tokens[r]), tuple(logprobs[r]), stopped, kept)
            if not live:
                break
            if done:
                cache.batch_select_indices(torch.tensor(live, dtype=torch.long, device=self.device))
                rows, tok = [rows[j] for j in live], tok[live]
            logits = self._forward(tok[:, None], cache)
        assert all(s is not None for s in results)
        return [s for s in results if s is not None]
