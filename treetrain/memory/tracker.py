"""Measured memory by lifetime class: deterministic live-tensor bytes on CPU, the allocator's peak on CUDA.

`MemoryTracker` is a `TorchDispatchMode`. Every tensor an operator returns is looked up by its untyped
storage, so views and in-place results are never counted twice; a weak reference on the storage removes its
bytes the moment the last tensor using it dies. Totals are therefore exact and repeatable on CPU, where RSS
is neither (the allocator caches and the OS pages lazily).

Each live storage belongs to one lifetime class (docs/design.md, the ledger):

- `persistent`: attached model parameters (policy and reference) and optimizer state;
- `prompt_group`: tensors held by an attached `ResidentStore` (resident KV and, in `exact` mode, the KV
  gradient accumulators G);
- `boundary`: accumulated parameter gradients (`.grad`), which live from the first backward of an update
  window to the optimizer step;
- `temporary`: everything else: the live graph of the replayed branches, logits, recompute scratch.

A storage starts as `temporary` and is promoted when the store takes it or autograd accumulates it into a
`.grad`. The peak is recorded with its class breakdown, overall and per *segment* (`mark` starts one; the
engine marks scoring, reference scoring and every replay step).

On CUDA the totals are also read from the caching allocator (`torch.cuda.max_memory_allocated`), which
includes allocator rounding and anything created outside the mode; `cuda_peak` holds it.

Example:
    >>> import torch
    >>> with MemoryTracker() as mt:
    ...     a = torch.zeros(256)          # 1 KiB
    ...     b = a[:10]                    # a view: no new bytes
    ...     c = torch.ones(128) * 2       # the ones() temporary dies at once
    >>> mt.peak.temporary, mt.current.temporary
    (2048, 1536)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

from treetrain.lifetime import CLASSES, ClassBytes, LifetimeClass


class ObservableStore(Protocol):
    """What the tracker needs of a `ResidentStore`."""

    def tensors(self) -> list[torch.Tensor]: ...

    def tensors_of(self, key: Any) -> list[torch.Tensor]: ...

    def add_listener(self, on_change: Any) -> None: ...


@dataclass(frozen=True)
class MeasuredSegment:
    """One marked stretch of a run: live bytes when it began and at its own peak."""

    label: str
    start: ClassBytes
    peak: ClassBytes


class _Live:
    """Live storages and running per-class totals."""

    def __init__(self) -> None:
        self.cls: dict[int, LifetimeClass] = {}
        self.size: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.totals: dict[LifetimeClass, int] = dict.fromkeys(CLASSES, 0)
        self.maxima: dict[LifetimeClass, int] = dict.fromkeys(CLASSES, 0)
        self.total = 0

    def add(self, st: torch.UntypedStorage, cls: LifetimeClass, reclass: bool = True) -> bool:
        """Track `st` as `cls` (re-class it if tracked and `reclass`); True if the live total grew."""
        key = id(st)
        ref = self.refs.get(key)
        if ref is not None and ref() is st:
            old = self.cls[key]
            if reclass and old != cls:
                self.totals[old] -= self.size[key]
                self.totals[cls] += self.size[key]
                self.maxima[cls] = max(self.maxima[cls], self.totals[cls])
                self.cls[key] = cls
            return False
        nbytes = int(st.nbytes())
        self.refs[key] = weakref.ref(st, functools.partial(self._drop, key))
        self.cls[key] = cls
        self.size[key] = nbytes
        self.totals[cls] += nbytes
        self.maxima[cls] = max(self.maxima[cls], self.totals[cls])
        self.total += nbytes
        return nbytes > 0

    def _drop(self, key: int, _ref: object = None) -> None:
        cls = self.cls.pop(key, None)
        if cls is None:
            return
        size = self.size.pop(key)
        self.totals[cls] -= size
        self.total -= size
        self.refs.pop(key, None)

    def snapshot(self) -> ClassBytes:
        return ClassBytes(**self.totals)


class MemoryTracker(TorchDispatchMode):
    """Live tensor bytes by lifetime class while active (`with tracker: ...`); see the module docstring."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._live = _Live()
        self._peak = ClassBytes()
        self._segments: list[MeasuredSegment] = []
        self._seg_label: str | None = None
        self._seg_start = ClassBytes()
        self._seg_peak = ClassBytes()
        self._hooks: list[Any] = []
        self._cuda_peak = 0
        self._cuda_seg: list[int] = []
        self.active = False
        """True while the tracker is the active dispatch mode."""

    # ----- attaching owners ---------------------------------------------------------------------------
    def attach_model(self, model: torch.nn.Module, *, gradients: bool = True) -> None:
        """Count `model`'s parameters as persistent and, with `gradients`, its `.grad`s as boundary."""
        for p in model.parameters():
            self._claim([p], "persistent")
            if p.grad is not None:
                self._claim([p.grad], "boundary")
            if gradients and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def attach_store(self, store: ObservableStore) -> None:
        """Count whatever `store` holds, now and later, as prompt-group."""
        self._claim(store.tensors(), "prompt_group")
        store.add_listener(lambda kind, key, delta: self._on_store(store, key, delta))

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._claim([p.grad], "boundary")

    def _on_store(self, store: ObservableStore, key: Any, delta: int) -> None:
        if delta > 0:
            self._claim(store.tensors_of(key), "prompt_group")

    def _claim(self, tensors: Iterable[torch.Tensor], cls: LifetimeClass) -> None:
        grew = False
        for t in tensors:
            grew |= self._live.add(t.untyped_storage(), cls)
        if grew:
            self._observe()

    # ----- segments -----------------------------------------------------------------------------------
    def mark(self, label: str) -> None:
        """End the current segment and start one called `label`."""
        self._close_segment()
        self._seg_label = label
        self._seg_start = self._seg_peak = self._live.snapshot()
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(self.device)

    def _close_segment(self) -> None:
        if self._seg_label is not None:
            self._segments.append(MeasuredSegment(self._seg_label, self._seg_start, self._seg_peak))
            if self._cuda():
                self._cuda_seg.append(int(torch.cuda.max_memory_allocated(self.device)))
        self._seg_label = None

    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    # ----- results ------------------------------------------------------------------------------------
    @property
    def current(self) -> ClassBytes:
        return self._live.snapshot()

    @property
    def peak(self) -> ClassBytes:
        """Live bytes by class at the moment the total was highest."""
        return self._peak

    @property
    def class_maxima(self) -> ClassBytes:
        """Each class's own largest value (reached at different moments), since the tracker was made."""
        return ClassBytes(**self._live.maxima)

    @property
    def segments(self) -> tuple[MeasuredSegment, ...]:
        closed = list(self._segments)
        if self._seg_label is not None:
            closed.append(MeasuredSegment(self._seg_label, self._seg_start, self._seg_peak))
        return tuple(closed)

    @property
    def cuda_peak(self) -> int | None:
        """`torch.cuda.max_memory_allocated` over the tracked run (None off CUDA)."""
        if not self._cuda():
            return None
        return max([self._cuda_peak, int(torch.cuda.max_memory_allocated(self.device)), *self._cuda_seg])

    def reset_peak(self) -> None:
        """Restart the overall peak from the bytes live now (segments are kept)."""
        self._peak = self._live.snapshot()
        if self._cuda():
            self._cuda_peak = 0
            torch.cuda.reset_peak_memory_stats(self.device)

    # ----- dispatch -----------------------------------------------------------------------------------
    def _observe(self) -> None:
        total = self._live.total
        if total > self._peak.total or total > self._seg_peak.total:
            now = self._live.snapshot()
            if total > self._peak.total:
                self._peak = now
            if total > self._seg_peak.total:
                self._seg_peak = now

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        live = self._live
        grew = False
        if isinstance(out, torch.Tensor):
            if out.device.type != "meta":
                grew = live.add(out.untyped_storage(), "temporary", reclass=False)
        else:
            for t in tree_iter(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    grew |= live.add(t.untyped_storage(), "temporary", reclass=False)
        if grew:
            self._observe()
        return out

    def __enter__(self) -> MemoryTracker:
        if self._cuda():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        super().__enter__()
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.active = False
        self._close_segment()
        if self._cuda():
            self._cuda_peak = max(self._cuda_peak, int(torch.cuda.max_memory_allocated(self.device)))

    def detach(self) -> None:
        """Remove the gradient hooks this tracker installed."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
