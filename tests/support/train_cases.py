"""The tiny trainer run the training tests share: a tiny Llama preset on the calculator environment,
two groups of four, two short turns, and a learning rate high enough for the weights to move visibly."""

TINY = [
    "model.path=tiny-llama",
    "rollout.groups_per_update=2",
    "rollout.fanout.root=4",
    "rollout.episode.max_turns=2",
    "rollout.episode.max_turn_tokens=12",
    "optim.lr=0.01",
    "advantages.zero_variance=keep",
    "loss.entropy_coef=0.01",
    "checkpoint_every=1",
]
"""`--set` overrides for a run of seconds (the defaults are the demo, which takes minutes)."""


def train_in_process(run: object, settings: list[str]) -> int:
    """`treetrain train --run-dir RUN --no-progress --set ...` in this process; the exit code. The run sets
    torch's thread count (`threads`), so the caller's is put back."""
    import torch

    from treetrain.cli.main import main

    threads = torch.get_num_threads()
    try:
        return main(
            ["train", "--run-dir", str(run), "--no-progress", *(a for s in settings for a in ("--set", s))]
        )
    finally:
        torch.set_num_threads(threads)
