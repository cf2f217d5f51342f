"""What one weight sync costs with LoRA, adapter against merged, side by side in one run on real vLLM.

A LoRA policy reaches vLLM either as its adapter (`rollout.engines.adapter_sync`: a PEFT directory loaded
with `add_lora`, the base weights loaded once) or merged into full weights (`weight_buckets`, streamed into
vLLM's in-place reload). This script starts one vLLM engine of each kind on the same random Llama (heads of
64, the shipped tokenizer), moves the adapter by an optimizer-free perturbation before each sync, and reports
bytes and seconds per sync (the median of `--syncs`), the engine's own `EngineStats` counters.

    python bench/lora_sync.py [--hidden 512 --layers 8 --rank 8 --syncs 5] [--out bench/out/lora_sync.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from treetrain.assets import tokenizer_path
from treetrain.io import atomic_write_text
from treetrain.models.lora import apply_lora
from treetrain.models.lora_config import LoraSection
from treetrain.rollout.engines.adapter_sync import LoraServing, lora_serving
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.vllm_engine import VLLMEngine

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base(directory: Path, hidden: int, layers: int) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_path())
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)


def _measure(directory: Path, rank: int, syncs: int, serving: LoraServing) -> tuple[int, float, float]:
    """(bytes per sync, median seconds per sync, engine start seconds) for one way of serving LoRA."""
    policy: Any = apply_lora(LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32),
                             LoraSection(r=rank, alpha=2 * rank, target_modules=TARGETS))  # fmt: skip
    start = time.perf_counter()
    engine = VLLMEngine(str(directory), VLLMSettings(), dtype="float32", max_model_len=512, lora=serving)
    started = time.perf_counter() - start
    seconds, sizes = [], []
    try:
        for version in range(1, syncs + 1):
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if ".lora_B." in name:
                        p.add_(torch.randn_like(p) * 0.01)  # a new adapter each time, as after a step
            before_bytes, before_s = engine.stats.sync_bytes, engine.stats.sync_seconds
            engine.sync_weights(policy, version)
            sizes.append(engine.stats.sync_bytes - before_bytes)
            seconds.append(engine.stats.sync_seconds - before_s)
    finally:
        engine.close()
    return int(statistics.median(sizes)), statistics.median(seconds), started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/out/lora_sync.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _base(directory, args.hidden, args.layers)
        probe: Any = apply_lora(
            LlamaForCausalLM.from_pretrained(directory), LoraSection(r=args.rank, target_modules=TARGETS)
        )
        adapter = lora_serving(probe)
        assert adapter is not None and adapter.as_adapter
        params = sum(p.numel() for p in probe.parameters())
        rows = [("adapter", *_measure(directory, args.rank, args.syncs, adapter)),
                ("merged", *_measure(directory, args.rank, args.syncs, LoraServing(False, 0, "bench")))]  # fmt: skip
    lines = [
        f"LoRA weight sync into vLLM ({'CPU' if not torch.cuda.is_available() else 'GPU'}), Llama hidden "
        f"{args.hidden} x {args.layers} layers ({params / 1e6:.1f}M parameters with adapters, float32), "
        f"rank {args.rank} on {', '.join(TARGETS)}; median of {args.syncs} syncs",
        "",
        "| sync | bytes per sync | seconds per sync | engine start (s) |",
        "|---|---:|---:|---:|",
        *(f"| {kind} | {size:,} | {sec:.3f} | {up:.1f} |" for kind, size, sec, up in rows),
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
