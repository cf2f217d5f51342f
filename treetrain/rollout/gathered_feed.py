"""The weight feed of an asynchronous `hf` run under ZeRO-3: one shadow, on rank 0, filled module by module.

An asynchronous `hf` run samples from a *shadow* of the policy that the trainer rewrites after each step
(`treetrain.rollout.weight_feed.WeightFeed`). Under ZeRO 0-2 every rank keeps one and samples its share of
the tasks. ZeRO-3 shards the weights so that no rank holds them whole, and one shadow per rank would undo
that. So under ZeRO-3 the run has **one** sampler, as on a fleet of servers: rank 0's `hf` process
samples every task, and the trees reach the other ranks through the update's gather.

- Rank 0 builds the shadow without ever gathering the model: `unsharded_twin` copies the module tree with
  each sharded parameter replaced by an empty tensor of its full shape (`ds_shape`). The shadow lives in
  the host's shared memory, never on the trainer's device, and the sampler process copies it at each sync
  into a model of its own, on the CPU: under ZeRO-3, sampling on accelerators is `vllm-server`'s job.
- A publish runs on **every** rank, on the training thread: each module's parameters are gathered
  (`deepspeed.zero.GatheredParameters`, a collective), rank 0 copies them into the shadow, and the gathered
  buffers are released before the next module's. At most one module is ever whole on a rank, as in the
  ZeRO-3 forward.

Example (an unsharded model takes the same path, with nothing to gather):
    >>> import torch
    >>> policy = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> feed = GatheredFeed(policy, version=0, holds=True)
    >>> with torch.no_grad():
    ...     _ = policy[0].weight.add_(1.0)
    >>> feed.publish(policy, version=1)
    >>> feed.due(0), bool(torch.equal(feed.shadow[0].weight, policy[0].weight))
    (True, True)
    >>> GatheredFeed(policy, version=0, holds=False).shadow is None  # a rank that only gathers
    True
"""

from __future__ import annotations

from typing import Any

import torch

from treetrain.rollout.engines.weight_buckets import full_shape, gathered
from treetrain.rollout.weight_feed import WeightFeed, private_copy, settle

ZERO3_MODULE_ATTRS = (
    "_external_params", "_original_parameters", "all_parameters", "applied_pre_backward_ref_cnt",
    "post_bwd_fn", "pre_bwd_fn",
)  # fmt: skip
"""What DeepSpeed 0.19's ZeRO-3 sets on each module it shards, besides its `ds_*` fields: bookkeeping of the
sharded parameters and autograd functions local to it, which the shadow must not carry (it pickles to the
sampler process, which never imports DeepSpeed)."""


def unsharded_twin(model: Any, device: str | torch.device = "cpu") -> Any:
    """A private copy of `model` on `device` whose parameters have their full shapes, holding garbage until
    a `gathered_copy` fills them. Nothing is gathered: each parameter of the copy is made empty at its full
    size, so a tied weight stays one tensor (`lm_head` and `embed_tokens`). Buffers are copied as they are
    (ZeRO-3 never shards them)."""
    memo: dict[int, Any] = {}
    made: dict[int, torch.nn.Parameter] = {}  # the meta stand-in's id -> the full-size parameter
    for p in model.parameters():
        stand_in = torch.empty(full_shape(p), dtype=p.dtype, device="meta")
        memo[id(p)] = stand_in
        made[id(stand_in)] = torch.nn.Parameter(torch.empty_like(stand_in, device=device), False)
    twin = private_copy(model, memo)
    for module in twin.modules():
        module._parameters = {n: None if p is None else made[id(p)] for n, p in module._parameters.items()}
        for attr in [a for a, value in vars(module).items() if _zero3_bookkeeping(a, value)]:
            delattr(module, attr)
    return twin.to(device)  # the buffers


def _zero3_bookkeeping(name: str, value: object) -> bool:
    """Whether a module attribute is ZeRO-3's: named in `ZERO3_MODULE_ATTRS`, a `ds_*` field, or an object of
    DeepSpeed's own classes. (Its `_parameters`, a DeepSpeed dict class, is rebuilt as a plain dict first.)"""
    return (
        name in ZERO3_MODULE_ATTRS or name.startswith("ds_") or type(value).__module__.startswith("deepspeed")
    )


@torch.no_grad()
def gathered_copy(into: Any, model: Any) -> None:
    """Copy `model`'s weights into `into` (an `unsharded_twin` of it), one module's parameters gathered at a
    time; every rank of a ZeRO-3 model runs it (the gathers are collectives), and a rank with `into` None
    only takes part in them."""
    targets = dict(into.named_parameters(remove_duplicate=False)) if into is not None else {}
    seen = set[int]()
    for prefix, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in own)
        with gathered([p for _, p in own]):
            if into is not None:
                for name, p in own:
                    targets[f"{prefix}.{name}" if prefix else name].copy_(p.data)
    if into is not None:
        buffers = dict(into.named_buffers())
        for name, theirs in model.named_buffers():  # never sharded
            buffers[name].copy_(theirs)


class GatheredFeed(WeightFeed):
    """A `WeightFeed` whose shadow is on the sampling rank only and is filled from gathered parameters; see
    the module docstring. `holds`: whether this rank keeps the shadow (rank 0, whose `hf` process samples);
    the others only run the gathers of each publish."""

    def __init__(self, model: Any, version: int, *, holds: bool) -> None:
        self.holds = holds
        super().__init__(model, version, shared=holds)

    def make_shadow(self, model: Any) -> Any:
        return unsharded_twin(model) if self.holds else None

    def publish(self, model: Any, version: int) -> None:
        """Gather `model`'s weights module by module into the shadow as `version` (training thread, every
        rank)."""
        with self._lock:
            gathered_copy(self.shadow, model)
            if self.shadow is not None:
                settle(self.shadow)
            self.version = version
