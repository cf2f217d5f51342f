"""Per-rank body of tests/models/test_context_exchange.py: shared-past attention with the past sharded over
a context group, against the same attention in one process, forward and backward.

Four gloo processes form two groups of 2 and one group of 4. Every rank builds the same inputs; it keeps
only the pieces its group rank owns (zigzag over position blocks, `ContextGroup`), the others on the `meta`
device. The output gradient is split over the group's ranks at random (the pieces sum to the true one),
so the check holds the engine to the linearity its exactness rests on. Errors are relative to the largest
reference value; rank 0 writes them as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from treetrain.models.context_exchange import ContextExchange, GroupMismatchError
from treetrain.models.shared_past import HeldPieces, ScoreForm, shared_attention
from treetrain.replay.context_shards import ContextGroup

CASES = {
    "gqa_f64": dict(dtype=torch.float64, form=ScoreForm(8**-0.5)),
    "gqa_f32": dict(dtype=torch.float32, form=ScoreForm(8**-0.5)),
    "window_f64": dict(dtype=torch.float64, form=ScoreForm(8**-0.5, window=9)),
    "softcap_f64": dict(dtype=torch.float64, form=ScoreForm(8**-0.5, softcap=5.0)),
    "sinks_f64": dict(dtype=torch.float64, form=ScoreForm(8**-0.5), sinks=True),
}
PIECES = (5, 7, 4, 6, 3, 5)
BLOCK = 4


class DropRemote(ContextExchange):
    """Negative control: each rank merges only its own pieces' state (the remote pieces left out)."""

    def gather_state(self, out: torch.Tensor, lse: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = super().gather_state(out, lse)
        return [parts[self.rank]]


class NoReduce(ContextExchange):
    """Negative control: a piece's G from this rank's share of the output gradient only (the remote share
    of G dropped)."""

    def all_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        super().all_reduce(grad)
        return grad.clone()


def _inputs(dtype: torch.dtype, sinks: bool) -> dict[str, object]:
    gen = torch.Generator().manual_seed(7)
    k_rows, heads, kv_heads, t, d = 2, 4, 2, 3, 8

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    past = [(rnd(1, kv_heads, p, d), rnd(1, kv_heads, p, d)) for p in PIECES]
    total = sum(PIECES)
    return dict(
        q=rnd(k_rows, heads, t, d),
        k=rnd(k_rows, kv_heads, t, d),
        v=rnd(k_rows, kv_heads, t, d),
        pos=torch.arange(total, total + t)[None].expand(k_rows, -1),
        past=past,
        d_out=rnd(k_rows, t, heads, d),
        sinks=rnd(heads) if sinks else None,
    )


def _run(
    case: dict,
    inputs: dict,
    exchange: ContextExchange | None,
    owner: ContextGroup | None,
    share: torch.Tensor,
):
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
    sinks = None if inputs["sinks"] is None else inputs["sinks"].clone().requires_grad_(True)
    past, grads, starts, at = [], [], [], 0
    for k, v in inputs["past"]:
        if owner is None or owner.owns(at):
            past.append((k, v))
            grads.append((torch.zeros_like(k), torch.zeros_like(v)))
            starts.append(at)
        at += k.shape[-2]
    out = shared_attention(
        leaves["q"], leaves["k"], leaves["v"], inputs["pos"], past, grads, case["form"], sinks=sinks,
        held=HeldPieces(tuple(starts), exchange),
    )  # fmt: skip
    (out * inputs["d_out"] * share).sum().backward()
    got = {n: t.grad for n, t in leaves.items()}
    if sinks is not None:
        got["sinks"] = sinks.grad
    return out.detach(), got, dict(zip(starts, grads))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def main(out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    four = dist.new_group(list(range(world)))
    results: dict[str, float] = {}
    for size, group, grank in ((2, pairs[rank // 2], rank % 2), (4, four, rank)):
        for name, case in CASES.items():
            inputs = _inputs(case["dtype"], bool(case.get("sinks")))
            ref_out, ref_grads, ref_g = _run(case, inputs, None, None, torch.tensor(1.0))
            gen = torch.Generator().manual_seed(11)
            noise = torch.randn(size, generator=gen, dtype=torch.float64)
            share = (1.0 / size + 0.3 * (noise - noise.mean()))[grank].to(case["dtype"])
            owner = ContextGroup(size, grank, BLOCK)
            for control, kind in (
                ("", ContextExchange),
                ("drop_remote", DropRemote),
                ("no_reduce", NoReduce),
            ):
                exchange = kind(size, grank, group)
                out, grads, held = _run(case, inputs, exchange, owner, share)
                key = f"C{size}/{name}" + (f"/{control}" if control else "")
                outs = [torch.empty_like(out) for _ in range(size)]
                dist.all_gather(outs, out, group=group)
                results[f"{key}/out"] = _err(out, ref_out)
                results[f"{key}/out_differs_across_ranks"] = float(any(not torch.equal(o, out) for o in outs))
                for n, g in grads.items():
                    summed = g.double().clone()
                    dist.all_reduce(summed, group=group)
                    results[f"{key}/d{n}"] = _err(summed, ref_grads[n])
                g_err = 0.0
                for start, (gk, gv) in held.items():
                    rk, rv = ref_g[start]
                    g_err = max(g_err, _err(gk, rk), _err(gv, rv))
                errs = [None] * size
                dist.all_gather_object(errs, g_err, group=group)
                results[f"{key}/G"] = max(errs)
                counts = exchange.counts
                results[f"{key}/bytes"] = float(counts.total_bytes)
        exchange = ContextExchange(size, grank, group)
        exchange.agree("the same", [3, 5])  # every rank alike: passes
        try:  # the last rank of each group a version behind: every rank of the group refuses
            exchange.agree("a version", [7 - (grank == size - 1)])
            results[f"C{size}/mismatch_caught"] = 0.0
        except GroupMismatchError as exc:
            one_line = "\n" not in str(exc) and "of the group holds a version" in str(exc)
            results[f"C{size}/mismatch_caught"] = 1.0 if one_line else 0.5
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {k: max(r[k] for r in gathered) for k in results}
        merged.update({k: min(r[k] for r in gathered) for k in results if k.endswith("mismatch_caught")})
        Path(out_dir, "results.json").write_text(json.dumps(merged, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    main(sys.argv[1])


CONTROLS: dict[str, type[ContextExchange]] = {"drop_remote": DropRemote, "no_reduce": NoReduce}
"""The negative controls' exchanges, by the name a scenario gives as its `control`."""
SCENARIOS: dict[str, dict[str, Any]] = {
    # name: family, contract, ZeRO stage, C, chunk size, K (tests/distributed/context_worker.py runs them)
    "llama_exact_z0_c2": dict(family="llama", contract="exact", stage=0, size=2, chunk=4, k=0),
    "llama_exact_z3_c4": dict(family="llama", contract="exact", stage=3, size=4, chunk=3, k=1),
    "llama_ro_z0_c2": dict(family="llama", contract="response_only", stage=0, size=2, chunk=5, k=2),
    "mla_exact_z0_c2": dict(family="deepseek_v3", contract="exact", stage=0, size=2, chunk=4, k=0),
    "mla_ro_z3_c4": dict(family="deepseek_v3", contract="response_only", stage=3, size=4, chunk=4, k=1),
    "window_exact_z3_c2": dict(family="mistral", contract="exact", stage=3, size=2, chunk=4, k=1),
    "window_ro_z0_c4": dict(family="mistral", contract="response_only", stage=0, size=4, chunk=6, k=0),
    "hybrid_exact_z0_c2": dict(family="qwen3_5_text", contract="exact", stage=0, size=2, chunk=4, k=0),
    "hybrid_ro_z3_c4": dict(family="qwen3_5_text", contract="response_only", stage=3, size=4, chunk=5, k=0),
    "zamba2_exact_z0_c2": dict(family="zamba2", contract="exact", stage=0, size=2, chunk=4, k=1),
    "falcon_h1_exact_z3_c2": dict(family="falcon_h1", contract="exact", stage=3, size=2, chunk=5, k=0),
    "kv_shared_exact_z0_c2": dict(family="gemma4_text", contract="exact", stage=0, size=2, chunk=4, k=0),
    "control_drop_remote": dict(family="llama", contract="exact", stage=0, size=2, chunk=4, k=0, control="drop_remote"),
    "control_no_reduce": dict(family="llama", contract="exact", stage=0, size=2, chunk=4, k=0, control="no_reduce"),
}  # fmt: skip
