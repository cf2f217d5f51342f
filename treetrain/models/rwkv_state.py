"""RWKV's resident state: the `state` list its forward takes, filled from resident entries and read back.

Why: RWKV keeps no Cache. Its forward takes `state`, five `[B, H, L]` tensors (the feed-forward's last
input, the time mixing's last input, and the WKV numerator, denominator and running maximum, each for all
`L` layers), and its blocks read their slice and write the new one in place. Per layer that is a constant
size, like any recurrent layer's, so a unit keeps it as its entry: the two last inputs as the "conv
state" `[B, H, 2]` (time mixing, then feed-forward) and the WKV state as the recurrent state `[B, A, 3]`
in float32, as the model's own recurrence keeps it. Each row's state is taken before its last real token
(`treetrain.models.recurrent_state`), which a child unit feeds again:

- the WKV state by the captured recurrence (`treetrain.models.recurrent_kinds.WKV`), which the model writes
  into `state` itself;
- the last inputs by a pre-hook on each mixing module, which takes its input at the position before each
  row's cut (the resident one at cut 0).

A one-token forward takes another path in RWKV's own code, which reads the shift state as a view it then
overwrites in place (a saved tensor autograd would refuse); the engine appends one padding position, so
the sequence path runs, and drops it again. Padding after a row's last token changes nothing before it.

Example:
    >>> from treetrain.models.tiny_family import tiny_family_config
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_family_config("rwkv"))
    >>> sorted(argument_state_mixers(model))
    [0, 1]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from treetrain.models.recurrent_state import EngineCache, argument_state_mixers

__all__ = ["finish", "pad_one_token", "recording", "state_list"]

#: Per layer, the (time-mixing, feed-forward) inputs before each row's cut, `[B, H]` each, once recorded.
Shifts = dict[int, list[torch.Tensor | None]]
_MAX_INIT = -1e38  # the running maximum before any token, as `rwkv_linear_attention_cpu` starts it


def state_list(
    model: nn.Module, cache: EngineCache, rows: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """The model's `state` argument: five `[B, H, L]` tensors from the resident entries (zeros, and the
    starting maximum, at the root)."""
    layers = argument_state_mixers(model)
    shifts: list[list[torch.Tensor]] = [[], []]  # feed-forward, time mixing
    wkv: list[list[torch.Tensor]] = [[], [], []]
    for i in range(len(layers)):
        width = int(layers[i].config.hidden_size)
        att = int(layers[i].attention_hidden_size)
        conv = cache.get_conv_state(i)  # [B, H, 2] or None
        state = cache.get_recurrent_state(i)  # [B, A, 3] or None
        if conv is None or state is None:
            conv = torch.zeros(rows, width, 2, dtype=dtype, device=device)
            state = torch.zeros(rows, att, 3, dtype=torch.float32, device=device)
            state = torch.cat([state[..., :2], state[..., 2:] + _MAX_INIT], dim=-1)
        shifts[0].append(conv[..., 1].to(dtype))
        shifts[1].append(conv[..., 0].to(dtype))
        for k in range(3):
            wkv[k].append(state[..., k].float())
    return [torch.stack(parts, dim=-1) for parts in (*shifts, *wkv)]


def _shift_at_cut(cache: EngineCache, layer: int, which: int, hidden: torch.Tensor) -> torch.Tensor:
    """The mixing module's input before each row's cut (`[B, H]`): the resident one at cut 0."""
    resident = cache.get_conv_state(layer)
    first = (
        hidden.new_zeros(hidden[:, 0].shape) if resident is None else resident[..., which].to(hidden.dtype)
    )
    full = torch.cat([first[:, None], hidden], dim=1)  # [B, T + 1, H]
    assert cache.cut is not None
    return full[torch.arange(hidden.shape[0], device=hidden.device), cache.cut]


@contextmanager
def recording(model: nn.Module, cache: EngineCache) -> Iterator[Shifts]:
    """While the block lasts, each block's time-mixing and feed-forward inputs before the cut are recorded
    into the dict it yields; `finish` makes the entries from it."""
    shifts: Shifts = {}
    with ExitStack() as stack:
        for i, mixer in argument_state_mixers(model).items():
            block: Any = next(b for b in model.modules() if getattr(b, "attention", None) is mixer)
            shifts[i] = [None, None]
            for which, module in enumerate((mixer, block.feed_forward)):

                def hook(_m: nn.Module, args: tuple[Any, ...], i: int = i, which: int = which) -> None:
                    shifts[i][which] = _shift_at_cut(cache, i, which, args[0])

                stack.callback(module.register_forward_pre_hook(hook).remove)
        yield shifts


def finish(cache: EngineCache, shifts: Shifts, state: list[torch.Tensor]) -> None:
    """Each layer's entry before the cut: the recorded inputs and the WKV state the model wrote."""
    for i, (att, ffn) in shifts.items():
        if att is None or ffn is None:
            raise RuntimeError(f"RWKV layer {i} recorded no inputs in this forward")
        cache.captured[i][0] = torch.stack([att, ffn], dim=-1)  # [B, H, 2]
        cache.captured[i][1] = torch.stack([s[:, :, i] for s in state[2:]], dim=-1)  # [B, A, 3]


def pad_one_token(input_ids: torch.Tensor) -> torch.Tensor:
    """`[B, 1]` -> `[B, 2]` with a padding token after it (RWKV's sequence path; see the module doc)."""
    return torch.cat([input_ids, input_ids.new_zeros(input_ids.shape)], dim=1)
