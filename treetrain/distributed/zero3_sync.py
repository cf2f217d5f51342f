"""ZeRO-3 with partitioned parameters while ranks run different work: every all-gather is a rendezvous.

Under ZeRO-3 DeepSpeed fetches a module's parameters in its forward (and backward) pre-hook with an
all-gather over the ranks, and releases them after the module ran. An all-gather is a collective: every
rank must issue it, with the same parameters, at the same point of its sequence of collectives. Ranks that
replay different trees run different forwards, so DeepSpeed's fetches would not match (a deadlock, or
worse, parameters mixed between tensors).

`FetchRendezvous` keeps DeepSpeed's own fetch/release hooks, its parameter coordinator and its
all-gather, and makes the ranks agree on every all-gather before it is issued:

- where DeepSpeed's coordinator is about to all-gather parameters that are not on this rank, the rank
  first takes part in a *round*: every rank posts what it needs (a list of parameter ids, or "nothing"),
  the lists are exchanged (one small all-gather of fixed size), and then every distinct list is
  all-gathered, in the same order on every rank, with DeepSpeed's own `all_gather_coalesced`;
- a rank that asked for a list keeps it (DeepSpeed's coordinator tracks it and releases it after the
  module, as always); every other rank takes part in the collective with its own partition and drops
  the result at once (a parameter it had gathered itself is left as it was);
- a rank with nothing left to run, or about to enter any other collective (the backend's `gather`,
  `barrier`, `step`), *drains*: it takes part in rounds, asking for nothing, until a round in which no
  rank asked for anything. Every rank sees the same table, so all of them leave the drain together.

Why it is correct: an all-gather's result depends only on the parameter list and on each rank's
partition, which is what it is whatever the rank is running; the table of a round is identical on every
rank, so every rank issues the same collectives in the same order; a rank gets back exactly the
parameters DeepSpeed's coordinator asked for. A rank holds its partition plus what its own modules have
in flight plus, for the duration of one collective, a list another rank asked for.

DeepSpeed's trace-based prefetch is not used inside the region: it needs the same module order every
step, which ranks replaying different trees (or one rank replaying different trees one after another) do
not have. The trace is kept invalid, so every fetch is on demand and every parameter is released right
after its module (`stage3_max_reuse_distance` does not apply either).

Example (inside `DeepSpeedBackend`, which owns one):
    >>> sync = FetchRendezvous(engine)          # doctest: +SKIP
    >>> sync.install(); ...; sync.drain(); sync.uninstall()   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

_GATHER = "_PartitionedParameterCoordinator__all_gather_params"
_INFLIGHT = "_PartitionedParameterCoordinator__inflight_param_registry"
_BACKWARD = "_PartitionedParameterCoordinator__active_backward_submodules"
IDLE = -1
"""A round's entry from a rank that needs nothing."""


