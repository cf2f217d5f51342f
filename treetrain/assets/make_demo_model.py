"""Train the small checkpoint that `make demo` starts from, and write it to `treetrain/assets/demo_model/`.

The demo must show reinforcement learning working on two CPU cores in minutes, so the starting policy is
made on purpose: a tiny Llama first learns to call the `calculate` tool and copy its result (every
transcript uses the tool), then, for the last `final_fraction` of training, imitates transcripts in which the
assistant calls the tool only `tool_rate` of the time and otherwise guesses a wrong number. Its reward
therefore starts low, and RL has one main thing to discover: calling the tool pays.

A model this small learns to copy (the expression into the tool call, the tool's result into the answer) only
with a denser signal than transcripts give, so every batch also holds copy drills: short strings of
numbers and operators, repeated once, with loss on the repeat. Transcripts are tokenized by the same
`TokenEnv` wrapper that rollouts use, so the model sees exactly the token layout it will be trained on.

All transcripts share the long system prompt, so each batch evaluates that prefix once, without a graph, and
trains on the rest against its KV (the `response_only` idea, here for supervised imitation).

Run (about 25 minutes on two quiet cores; deterministic for a given seed):

    python -m treetrain.assets.make_demo_model
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from envs.calculator.arith import format_number
from envs.calculator.env import CalculatorEnv
from envs.toolcalls import format_tool_call
from envs.wrapper import EpisodeLimits, TokenEnv, WrapperConfig
from treetrain.assets import tokenizer_path
from treetrain.io import atomic_directory
from treetrain.models.decoder import decoder_forward
from treetrain.trajectory import Role

DEMO_DIR = Path(__file__).parent / "demo_model"
MIN_OPERANDS, MAX_OPERANDS = 2, 3


@dataclass(frozen=True)
class Example:
    ids: list[int]
    loss_mask: list[bool]


def transcript(seed: int, tokenizer: PreTrainedTokenizerBase, use_tool: bool, rng: random.Random) -> Example:
    env = CalculatorEnv(MIN_OPERANDS, MAX_OPERANDS)
    limits = EpisodeLimits(max_turns=8, max_turn_tokens=512, max_episode_tokens=8192)
    episode = TokenEnv(env, tokenizer, WrapperConfig(limits))
    episode.reset(seed)
    assert env.task is not None
    end = "<|im_end|>"
    if use_tool:
        call = format_tool_call("calculate", {"expression": env.task.expression}) + end
        episode.step(tokenizer.encode(call, add_special_tokens=False))
        answer = format_number(env.task.answer)
    else:
        answer = str(env.task.answer + rng.choice([-100, -10, -2, -1, 1, 2, 10, 100]))
    episode.step(tokenizer.encode(answer + end, add_special_tokens=False))
    traj = episode.trajectory(f"sft-{seed}", None, 0)
    ids: list[int] = []
    mask: list[bool] = []
    for seg in traj.calls[0].segments:
        ids.extend(seg.tokens)
        mask.extend([seg.role is Role.POLICY] * len(seg))
    return Example(ids, mask)


def demo_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=0,
    )


def copy_drill(tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> Example:
    """`a ; b ; c` then a newline and the same again; loss on the repeat."""
    parts = []
    for _ in range(rng.randint(1, 3)):
        expr = str(rng.randint(2, 99_999) if rng.random() < 0.3 else rng.randint(2, 99))
        for _ in range(rng.randint(0, 3)):
            expr = f"{expr} {rng.choice('+-*')} {rng.randint(2, 99)}"
        parts.append(expr)
    text = " ; ".join(parts)
    first = tokenizer.encode(text + "\n", add_special_tokens=False)
    second = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    return Example(first + second, [False] * len(first) + [True] * len(second))


def drill_loss(model: LlamaForCausalLM, drills: list[Example]) -> tuple[torch.Tensor, float]:
    """Cross-entropy on the repeats, and the teacher-forced accuracy of the copied tokens."""
    width = max(len(e.ids) for e in drills)
    ids = torch.zeros(len(drills), width, dtype=torch.long)
    labels = torch.full((len(drills), width), -100, dtype=torch.long)
    for b, e in enumerate(drills):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        for t in range(1, len(e.ids)):
            if e.loss_mask[t]:
                labels[b, t - 1] = e.ids[t]
    logits = model(input_ids=ids).logits  # [B, T, V]
    mask = labels != -100
    accuracy = float((logits.argmax(-1)[mask] == labels[mask]).float().mean())
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    ), accuracy


def common_prefix(examples: list[Example]) -> int:
    """Length of the token prefix every example shares and none trains on."""
    first = examples[0]
    n = min(len(e.ids) for e in examples)
    for i in range(n):
        if first.loss_mask[i] or any(e.ids[i] != first.ids[i] for e in examples):
            return i
    return n


def imitation_loss(model: LlamaForCausalLM, examples: list[Example]) -> torch.Tensor:
    """Mean cross-entropy over policy tokens; the shared prefix runs once, without a graph."""
    shared = max(1, common_prefix(examples) - 1)  # keep one prefix token so every suffix has a predictor
    with torch.no_grad():
        prefix = decoder_forward(
            model, torch.tensor([examples[0].ids[:shared]]), torch.arange(shared)[None], None
        )
    past = list(zip(prefix.keys, prefix.values))
    rows = [e.ids[shared:] for e in examples]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for b, e in enumerate(examples):
        ids[b, : len(rows[b])] = torch.tensor(rows[b])
        for t in range(shared + 1, len(e.ids)):
            if e.loss_mask[t]:
                labels[b, t - shared - 1] = e.ids[t]
    positions = (shared + torch.arange(width))[None].expand(len(rows), -1)
    hidden = decoder_forward(model, ids, positions, past).hidden  # [B, T, H]
    logits = model.lm_head(hidden)  # [B, T, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def train(
    steps: int, batch: int, lr: float, tool_rate: float, final_fraction: float, seed: int, out: Path
) -> None:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path())
    model = LlamaForCausalLM(demo_config(len(tokenizer)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    # Seeds >= 1_000_000 are held out: the demo trains on low seeds it has never imitated.
    next_seed = 1_000_000
    start = time.time()
    for step in range(steps):
        rate = tool_rate if step >= (1 - final_fraction) * steps else 1.0
        examples = []
        for _ in range(batch):
            examples.append(transcript(next_seed, tokenizer, rng.random() < rate, rng))
            next_seed += 1
        scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        drills = [copy_drill(tokenizer, rng) for _ in range(2 * batch)]
        copy_loss, copy_acc = drill_loss(model, drills)
        loss = imitation_loss(model, examples) + copy_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(
                f"step {step:5d}  loss {loss.item():.4f}  copy accuracy {copy_acc:.3f}  {time.time() - start:.0f}s",
                flush=True,
            )
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "demo_model.json").write_text(
            json.dumps(
                {
                    "steps": steps,
                    "batch": batch,
                    "lr": lr,
                    "tool_rate": tool_rate,
                    "final_fraction": final_fraction,
                    "seed": seed,
                },
                indent=2,
            )
        )
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--tool-rate", type=float, default=0.3, help="tool use in the final phase's transcripts"
    )
    parser.add_argument(
        "--final-fraction", type=float, default=0.25, help="share of steps in the final phase"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEMO_DIR)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny matrices: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train(args.steps, args.batch, args.lr, args.tool_rate, args.final_fraction, args.seed, args.out)


if __name__ == "__main__":
    main()
