"""`treetrain train` configuration: typed sections, loaded from TOML or YAML, overridable on the command line.

The defaults *are* the embedded demo: the shipped checkpoint on the calculator environment, sized to finish in
minutes on two CPU cores. Every field is validated when the file is loaded, before any work starts, and an
error names the field (`rollout.fanout.root: must be in [1, 4096], got 0`).

Example:
    >>> cfg = load_config(None, ["updates=3", "loss.kl_coef=0.05", "model.reference=initial"])
    >>> cfg.updates, cfg.loss.kl_coef, cfg.model.path
    (3, 0.05, 'demo')
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import yaml

from treetrain.distributed.optim_config import OptimizerConfig
from treetrain.errors import ConfigError
from treetrain.io import path_problem
from treetrain.loss.advantages import AdvantageConfig
from treetrain.loss.loss_config import LossConfig
from treetrain.models.lora_config import LoraSection
from treetrain.rollout.rollout_section import RolloutSection
from treetrain.train.config_file import read_config_file
from treetrain.train.device import check_device_name
from treetrain.train.typed import apply_override, from_dict, to_dict
from treetrain.update.settings import ReplaySection

DTYPES = ("float32", "bfloat16", "float16", "float64")
SEED_LIMIT = 2**32
"""Seeds are in [0, 2^32): numpy's range, and task seeds derived from them stay within 64 bits."""
MAX_THREADS = 4096


@dataclass(frozen=True)
class ModelSection:
    """The policy (and reference) model."""

    path: str = "demo"
    """'demo' (the shipped checkpoint), 'demo-wide' (the same policy with head sizes every rollout engine
    serves), a local Hugging Face directory, or a preset 'tiny-<family>'."""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    """Parameter dtype of the policy."""
    attn: Literal["eager", "sdpa"] = "sdpa"
    """Attention implementation."""
    reference: str | None = None
    """Reference model for the KL term: 'initial' (a frozen copy of the starting policy), a path, 'base'
    (with `lora`: the policy itself with its adapters off, no second copy of the weights), or None."""
    tokenizer: str | None = None
    """Tokenizer directory; None uses the model directory's, or the shipped tokenizer for presets."""
    lora: LoraSection | None = None
    """LoRA adapters (PEFT) on the policy; null trains every weight. `--set model.lora.r=8` turns them on."""

    def __post_init__(self) -> None:
        if self.lora is not None and self.lora.init in ("pissa", "olora") and self.dtype == "float64":
            raise ConfigError(
                f"model.lora.init: PEFT's {self.lora.init!r} decomposition runs in float32, float16 or bfloat16, "
                "not model.dtype float64"
            )
        if self.reference == "base" and self.lora is None:
            raise ConfigError(
                "model.reference: 'base' (the policy with adapters off) needs model.lora; use 'initial' or a path"
            )


@dataclass(frozen=True)
class EnvSection:
    """Where trajectories come from."""

    name: str = "calculator"
    """A built-in environment, a `treetrain.envs` entry point, or 'module:Class'."""
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Keyword arguments for the environment's constructor (empty: its defaults)."""
    rubric: str | None = None
    """Which of the environment's rubrics gives the reward (None: its first)."""
    max_tool_result_chars: int = 8000
    """Longest tool result shown to the agent, in characters; longer ones are cut with a truncation marker."""
    tool_format: str = "auto"
    """How the model writes tool calls: 'hermes', 'qwen3_coder', 'glm45', 'llama3', 'mistral',
    'deepseek_v3', or 'auto' (detected from the tokenizer's chat template)."""
    end_of_turn: str | None = None
    """Text that ends an assistant turn, any number of tokens (null: taken from the chat template; the
    tokenizer's EOS and the model's generation_config EOS ids also end a turn)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Extra variables for the chat template, as `apply_chat_template(**template_kwargs)` takes them, e.g.
    `{enable_thinking: false}` for Qwen3 and GLM (empty: the template's defaults)."""

    def __post_init__(self) -> None:
        from envs.formats import FORMATS
        from envs.template_text import template_kwargs_problem

        if self.max_tool_result_chars < 1:
            raise ConfigError(f"env.max_tool_result_chars: must be >= 1, got {self.max_tool_result_chars}")
        if self.tool_format != "auto" and self.tool_format not in FORMATS:
            raise ConfigError(
                f"env.tool_format: must be 'auto' or one of {sorted(FORMATS)}, got {self.tool_format!r}"
            )
        if self.end_of_turn is not None and not self.end_of_turn:
            raise ConfigError("env.end_of_turn: must be non-empty text or null")
        problem = template_kwargs_problem(self.template_kwargs)
        if problem:
            raise ConfigError(f"env.template_kwargs: {problem}")
        try:  # the environment is built in a worker process from these, sent as JSON
            json.dumps(dict(self.kwargs), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"env.kwargs: must be JSON values (text, numbers, lists, maps): {exc}"
            ) from None