class DirectReads:
    """The ZeRO-3 parameters a module reads in its own forward without calling their module, held gathered
    from the opening of an update window (or an uneven region) until it closes.

    A recurrent mixer (Gated DeltaNet, Mamba, Mamba-2, Kimi delta attention) passes `self.conv1d.weight`
    to its one-token step without calling `conv1d`, so DeepSpeed's fetch for `conv1d` never runs: the
    forward would read the empty partition, and its backward too. These weights are a few kilobytes per
    layer, so they are gathered once per window (a collective, at the window's collective start) and kept
    (`ds_persist`, which DeepSpeed's release honours); their gradients reduce as every other's. `release`
    partitions them again before the optimizer step and before DeepSpeed's own collectives.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.params: list[Any] = [
            p
            for parent in module.modules()
            for child in parent.children()
            if isinstance(child, torch.nn.Conv1d)
            for p in child.parameters(recurse=False)
        ]
        self.held = False

    def hold(self) -> None:
        if self.held or not self.params:
            return
        missing = [p for p in self.params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if missing:
            missing[0].all_gather(param_list=missing)
        for p in self.params:
            p.ds_persist = True
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        for p in self.params:
            p.ds_persist = False
        self.params[0].partition(param_list=self.params, has_been_updated=False)
        self.held = False


class FetchRendezvous:
    """Makes DeepSpeed's ZeRO-3 parameter all-gathers collective-safe under uneven work (see module)."""

    def __init__(self, engine: Any, *, measure: bool = False) -> None:
        offload = engine.optimizer.parameter_offload
        self.coordinator = offload.get_param_coordinator()
        if not callable(getattr(self.coordinator, _GATHER, None)) or not all(
            hasattr(self.coordinator, name) for name in (_INFLIGHT, _BACKWARD)
        ):
            raise RuntimeError(
                "this DeepSpeed version's ZeRO-3 parameter coordinator has no "
                f"{_GATHER.split('__')[-1]}; treetrain's ZeRO-3 window needs DeepSpeed 0.19"
            )
        self.params = {int(p.ds_id): p for p in engine.module.parameters()}
        self.capacity = len(self.params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = get_accelerator().current_device_name()
        self.measure = measure
        """Record `peak_param_bytes` (costs a pass over all parameters after every all-gather)."""
        self.active = False
        self.rounds = 0
        """Rounds this rank took part in (one per fetch that needed a collective, more while draining)."""
        self.served = 0
        """Lists this rank all-gathered for another rank and dropped."""
        self.peak_param_bytes = 0
        """Largest parameter storage on this rank (partitions plus gathered tensors) seen after an
        all-gather while installed; reset by `reset_peak`."""
        self._original: Callable[[Any, bool], None] | None = None
        self._release: Callable[..., None] | None = None

    # ----- installation -----------------------------------------------------------------------------
    def install(self) -> None:
        """Route DeepSpeed's all-gathers through rounds; idempotent."""
        if self.active:
            return
        coord = self.coordinator
        if not coord.is_invalid_trace():
            coord._invalidate_trace()
        self._original = getattr(coord, _GATHER)
        setattr(coord, _GATHER, self._all_gather)
        self._release = coord.release_sub_module
        coord.release_sub_module = self._release_sub_module
        # a top-level forward would move the trace to recording, whose end is a collective of its own
        coord.reset_step = lambda: None
        self.active = True
        self.note_bytes()

    def uninstall(self) -> None:
        """Back to DeepSpeed's own behaviour. Call `drain` first, on every rank."""
        if not self.active:
            return
        coord = self.coordinator
        del coord.__dict__[_GATHER]
        del coord.__dict__["release_sub_module"]
        del coord.__dict__["reset_step"]
        self.active = False

    # ----- rounds -----------------------------------------------------------------------------------
    def drain(self) -> None:
        """Take part in rounds, asking for nothing, until no rank asks for anything (a collective)."""
        if not self.active:
            return
        while self._round(None, None):
            pass

    def _all_gather(self, params: Iterable[Any], forward: bool) -> None:
        """DeepSpeed's coordinator calls this (in place of its own) to fetch or prefetch `params`."""
        assert self._original is not None
        params = set(params)
        needed = sorted(int(p.ds_id) for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        if not needed:
            self._original(params, forward)
            return
        self._round(needed, lambda: self._fetch_own(params, forward))

    def _release_sub_module(self, submodule: Any, forward: bool = False) -> None:
        """DeepSpeed's release, for a backward that reached a module's inputs but not its outputs.

        In `exact` mode the tree engine backpropagates <KV, G> from the cache: the gradient enters an
        attention module through its key/value projections, not through its output, so the module's
        post-backward hook fires without its pre-backward hook, which DeepSpeed asserts against.
        """
        assert self._release is not None
        active = getattr(self.coordinator, _BACKWARD)
        if not forward and not active:
            active[submodule.ds_id] = submodule  # popped again by the release
        self._release(submodule, forward)

    def _fetch_own(self, params: set[Any], forward: bool) -> None:
        assert self._original is not None
        pending = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        self._original(params, forward)
        registry = getattr(self.coordinator, _INFLIGHT)
        for p in pending:  # wait now: a later list of the same round may hold the same parameters
            registry[p].wait()

    def _round(self, needed: list[int] | None, fetch_own: Callable[[], None] | None) -> bool:
        """One round; True if any rank asked for something."""
        self.rounds += 1
        post = torch.full((self.capacity + 1,), IDLE, dtype=torch.int64)
        if needed is not None:
            post[0] = len(needed)
            post[1 : 1 + len(needed)] = torch.tensor(needed, dtype=torch.int64)
        post = post.to(self.device)
        table = [torch.empty_like(post) for _ in range(self.world_size)]
        dist.all_gather(table, post)
        lists: dict[tuple[int, ...], list[int]] = {}
        for rank, row in enumerate(t.cpu() for t in table):
            n = int(row[0])
            if n > 0:
                lists.setdefault(tuple(int(i) for i in row[1 : 1 + n]), []).append(rank)
        mine = tuple(needed) if needed is not None else None
        for ids, ranks in lists.items():
            if self.rank in ranks:
                if ids != mine or fetch_own is None:
                    raise RuntimeError(f"rank {self.rank}: the round's table lost this rank's request")
                fetch_own()
            else:
                self._serve(ids)
            self.note_bytes()
        return bool(lists)

    def _serve(self, ids: tuple[int, ...]) -> None:
        """All-gather another rank's list with DeepSpeed's collective, then put every parameter back."""
        self.served += 1
        params = [self.params[i] for i in ids]
        held = {}
        for p in params:
            if p.ds_status == ZeroParamStatus.INFLIGHT:
                raise RuntimeError(f"rank {self.rank}: parameter {p.ds_id} is in flight outside a fetch")
            if p.ds_status == ZeroParamStatus.AVAILABLE:
                held[p] = p.data
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        params[0].all_gather_coalesced(params).wait()
        self.note_bytes()
        for p in params:
            if p in held:
                p.data = held[p]
                p.ds_status = ZeroParamStatus.AVAILABLE
            else:
                p.partition()

    # ----- measurement ------------------------------------------------------------------------------
    def param_bytes(self) -> int:
        """Parameter storage on this rank now: every partition plus every gathered full tensor."""
        total = 0
        for p in self.params.values():
            total += p.data.numel() * p.element_size()
            if p.ds_tensor is not None:
                total += p.ds_tensor.numel() * p.ds_tensor.element_size()
        return total

    def note_bytes(self) -> None:
        if self.measure:
            self.peak_param_bytes = max(self.peak_param_bytes, self.param_bytes())

    def reset_peak(self) -> None:
        self.peak_param_bytes = self.param_bytes() if self.measure else 0
