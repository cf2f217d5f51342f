"""Is this model ready to train? Every check `treetrain train` makes before its first rollout, and no more.

A new model meets its refusals one by one when each is found at start: the environment's settings, the
chat template (no template, no end-of-turn marker, tools dropped, a call syntax no format reads), the
tokenizer against the model's vocabulary, the episode budget against the context, and the engine's
support probes (`treetrain.models.support.check_supported`). `check_model` runs them all, in the
trainer's own order and with the trainer's own functions, and either raises the first refusal (a
`ConfigError` or `UnsupportedModelError`, one line) or returns a `ModelCheck` that says what was found.
Nothing is written. `treetrain plan --model PATH` (with no tree files) prints it.

Example:
    >>> from treetrain.train.config import load_config
    >>> found = check_model(load_config(None, ["model.path=demo"]))
    >>> found.tool_format, found.vocab_model == found.vocab_tokenizer
    ('hermes', True)
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.train.config import TrainConfig


@dataclass(frozen=True)
class ModelCheck:
    """What `check_model` found, for a model every check accepted."""

    path: str
    architecture: str
    """The model class, e.g. `LlamaForCausalLM`."""
    model_type: str
    layers: int
    parameters: int
    trainable: int
    """Parameters that get a gradient: all of them, or the adapters with `model.lora`."""
    vocab_model: int
    """Rows of the embedding (`vocab_size`)."""
    vocab_tokenizer: int
    """Ids the tokenizer can produce (`len(tokenizer)`), never more than `vocab_model`."""
    context: int | None
    """`max_position_embeddings`, when the model gives one."""
    probe_length: int
    """The longest sequence the support probes were run for (a sliding window is probed across it)."""
    window: int | None
    """A sliding window shorter than `probe_length`, probed and accepted; None when there is none."""
    env: str
    tools: tuple[str, ...]
    """The tools of the environment's first task, which the template rendered and parsed back."""
    tool_format: str
    format_detected: bool
    """The format was detected from the template (`env.tool_format: auto`), not set by name."""
    end_of_turn: str

    def text(self) -> str:
        """The report `treetrain plan --model PATH` prints: one fact a line, then `accepted: ...`."""
        context = f"{self.context:,} tokens" if self.context is not None else "not given by the model"
        window = f"sliding window of {self.window:,} tokens, probed" if self.window else "no sliding window"
        trained = "all weights" if self.trainable == self.parameters else "LoRA adapters"
        tools = ", ".join(self.tools) or "none"
        how = "detected" if self.format_detected else "set by name"
        layers = f"{self.layers} layer" + ("" if self.layers == 1 else "s")
        return "\n".join(
            [
                f"model: {self.path} ({self.architecture}, model type {self.model_type!r}, {layers})",
                f"parameters: {self.parameters:,}, trained: {self.trainable:,} ({trained})",
                f"vocabulary: model {self.vocab_model:,} ids, tokenizer {self.vocab_tokenizer:,} ids",
                f"context: {context}; probes run for {self.probe_length:,} tokens, {window}",
                f"chat template: tool format {self.tool_format} ({how}), end of turn {self.end_of_turn!r}",
                f"tools of {self.env}: {tools} (calls and results render and parse back)",
                "accepted: splitting this model's sequences at any token is exact, so tree replay can train it",
            ]
        )


def check_model(cfg: TrainConfig) -> ModelCheck:
    """Run `treetrain train`'s start-up checks for `cfg` without training or writing anything."""
    from envs.registry import make_env
    from envs.template import ChatTemplate
    from treetrain.models.support import active_window, check_supported
    from treetrain.rollout.env_check import check_environment_config
    from treetrain.rollout.sources.engine_config import model_context
    from treetrain.rollout.sources.run_settings import task_seeds
    from treetrain.train.models import load_models
    from treetrain.train.preflight import check_context, check_first_prompt, check_template

    e = cfg.env
    check_environment_config(
        e.name, e.kwargs, e.rubric, task_seeds(cfg, 0)[0], cfg.rollout.episode.step_timeout_s
    )
    name, kwargs = cfg.env.name, dict(cfg.env.kwargs)
    make = lambda: make_env(name, **kwargs)  # noqa: E731
    models = load_models(cfg.model, lambda tok: check_template(cfg, tok, make))
    policy, tokenizer = models.policy, models.tokenizer
    config = policy.config.get_text_config(decoder=True)
    check_context(cfg, policy)
    check_first_prompt(cfg, tokenizer, policy, make)
    context = model_context(policy)
    length = cfg.rollout.episode.episode_tokens(context)  # the episodes' budget, as the rollouts resolve it
    check_supported(policy, length)
    e = cfg.env
    template = ChatTemplate(tokenizer, e.end_of_turn, e.tool_format, template_kwargs=dict(e.template_kwargs))
    env = make()
    env.reset(task_seeds(cfg, 0)[0])
    base = getattr(policy, "get_base_model", lambda: policy)()
    return ModelCheck(
        path=cfg.model.path,
        architecture=type(base).__name__,
        model_type=str(getattr(config, "model_type", "")),
        layers=int(getattr(config, "num_hidden_layers", 0) or 0),
        parameters=sum(p.numel() for p in policy.parameters()),
        trainable=sum(p.numel() for p in policy.parameters() if p.requires_grad),
        vocab_model=int(config.vocab_size),
        vocab_tokenizer=len(tokenizer),
        context=context,
        probe_length=length,
        window=active_window(policy, length),
        env=cfg.env.name,
        tools=tuple(t.name for t in env.tool_specs()),
        tool_format=template.format.name,
        format_detected=e.tool_format == "auto",
        end_of_turn=template.end_of_turn,
    )