MAX_EVAL_TASKS = 1 << 16
"""Most held-out tasks one evaluation samples (a tree is held for each)."""
MAX_EVAL_SAMPLES = 4096
"""Most samples per evaluation task (the fan-out of its root: `treetrain.rollout.fanout.FACTOR_LIMIT`)."""


@dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation during training (docs/evaluation.md): the dataset environment's held-out rows, or
    task seeds training never draws for any other environment."""

    every: int = 0
    """Evaluate after every N-th update, after the last, and once before the first (0: never)."""
    tasks: int = 16
    """Held-out tasks per evaluation (a dataset's held-out split may have fewer: then all of them)."""
    samples: int = 1
    """Samples per task: k of pass@k (pass@1 and the mean reward average over every sample)."""
    greedy: bool = True
    """Greedy decoding (temperature 0); false samples at `rollout.sampling` (needed for samples > 1)."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this (1.0: full marks of a 0/1 rubric)."""

    def __post_init__(self) -> None:
        for name, most in (("every", None), ("tasks", MAX_EVAL_TASKS), ("samples", MAX_EVAL_SAMPLES)):
            value = getattr(self, name)
            low = 0 if name == "every" else 1
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < low
                or (most and value > most)
            ):
                bound = f"in [{low}, {most}]" if most else f">= {low}"
                raise ConfigError(f"eval.{name}: must be an integer {bound}, got {value!r:.40}")
        if self.greedy and self.samples > 1:
            raise ConfigError(
                f"eval.samples: {self.samples} greedy samples of a task are all the same; set eval.greedy=false "
                "to sample at rollout.sampling, or eval.samples=1"
            )
        if not math.isfinite(self.pass_threshold):
            raise ConfigError(f"eval.pass_threshold: must be a finite number, got {self.pass_threshold}")


@dataclass(frozen=True)
class DistributedSection:
    """How the update runs across processes."""

    backend: Literal["torch", "deepspeed"] = "torch"
    """'torch': one process, plain AdamW. 'deepspeed': a DeepSpeed engine (launch with deepspeed or torchrun)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage for the generated DeepSpeed config. A float64 model runs at 0 only, where treetrain reduces
    the gradients itself (DeepSpeed reduces them in float32 at 1 and 2 and refuses them at 3)."""
    offload_optimizer: bool = False
    """Keep optimizer state on the CPU (DeepSpeed)."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON passed through as is (overrides zero_stage and offload_optimizer)."""
    context_parallel: int = 1
    """C, the ranks of a context group: they hold each tree's resident state between them, each unit's KV
    on one of them, for prompts whose state does not fit one device (1: every rank holds its own). Must
    divide the number of ranks; needs the deepspeed backend. The world is data-parallel groups x C."""

    def __post_init__(self) -> None:
        c = self.context_parallel
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 4096:
            raise ConfigError(f"distributed.context_parallel: must be an integer in [1, 4096], got {c!r:.40}")
        if c > 1 and self.backend != "deepspeed":
            raise ConfigError(
                f"distributed.context_parallel: {c} ranks per context group need distributed.backend: deepspeed "
                "(the torch backend runs one process)"
            )


