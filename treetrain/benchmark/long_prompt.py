"""A prompt whose resident state one rank cannot hold: the checkpoint and the imported trees of the context
group's end-to-end tests and benchmark.

The model is a 4-layer Llama with 4 KV heads of 16 (2 KiB of KV per token, 4 KiB with `exact`'s G) and the
shipped tokenizer; the rollouts are one group of four trajectories under one prompt of `prompt_tokens`
random token ids, rewards 0 and 1 alternating, written as the JSONL `treetrain import` reads. At 8,000
prompt tokens the ledger's smallest one-rank peak is about 37 MiB and a rank of a context group of 2 needs
about 30 MiB, so a 32 MiB budget separates them (`treetrain plan ... --context-parallel 2`).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"


def write_long_model(out: Path, *, seed: int = 0, family: str = "llama") -> Path:
    """A random-init checkpoint directory with the shipped tokenizer and a context of 16,384 positions: the
    module docstring's Llama, or another family's tiny preset (`treetrain.models.presets`, its own sizes)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

    from treetrain.models.presets import EAGER_ONLY, tiny_model

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(seed)
    model: PreTrainedModel
    if family == "llama":
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=16384,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    else:
        model = tiny_model(family, len(tok), seed=seed, attn="eager" if family in EAGER_ONLY else "sdpa")
        model.config._experts_implementation = None  # as a checkpoint on disk: the loader chooses
    model.save_pretrained(out)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


def write_long_rollouts(path: Path, *, prompt_tokens: int, seed: int = 0) -> Path:
    """One group of four trajectories (6 to 9 response tokens) under one prompt, as import JSONL."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 250) for _ in range(prompt_tokens)]
    lines = []
    for i in range(4):
        response = [rng.randrange(3, 250) for _ in range(6 + i)]
        record = {"trajectory_id": f"t{i}", "group_id": "g0", "prompt_token_ids": prompt}
        lines.append(json.dumps({**record, "response_token_ids": response, "reward": float(i % 2)}))
    path.write_text("\n".join(lines) + "\n")
    return path
