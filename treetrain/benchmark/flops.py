"""The FLOP ceiling: each mode's token ceiling with attention priced in, so measured / ceiling means the
same thing at every geometry.

Why: the token ceiling (docs/design.md) charges every token evaluation the same, but a token at position i
also attends over i + 1 keys. Where the past is long and branches are short, that attention is most of the
work, and a mode can sit far below its token ceiling while doing exactly the work it must. Here each token
evaluation costs, per layer, its linear layers plus a score and a value product per key it attends to:

    forward FLOPs of a token at position i = linear + attention_per_key x (i + 1)

times the same multiplicity as the token ceiling (a forward 1, a forward and backward 3; `exact` runs
internal nodes 4 times, `response_only` runs context nodes once). Embeddings and the LM head are left out,
as in the token ceiling.

Example:
    >>> fm = FlopModel(linear_per_token=100.0, attention_per_key=1.0)
    >>> fm.forward(length=4, start=0)    # 4 x 100 + (1 + 2 + 3 + 4)
    410.0
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from treetrain.benchmark.bench_config import Mode
from treetrain.tree.stats import node_carries_loss
from treetrain.tree.trajectory_tree import ROOT, TrajectoryTree


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs of one token: per token (linear layers) and per key attended (scores and values)."""

    linear_per_token: float
    attention_per_key: float

    @staticmethod
    def of(model: PreTrainedModel) -> FlopModel:
        """2 x the decoder layers' parameters per token; 4 x query heads x head dim x layers per key."""
        config = model.config.get_text_config(decoder=True)
        base = getattr(model, "model", model)
        layers = list(getattr(base, "layers", []))
        linear = 2.0 * sum(p.numel() for layer in layers for p in layer.parameters())
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return FlopModel(linear, 4.0 * heads * head_dim * len(layers))

    def forward(self, length: int, start: int) -> float:
        """Forward FLOPs of `length` consecutive tokens whose first sits at position `start`."""
        keys = length * start + length * (length + 1) // 2
        return length * self.linear_per_token + keys * self.attention_per_key


def flop_ceiling(tree: TrajectoryTree, mode: Mode, fm: FlopModel) -> float:
    """The FLOPs `mode` must spend on `tree` at its token-ceiling multiplicities."""
    if mode == "flat":
        total = 0.0
        for record in tree.records:
            for call in record.calls:
                total += 3 * fm.forward(tree.nodes[call.end].end, 0)
        return total
    total = 0.0
    for node in tree.nodes:
        if node.index == ROOT or not node.tokens:
            continue
        exact = 4 if node.children else 3
        mult = exact if mode == "exact" else (3 if node_carries_loss(tree, node) else 1)
        total += mult * fm.forward(len(node.tokens), node.offset)
    return total