@dataclass(frozen=True)
class TrainConfig:
    """Everything `treetrain train` needs. The defaults are the demo."""

    run_dir: str = "runs/demo"
    """Where trees, metrics, checkpoints and the final model go (a config file that leaves it out:
    `runs/<file stem>`)."""
    seed: int = 0
    """Seeds task selection, sampling and any shuffles."""
    updates: int = 60
    """Optimizer steps to run."""
    mode: Literal["auto", "tree", "flat"] = "auto"
    """'auto' lets the planner choose tree or flat replay per update; 'tree' or 'flat' forces it."""
    memory_budget: str | None = None
    """Memory the planner may plan for on each process, e.g. '8GiB' (null: the device's memory)."""
    measure_memory_every: int = 10
    """Measure the live-byte peak of every N-th update's replay against the ledger (0: never; it slows replay)."""
    checkpoint_every: int = 20
    """Save a resumable checkpoint every this many updates (0: not by count; one is always saved at the end)."""
    checkpoint_every_s: float = 600.0
    """Also save one when this many seconds have passed since the last (0: not by time), so a run killed
    early loses at most this much work."""
    threads: int | None = None
    """torch intra-op threads (None: leave torch's default); the rollout's sampler process of an asynchronous
    run runs as many (None: 1)."""
    device: str = "auto"
    """Where one process trains and evaluates: 'auto' (the GPU when torch sees one, else the CPU), 'cpu',
    'cuda' (the launcher's LOCAL_RANK-th GPU) or 'cuda:N'. Under distributed.backend=deepspeed it stays
    'auto': DeepSpeed places each rank's model on its launcher's device."""
    model: ModelSection = field(default_factory=ModelSection)
    """The policy, the reference model and the tokenizer."""
    env: EnvSection = field(default_factory=EnvSection)
    """The environment rollouts run in, and its rubric."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Tree-shaped sampling (or recorded trees)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """PPO-clip / GRPO objective, KL, entropy and aggregation (treetrain.loss.loss_config.LossConfig)."""
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    """GRPO or tree-aware advantages, and zero-variance groups (treetrain.loss.advantages.AdvantageConfig)."""
    replay: ReplaySection = field(default_factory=ReplaySection)
    """Contract and the replay choices the planner may make."""
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer (the demo's learning rate: RL moves a trained policy, far below pre-training rates)."""
    lr_warmup_updates: int = 0
    """Linear learning-rate warm-up over this many updates."""
    distributed: DistributedSection = field(default_factory=DistributedSection)
    """One process (torch) or DeepSpeed ZeRO across processes."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Held-out evaluation during training: how often, how many tasks and samples (docs/evaluation.md)."""

    def __post_init__(self) -> None:
        if not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(f"seed: must be in [0, 2^32), got {self.seed}")
        if self.updates < 1:
            raise ConfigError(f"updates: must be >= 1, got {self.updates}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every: must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every_s < 0:
            raise ConfigError(f"checkpoint_every_s: must be >= 0, got {self.checkpoint_every_s}")
        if self.lr_warmup_updates < 0:
            raise ConfigError(f"lr_warmup_updates: must be >= 0, got {self.lr_warmup_updates}")
        if self.measure_memory_every < 0:
            raise ConfigError(f"measure_memory_every: must be >= 0, got {self.measure_memory_every}")
        check_device_name(self.device)
        if self.device != "auto" and self.distributed.backend == "deepspeed":
            raise ConfigError(
                f"device: {self.device!r} with distributed.backend=deepspeed, whose engine places each rank's "
                "model on its launcher's device (DS_ACCELERATOR=cpu for the CPU); leave device: auto"
            )
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise ConfigError(f"threads: must be in [1, {MAX_THREADS}] or null, got {self.threads}")
        self._check_sampler_logprobs_are_the_policys()
        if self.loss.needs_reference and self.model.reference is None:
            free = "'base': the policy with adapters off" if self.model.lora is not None else "'initial'"
            raise ConfigError(f"model.reference: loss.kl_coef > 0 needs a reference model (e.g. {free})")
        if self.rollout.max_staleness and self.rollout.trees is not None:
            raise ConfigError(
                "rollout.max_staleness: recorded trees (rollout.trees) are consumed as they are, with no "
                "sampler to run ahead of the trainer; set rollout.max_staleness=0"
            )
        if self.distributed.backend == "deepspeed" and self.distributed.zero_stage == 3:
            self.rollout.check_sharded_weights()
        self._check_float64_reduces()
        if self.eval.every and self.rollout.trees is not None:
            raise ConfigError(
                "eval.every: evaluation samples the policy on env.name's held-out tasks, and a run on recorded "
                "trees (rollout.trees) has no rollout engine; set eval.every=0 and use `treetrain eval` on final/"
            )
        if self.memory_budget is not None:
            from treetrain.bytesize import parse_bytes

            try:
                parse_bytes(self.memory_budget)
            except ValueError as exc:
                raise ConfigError(f"memory_budget: {exc}") from exc

    @property
    def policy_loss(self) -> LossConfig:
        """`loss` as the engines take it: a null `loss.temperature` resolved to the sampling temperature, so
        the loss scores the distribution the rollouts were drawn from."""
        return self.loss.at_temperature(self.rollout.sampling.temperature)

    def _check_float64_reduces(self) -> None:
        """A float64 model under DeepSpeed runs at ZeRO 0 only (`FLOAT64_STAGES`); a DeepSpeed JSON's stage
        is checked when the engine is built."""
        dist = self.distributed
        if self.model.dtype != "float64" or dist.backend != "deepspeed" or dist.deepspeed_config is not None:
            return
        if dist.zero_stage != 0:
            from treetrain.distributed.deepspeed_config import FLOAT64_STAGES

            raise ConfigError(
                f"distributed.zero_stage: {dist.zero_stage} with model.dtype float64: {FLOAT64_STAGES}"
            )

    def _check_sampler_logprobs_are_the_policys(self) -> None:
        """`ratio_source='sampler'` and a sampler correction compare the sampler's logprobs with the policy's,
        so both must be of one distribution. The engines record the tempered, top-p renormalised one; the
        loss scores softmax(logits / T) at its temperature (`policy_loss`). A temperature other than the
        sampling one is refused, and so is top_p below 1: a nucleus is cut at a threshold on the
        probabilities, so it has no gradient, and after any step a token at its edge can leave it (logprob
        -inf); TRL and verl, too, score the tempered distribution without the nucleus."""
        loss, sampling = self.loss, self.rollout.sampling
        if loss.ratio_source == "sampler":
            field, what = "loss.ratio_source", "'sampler' takes the PPO ratio's old logprobs from the sampler"
            fix = "ratio_source='scoring'"
        elif loss.corrects_sampler:
            field = "loss.sampler_correction"
            what = f"{loss.sampler_correction!r} weighs tokens by the sampler's logprobs"
            fix = "sampler_correction='none'"
        else:
            return
        if sampling.top_p < 1:
            raise ConfigError(
                f"{field}: {what}, which are of the top-p nucleus renormalised (rollout.sampling.top_p="
                f"{sampling.top_p}), and the trainer scores the whole tempered distribution (a nucleus has no "
                f"gradient, and a token at its edge leaves it after a step); use {fix} or top_p 1"
            )
        if loss.temperature is not None and loss.temperature != sampling.temperature:
            raise ConfigError(
                f"{field}: {what}, drawn at rollout.sampling.temperature={sampling.temperature}, but "
                f"loss.temperature={loss.temperature} scores another distribution; leave loss.temperature "
                f"null (the sampling temperature) or use {fix}"
            )


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML (.toml) or YAML (.yaml/.yml) file as a dict, within the limits of `config_file`."""
    return read_config_file(path)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults, then the file, then `section.field=value` overrides; validated as a whole.

    A config file that does not set `run_dir` runs in `runs/<file stem>`, not in the demo's `runs/demo`:
    a copy of `--print-config` must not train into (and, with --overwrite, replace) the demo's run."""
    data: dict[str, Any] = read_file(path) if path is not None else {}
    if path is not None and "run_dir" not in data:
        data["run_dir"] = str(Path("runs") / Path(path).stem)
    for assignment in overrides:
        apply_override(data, assignment)
    return from_dict(TrainConfig, decoupled_ppo_default(data))


def decoupled_ppo_default(data: dict[str, Any]) -> dict[str, Any]:
    """With `rollout.max_staleness` >= 1 and `loss.sampler_correction` left unset, the correction is
    `token_truncate`: decoupled PPO, whose behaviour policy is the sampler (its logprobs, recorded per token)
    and whose proximal policy is the scoring pass (the PPO ratio's old logprobs). Stale tokens then weigh by
    min(p_proximal / p_behaviour, cap). Left alone where the user chose, where the ratio is taken against the
    sampler already (`ratio_source='sampler'`), and under top-p sampling (which no correction takes)."""
    rollout, loss = data.get("rollout"), data.get("loss")
    rollout = rollout if isinstance(rollout, dict) else {}
    loss = loss if isinstance(loss, dict) else {}
    k, sampling = rollout.get("max_staleness", 0), rollout.get("sampling")
    top_p = sampling.get("top_p", 1.0) if isinstance(sampling, dict) else 1.0
    if (
        isinstance(k, int) and not isinstance(k, bool) and k >= 1 and "sampler_correction" not in loss
        and loss.get("ratio_source", "scoring") == "scoring" and top_p == 1.0
    ):  # fmt: skip
        data = {**data, "loss": {**loss, "sampler_correction": "token_truncate"}}
    return data


def check_paths(cfg: TrainConfig) -> None:
    """Refuse a path the config names that does not exist or is of the wrong kind, before torch and
    transformers load (seconds sooner) and in the wording every verb uses (`treetrain.io.path_problem`).
    What is inside the directory is checked where it is read.

    Example:
        >>> check_paths(load_config(None, ["model.tokenizer=/no/such/dir"]))
        Traceback (most recent call last):
        treetrain.errors.ConfigError: model.tokenizer: '/no/such/dir' does not exist
    """
    named: tuple[tuple[str, str | None, Literal["file", "directory"]], ...] = (
        ("model.path", cfg.model.path, "directory"),
        ("model.tokenizer", cfg.model.tokenizer, "directory"),
        ("model.reference", cfg.model.reference, "directory"),
        ("distributed.deepspeed_config", cfg.distributed.deepspeed_config, "file"),
    )
    trees = cfg.rollout.trees
    if trees is not None and not any(c in trees for c in "*?["):  # a glob is matched where it is read
        named += (("rollout.trees", trees, "directory" if os.path.isdir(trees) else "file"),)
    for name, value, want in named:
        if value is None or value in ("demo", "demo-wide", "initial", "base") or value.startswith("tiny-"):
            continue
        problem = path_problem(value, want)
        if problem is not None:
            raise ConfigError(f"{name}: {problem}")


def dump_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML (what the run directory keeps)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_template(cfg: TrainConfig) -> str:
    """What `--print-config` shows: the resolved config, with the demo's `run_dir` commented out, so a copy
    saved as `my.yaml` runs in `runs/my` (see `load_config`) rather than in the demo's directory.

    Example:
        >>> config_template(load_config(None)).splitlines()[0]
        '# run_dir: runs/demo  (the demo default; a config file without run_dir runs in runs/<file stem>)'
        >>> config_template(load_config(None, ["run_dir=runs/mine"])).splitlines()[0]
        'run_dir: runs/mine'
    """
    text = dump_config(cfg)
    default = f"run_dir: {TrainConfig.run_dir}\n"
    if text.startswith(default):
        note = "  (the demo default; a config file without run_dir runs in runs/<file stem>)"
        text = f"# {default.rstrip()}{note}\n{text[len(default) :]}"
    return text
