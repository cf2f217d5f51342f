"""The naive oracle for shared-past attention: the past concatenated, broadcast to the K rows and
head-expanded, exactly what the shared path avoids, so a test can compare against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _concatenated(q, k_own, v_own, positions, past, window, chunk=None):
    """Keys and values [K, H, P + T, D] expanded to every query head, and the mask [K, T, P + T]: causal,
    within the window, and within the query's chunk (Llama 4: key // chunk == query // chunk)."""
    rows, heads = q.shape[0], q.shape[1]
    group = heads // k_own.shape[1]
    keys = torch.cat([torch.cat([k for k, _ in past], -2).expand(rows, -1, -1, -1), k_own], -2)
    values = torch.cat([torch.cat([v for _, v in past], -2).expand(rows, -1, -1, -1), v_own], -2)
    kpos = torch.cat([torch.arange(sum(k.shape[-2] for k, _ in past)).expand(rows, -1), positions], -1)
    mask = kpos[:, None, :] <= positions[:, :, None]
    if window is not None:
        mask &= kpos[:, None, :] > positions[:, :, None] - window
    if chunk is not None:
        mask &= kpos[:, None, :] // chunk == positions[:, :, None] // chunk
    return keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), mask


def reference(q, k_own, v_own, positions, past, window, chunk=None):
    """Plain SDPA over the concatenated past; output [K, T, H, D]."""
    keys, values, mask = _concatenated(q, k_own, v_own, positions, past, window, chunk)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None]).transpose(1, 2)


def reference_with_sinks(q, k_own, v_own, positions, past, window, sinks):
    """gpt-oss's eager attention over the concatenated past: a sink column in every softmax."""
    keys, values, mask = _concatenated(q, k_own, v_own, positions, past, window)
    rows, _, t, d = q.shape
    scores = (q @ keys.transpose(-1, -2) * d**-0.5).masked_fill(~mask[:, None], float("-inf"))
    probs = torch.cat([scores, sinks[None, :, None, None].expand(rows, -1, t, 1)], -1).softmax(-1)[..., :-1]
    return (probs @ values).transpose(1, 2)


def reference_eager(q, k_own, v_own, positions, past, window, softcap=None):
    """Eager attention over the concatenated past, any value head size, with Gemma 2's score soft-capping."""
    keys, values, mask = _concatenated(q, k_own, v_own, positions, past, window)
    scores = q @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    return (probs @ values).transpose(1, 2)
