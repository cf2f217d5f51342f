"""Resident state: each unit's KV, computed once without a graph and kept for its descendants.

Every entry carries an identity (model version, adapter version, tokenizer fingerprint, dtype, attention
implementation, position scheme, adapters on or off). Reading an entry under a different identity, or after the store was
invalidated by an optimizer step, raises `StaleResidentStateError`: stale KV is never silently reused.

In `exact` mode an entry also accumulates G, the gradient of the loss with respect to its KV, which the
unit's own recompute later pushes through (docs/design.md, "The exact gradient through a tree"). G lives apart from
the KV tensors, so evicting and recomputing KV never loses accumulated gradient.

Example:
    >>> store = ResidentStore(identity)                               # doctest: +SKIP
    >>> store.put(key, kv); store.get(key, identity)                  # doctest: +SKIP
    >>> store.invalidate(identity.bumped()); store.get(key, ...)      # doctest: +SKIP
    Traceback (most recent call last):
    StaleResidentStateError: ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from treetrain.models.context_exchange import ContextExchange
from treetrain.models.layer_entry import LayerEntry, entry_bytes, entry_tensors, grad_zeros, map_entry
from treetrain.models.lora import adapter_state


class StaleResidentStateError(RuntimeError):
    """Resident state was read under an identity other than the one it was computed with."""


@dataclass(frozen=True)
class ResidentIdentity:
    """Everything a resident KV tensor depends on besides its tokens."""

    model_version: int
    adapter_version: int
    tokenizer: str
    dtype: str
    attn_implementation: str
    position_scheme: str
    adapters: str = "none"
    """LoRA adapters 'none', 'on' or 'off': KV computed with adapters off (the reference) is never policy KV."""

    @staticmethod
    def of(
        model: PreTrainedModel, *, version: int = 0, adapter_version: int = 0, tokenizer: str = ""
    ) -> ResidentIdentity:
        config = model.config.get_text_config(decoder=True)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = (
            rope.get("rope_theta", getattr(config, "rope_theta", None)) if isinstance(rope, dict) else None
        )
        rtype = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        param = next(model.parameters())
        return ResidentIdentity(
            model_version=version,
            adapter_version=adapter_version,
            tokenizer=tokenizer,
            dtype=str(param.dtype).removeprefix("torch."),
            attn_implementation=str(getattr(config, "_attn_implementation", "eager")),
            position_scheme=f"absolute/rope:{rtype}:theta={theta}",
            adapters=adapter_state(model),
        )

    def bumped(self) -> ResidentIdentity:
        """The identity after one optimizer step."""
        return replace(self, model_version=self.model_version + 1)


@dataclass(frozen=True)
class ResidentKey:
    """Which unit of which tree; `node_id` is the content address, for messages and digests."""

    tree_id: str
    unit: int
    node_id: str


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t, non_blocking=pin)
    return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.is_meta else t.to(device, non_blocking=True)  # meta: held on another rank, no storage


@dataclass
class _Entry:
    identity: ResidentIdentity
    kv: list[LayerEntry] | None
    grad: list[LayerEntry] | None = None
    host: list[LayerEntry] | None = None
    """KV moved to (pinned) host memory by `offload`, waiting for `restore`."""


class ResidentStore:
    """Resident KV and KV-gradient accumulators, keyed by unit, under one current identity.

    `on_change(kind, key, delta_bytes)` is called whenever resident bytes change; the ledger and the
    retention policy listen to it.
    """

    def __init__(
        self, identity: ResidentIdentity, on_change: Callable[[str, ResidentKey, int], None] | None = None
    ) -> None:
        self.identity = identity
        self._entries: dict[ResidentKey, _Entry] = {}
        self._retired: dict[ResidentKey, ResidentIdentity] = {}
        self._listeners: list[Callable[[str, ResidentKey, int], None]] = []
        if on_change is not None:
            self._listeners.append(on_change)
        self.kv_bytes = 0
        self.grad_bytes = 0
        self.exchange: ContextExchange | None = None
        """The context group's collectives when this rank shares trees' resident state with other ranks
        (`distributed.context_parallel`); set by the update window from its backend."""

    def add_listener(self, on_change: Callable[[str, ResidentKey, int], None]) -> None:
        """Also call `on_change(kind, key, delta_bytes)` on every change (a memory tracker, a ledger)."""
        self._listeners.append(on_change)

    def _notify(self, kind: str, key: ResidentKey, delta: int) -> None:
        if kind == "kv":
            self.kv_bytes += delta
        else:
            self.grad_bytes += delta
        for listener in self._listeners:
            listener(kind, key, delta)

    def _check(self, key: ResidentKey, identity: ResidentIdentity) -> _Entry | None:
        if identity != self.identity:
            raise StaleResidentStateError(
                f"resident read of node {key.node_id[:12]} (tree {key.tree_id[:12]}) under identity {identity} but "
                f"the store holds identity {self.identity}"
            )
        entry = self._entries.get(key)
        if entry is None and key in self._retired:
            old = self._retired[key]
            raise StaleResidentStateError(
                f"resident state of node {key.node_id[:12]} was computed at model version {old.model_version} and "
                f"invalidated by an optimizer step (now version {self.identity.model_version}); recompute it"
            )
        if entry is not None and entry.identity != identity:
            raise StaleResidentStateError(
                f"resident state of node {key.node_id[:12]} has identity {entry.identity}, read as {identity}"
            )
        return entry

    def has_kv(self, key: ResidentKey, identity: ResidentIdentity) -> bool:
        entry = self._check(key, identity)
        return entry is not None and entry.kv is not None

    def get(self, key: ResidentKey, identity: ResidentIdentity) -> list[LayerEntry]:
        entry = self._check(key, identity)
        if entry is None or entry.kv is None:
            raise KeyError(f"node {key.node_id[:12]} (unit {key.unit}) is not resident")
        return entry.kv

    def put(self, key: ResidentKey, kv: Sequence[LayerEntry], identity: ResidentIdentity) -> None:
        entry = self._check(key, identity)
        stored = [map_entry(torch.Tensor.detach, e) for e in kv]
        if entry is None:
            entry = _Entry(identity, None)
            self._entries[key] = entry
        if entry.kv is not None:
            self._notify("kv", key, -entry_bytes(entry.kv))
        entry.kv = stored
        self._notify("kv", key, entry_bytes(stored))

    def evict(self, key: ResidentKey) -> int:
        """Drop the KV (not the gradient accumulator); returns the bytes freed."""
        entry = self._entries.get(key)
        if entry is None or entry.kv is None:
            return 0
        freed = entry_bytes(entry.kv)
        entry.kv = None
        self._notify("kv", key, -freed)
        return freed

    def offload(self, key: ResidentKey) -> int:
        """Move the KV to host memory (pinned when a GPU is present); returns the device bytes freed.

        On a CPU-only machine host and device are the same memory, so this frees nothing there.
        """
        entry = self._entries.get(key)
        if entry is None or entry.kv is None:
            return 0
        pin = torch.cuda.is_available() and entry_tensors(entry.kv[0])[0].is_cuda
        entry.host = [map_entry(lambda t: _to_host(t, pin), e) for e in entry.kv]
        return self.evict(key)

    def has_host(self, key: ResidentKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.host is not None

    def restore(self, key: ResidentKey, identity: ResidentIdentity, device: torch.device) -> None:
        """Bring offloaded KV back to `device` (identity-checked like every read)."""
        entry = self._check(key, identity)
        if entry is None or entry.host is None:
            raise KeyError(f"node {key.node_id[:12]} (unit {key.unit}) has no offloaded KV")
        host, entry.host = entry.host, None
        self.put(key, [map_entry(lambda t: _to_device(t, device), e) for e in host], identity)

    def add_grad(self, key: ResidentKey, grads: Sequence[LayerEntry], identity: ResidentIdentity) -> None:
        entry = self._check(key, identity)
        if entry is None:
            entry = _Entry(identity, None)
            self._entries[key] = entry
        if entry.grad is None:
            entry.grad = [map_entry(lambda t: t.detach().clone(), g) for g in grads]
            self._notify("grad", key, entry_bytes(entry.grad))
        else:
            for acc, g in zip(entry.grad, grads):
                for a, t in zip(entry_tensors(acc), entry_tensors(g)):
                    a.add_(t)

    def grad_buffers(
        self, key: ResidentKey, like: Sequence[LayerEntry], identity: ResidentIdentity
    ) -> list[LayerEntry]:
        """The G accumulators of `key`, zero-filled shaped like `like` when absent; backward adds into them.
        Each has its entry's differentiable structure: a hybrid layer's G has a KV part and a state part, an
        indexed layer's the KV part only (`grad_zeros`)."""
        entry = self._check(key, identity)
        if entry is None:
            entry = _Entry(identity, None)
            self._entries[key] = entry
        if entry.grad is None:
            entry.grad = [grad_zeros(e) for e in like]
            self._notify("grad", key, entry_bytes(entry.grad))
        return entry.grad

    def grad(self, key: ResidentKey, identity: ResidentIdentity) -> list[LayerEntry] | None:
        entry = self._check(key, identity)
        return None if entry is None else entry.grad

    def release(self, key: ResidentKey) -> None:
        """Forget a unit entirely once nothing will read it again in this update window."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.kv is not None:
            self._notify("kv", key, -entry_bytes(entry.kv))
        if entry.grad is not None:
            self._notify("grad", key, -entry_bytes(entry.grad))

    def keys(self) -> tuple[ResidentKey, ...]:
        return tuple(self._entries)

    def invalidate(self, new_identity: ResidentIdentity) -> None:
        """Close the update window: every entry becomes stale; later reads of them raise."""
        retired = {key: entry.identity for key, entry in self._entries.items()}
        self.clear()
        self._retired = retired
        self.identity = new_identity

    def clear(self) -> None:
        """Release everything without retiring it (end of a tree within one window)."""
        for key in list(self._entries):
            self.release(key)

    def has_grad(self, key: ResidentKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.grad is not None

    def tensors_of(self, key: ResidentKey) -> list[torch.Tensor]:
        """The KV and G tensors held for `key` (empty if none)."""
        entry = self._entries.get(key)
        out: list[torch.Tensor] = []
        if entry is not None:
            for part in (entry.kv, entry.grad):
                if part is not None:
                    for e in part:
                        out.extend(t for t in entry_tensors(e) if not t.is_meta)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [t for key in self._entries for t in self.tensors_of(key)]
