"""Memory of LoRA against full fine-tuning of the same model, measured side by side on the same update.

Both runs replay the same synthetic tree (`exact`, KL on) and take one AdamW step in one process. Full
fine-tuning holds a frozen copy of the starting model as the KL reference; LoRA uses the same weights with
the adapters off. Measured: parameter bytes (policy and reference), gradient bytes after replay, optimizer
state (AdamW's two moments) after the step, and the replay's peak beyond parameters and optimizer state
(`MemoryTracker`; it includes the gradients). The
ledger's prediction of the persistent part (`model_persistent_bytes`) is printed next to the measurement.

    python bench/lora_memory.py                         # the demo checkpoint, LoRA r = 8
    python bench/lora_memory.py --model tiny-qwen3 --r 16 --prefix 1024
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

import torch

from treetrain.bytesize import format_bytes
from treetrain.distributed import TorchBackend
from treetrain.distributed.optim_config import OptimizerConfig
from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.persistent import PersistentBytes, model_persistent_bytes
from treetrain.memory.tracker import MemoryTracker
from treetrain.models.lora import AdaptersOff, LoraSection, apply_lora
from treetrain.models.presets import load_model
from treetrain.replay import TreeReplay
from treetrain.replay.batch import UpdateBatch
from treetrain.replay.replay_schedule import ReplayHooks
from treetrain.train.models import resolve_model_path
from treetrain.tree.synthetic import synthetic_group

LOSS = LossConfig(kl_coef=0.05)


@dataclass(frozen=True)
class Measured:
    params: int
    grads: int
    optimizer: int
    peak_dynamic: int
    predicted: PersistentBytes

    @property
    def total(self) -> int:
        """Parameters and optimizer state, plus the replay's peak (which includes the gradients)."""
        return self.params + self.optimizer + self.peak_dynamic


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(model_path: str, r: int | None, batch_args: dict[str, int], vocab: int | None) -> Measured:
    policy = load_model(resolve_model_path(model_path), vocab_size=vocab)
    if r is None:
        reference: object = copy.deepcopy(policy).requires_grad_(False)
    else:
        policy = apply_lora(policy, LoraSection(r=r))
        reference = AdaptersOff(policy)
    size = int(policy.config.get_text_config(decoder=True).vocab_size)
    trees = [synthetic_group(vocab=size, seed=0, **batch_args)]
    adv = compute_advantages(trees, AdvantageConfig(zero_variance="keep"))
    batch = UpdateBatch.build(trees, adv.trees, LOSS)
    backend = TorchBackend(policy, OptimizerConfig(lr=1e-5))
    tracker = MemoryTracker()
    engine = TreeReplay(policy, LOSS, ref_model=reference, hooks=ReplayHooks(tracker=tracker))  # type: ignore[arg-type]
    report = engine.accumulate(batch)
    grads = _bytes([p.grad for p in policy.parameters() if p.grad is not None])
    backend.optimizer.step()
    state = [s[k] for s in backend.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    owners = [policy] + ([reference] if isinstance(reference, torch.nn.Module) else [])
    params = _bytes([p for m in owners for p in m.parameters()])
    assert report.measured_peak is not None
    predicted = model_persistent_bytes(policy, ref_model=reference, optimizer=True)  # type: ignore[arg-type]
    return Measured(params, grads, _bytes(state), report.measured_peak.dynamic, predicted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--vocab", type=int, help="vocabulary of a tiny-<family> preset (default 512)")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    vocab = args.vocab or (512 if args.model.startswith("tiny-") else None)
    shape = {"prefix": args.prefix, "branches": args.branches, "suffix": args.suffix, "depth": 1}
    full = measure(args.model, None, shape, vocab)
    lora = measure(args.model, args.r, shape, vocab)
    print(f"model {args.model}, tree prefix {args.prefix} + {args.branches} x {args.suffix}, exact, KL on")
    print(f"| | full fine-tuning | LoRA r = {args.r} | LoRA / full |")
    print("|---|---|---|---|")
    for name, a, b in [
        ("parameters (policy + reference)", full.params, lora.params),
        ("gradients", full.grads, lora.grads),
        ("optimizer state (AdamW)", full.optimizer, lora.optimizer),
        (
            "replay peak beyond parameters and optimizer state (gradients included)",
            full.peak_dynamic,
            lora.peak_dynamic,
        ),
        ("parameters + optimizer state + replay peak", full.total, lora.total),
    ]:
        print(f"| {name} | {format_bytes(a)} | {format_bytes(b)} | {b / a:.3f} |")
    for name, m in (("full", full), ("lora", lora)):
        p = m.predicted
        ok = (p.params + p.reference, p.grads, p.optimizer) == (m.params, m.grads, m.optimizer)
        print(
            f"ledger persistent prediction, {name}: parameters + reference {format_bytes(p.params + p.reference)}, "
            f"gradients {format_bytes(p.grads)}, optimizer {format_bytes(p.optimizer)} "
            f"({'equals' if ok else 'DIFFERS FROM'} the measurement)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
