"""`treetrain plan TREES --model MODEL --budget 8GiB`: the memory ledger and the planner's decision.

The library does the work (`treetrain.memory.planner.plan_update`, `treetrain.memory.ledger`); this module
parses arguments, loads trees and the model, and prints. Bad input (an unreadable tree file, a budget that
is not a byte size, a model that is neither a directory nor a preset) and a budget nothing fits in exit
with status 2 and a message that names the problem (for a budget, the smallest peak or the minimum).

With no tree files, `treetrain plan --model PATH` checks the model instead: every check `treetrain train`
makes at start (`treetrain.train.model_check.check_model`), printed as one fact a line and `accepted: ...`,
or the first refusal in one line.

Example:
    treetrain plan trees/long_prefix.msgpack --model tiny-qwen3 --budget 64MiB --contract exact --json
    treetrain plan --model /path/to/hf_checkpoint --set env.name=lookup
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from treetrain.bytesize import format_bytes, parse_bytes
from treetrain.cli.option_types import Real, Whole
from treetrain.cli.plan_bounds import check_planning_work, nothing_to_train
from treetrain.errors import TreetrainError
from treetrain.models import ATTENTION
from treetrain.tree.checks import NamedTrees, check_distinct, check_vocabulary, largest_token
from treetrain.tree.format import TreeFormatError
from treetrain.tree.unpack import short_repr
from treetrain.viz.tree_files import tree_groups

if TYPE_CHECKING:  # the rest loads in `run`, so `treetrain --help` stays fast
    from treetrain.loss.advantages import AdvantageConfig
    from treetrain.loss.loss_config import LossConfig
    from treetrain.memory.persistent import PersistentBytes
    from treetrain.memory.planner import Plan
    from treetrain.replay.batch import UpdateBatch
    from treetrain.train.config import TrainConfig
    from treetrain.train.models import LoadedModels
    from treetrain.tree.trajectory_tree import TrajectoryTree

EXIT_BAD_INPUT = 2
MAX_INFERRED_VOCAB = 1 << 19
"""Largest preset vocabulary taken from the trees' own token ids (above the 262,144 of the largest common
tokenizers); beyond it `--vocab` must say so, because a hostile id must not size an embedding."""
MAX_VOCAB = 1 << 20
"""Largest `--vocab` accepted (it sizes a tiny preset: at 2^24 one embedding is 2 GiB, and planning needs its
gradient and optimizer state too)."""
DTYPES = ("float32", "bfloat16", "float16", "float64")
MAX_WORLD_SIZE = 1 << 16
"""Most data-parallel processes `--world-size` takes (the largest training jobs run a few tens of thousands)."""
MAX_MICROBATCH = 1 << 20
"""Largest `--microbatch` (siblings or calls per microbatch; more than any tree file can hold)."""
MAX_CHUNK = 1 << 24
"""Largest `--chunk-size` (longer than any context a model takes)."""
MAX_CONTEXT_PARALLEL = 1 << 10
"""Largest `--context-parallel` (ranks sharing one tree's resident state; the ledger walks each one)."""
MAX_MIN_SPEEDUP = 1e6
"""Largest `--min-speedup` (a token-ceiling speedup is a ratio of token counts, far below this)."""


def _bytes(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def _retention(text: str) -> int | str:
    return "unbounded" if text == "unbounded" else _bytes(text)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="predict the memory ledger of an update and choose K, chunking, retention and tree or flat mode",
        description="Plan the replay of the trees in TREES (one update) within a device memory budget. "
        "Without TREES, check that `treetrain train` would accept the model (--model, --config, --set).",
    )
    p.add_argument(
        "trees",
        nargs="*",
        metavar="TREES",
        help="tree files (msgpack, see trees/README.md), or directories or run directories searched for "
        "*.msgpack; none: check the model",
    )
    p.add_argument(
        "--config",
        help="a `treetrain train` config: plan with its model, reference model, loss, advantages and replay "
        "settings (the flags below still override)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field of the config (repeatable; without --config, of the defaults)",
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="'demo' (the shipped checkpoint), a local HF model dir or tiny-<family>; with --config or --set it "
        "replaces model.path (e.g. --set model.lora.r=8 plans LoRA adapters on it)",
    )
    p.add_argument(
        "--budget", type=_bytes, help="device memory budget: 8GiB, 512MiB, 1.5GB, bytes (needed with TREES)"
    )
    p.add_argument("--contract", choices=("exact", "response_only"), help="default: exact, or the config's")
    p.add_argument(
        "--vocab",
        type=Whole(1, MAX_VOCAB),
        help="vocabulary of a preset model (default: largest token id + 1)",
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), help="parameter dtype (default float32, or the config's)"
    )
    p.add_argument(
        "--attn", choices=ATTENTION, help="attention implementation (default sdpa, or the config's)"
    )
    p.add_argument("--mode", choices=("tree", "flat"), help="force the mode")
    p.add_argument(
        "--microbatch",
        type=Whole(0, MAX_MICROBATCH),
        help="force K (tree; 0 = all siblings) or calls per microbatch",
    )
    p.add_argument("--chunk-size", type=Whole(0, MAX_CHUNK), help="force the unit length (0 = never split)")
    p.add_argument("--retention", type=_retention, help="force the retention budget (bytes or 'unbounded')")
    p.add_argument("--keep-graphs", choices=("none", "all", "auto"), help="force which graphs are kept")
    p.add_argument(
        "--min-speedup",
        type=Real(0.0, MAX_MIN_SPEEDUP, low_open=True),
        default=1.25,
        help="tree's least token-ceiling speedup over flat (a finite number > 0)",
    )
    p.add_argument(
        "--world-size",
        type=Whole(1, MAX_WORLD_SIZE),
        default=1,
        help="data-parallel processes (per-rank bytes; default 1)",
    )
    p.add_argument(
        "--context-parallel",
        type=Whole(1, MAX_CONTEXT_PARALLEL),
        default=1,
        metavar="C",
        help="ranks of a context group holding each tree's resident state between them: the ledger is one "
        "rank's, and the bytes each rank sends per update are printed (default 1; docs/long-context.md)",
    )
    p.add_argument(
        "--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
        help="DeepSpeed ZeRO stage the update runs under (default 0, or the config's)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the ledger and the decision as JSON")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (transformers' weight loading), as in train",
    )
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"treetrain plan: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _batch(named: NamedTrees, loss: LossConfig, adv: AdvantageConfig) -> UpdateBatch:
    """The update `treetrain train` would build from these trees: each file's trees one advantage group
    (as the trainer normalizes one task's trees together), zero-variance groups dropped when `adv` says so.
    Raises TreeFormatError when nothing would be trained (`nothing_to_train`)."""
    from treetrain.replay.batch import UpdateBatch
    from treetrain.update.run import advantage_groups

    groups, _ = advantage_groups([group for _, group in named], adv)
    problem = nothing_to_train(named, loss, adv, kept=len(groups))
    if problem is not None:
        raise TreeFormatError(problem)
    trees = [t for g in groups for t in g.trees]
    advantages = [a for g in groups for a in g.advantages]
    return UpdateBatch.build(trees, advantages, loss)


def _from_config(args: argparse.Namespace, named: NamedTrees) -> int:
    """Plan exactly as `treetrain train` would for an update made of these trees."""
    from dataclasses import replace

    from treetrain.errors import ConfigError
    from treetrain.train.config import check_paths, load_config

    try:  # the config is checked before torch and transformers load (seconds)
        cfg = load_config(args.config, args.overrides)
        cfg = replace(cfg, memory_budget=str(args.budget), mode=args.mode or cfg.mode)
        section = replace(
            cfg.model, path=args.model or cfg.model.path, dtype=args.dtype or cfg.model.dtype,
            attn=args.attn or cfg.model.attn,
        )  # fmt: skip
        cfg = replace(cfg, model=section)
        check_paths(cfg)
    except ConfigError as e:
        return _fail(str(e))
    from treetrain.train.models import load_models
    from treetrain.update.planning import plan_for

    try:
        vocab = None  # a checkpoint is sized from its tokenizer, never from the trees
        if args.model and section.path.startswith("tiny-"):
            vocab = _vocabulary(args, section.path, named)  # as `--model` alone sizes a preset
        # the trees are checked against the model's config before any model is built or sized
        models = load_models(
            section, vocab_size=vocab, check_config=lambda c: check_vocabulary(named, int(c.vocab_size))
        )
    except TreetrainError as e:
        return _fail(str(e))
    forced = {
        "microbatch": args.microbatch, "chunk_size": args.chunk_size, "keep_graphs": args.keep_graphs,
        "retention": None if args.retention is None else str(args.retention),
    }  # fmt: skip
    replay = replace(cfg.replay, **{k: v for k, v in forced.items() if v is not None})
    cfg = replace(cfg, replay=replace(replay, contract=args.contract or cfg.replay.contract))
    try:
        field = "--chunk-size" if args.chunk_size is not None else "replay.chunk_size"
        check_planning_work(named, cfg.replay.chunk_size, field)
        batch = _batch(named, cfg.policy_loss, cfg.advantages)
        planned = plan_for(
            cfg, batch, models.policy, models.reference, world_size=args.world_size,
            zero_stage=cfg.distributed.zero_stage if args.zero_stage is None else args.zero_stage,
            offload_optimizer=cfg.distributed.offload_optimizer, context_parallel=args.context_parallel,
        )  # fmt: skip
    except TreetrainError as e:
        return _fail(str(e))
    vs_full = lora_vs_full(models, cfg) if cfg.model.lora is not None else None
    if args.json:
        out = plan_json(planned)
        if vs_full is not None:
            out["lora_vs_full_finetuning"] = {name: asdict(b) for name, b in zip(("lora", "full"), vs_full)}
        print(json.dumps(out, indent=2))
    else:
        print(render(planned) + ("\n\n" + lora_text(*vs_full) if vs_full is not None else ""))
    return 0


def lora_vs_full(models: LoadedModels, cfg: TrainConfig) -> tuple[PersistentBytes, PersistentBytes]:
    """Persistent and gradient bytes with the adapters, and for full fine-tuning of the same model (with a
    frozen copy as the reference when KL is on)."""
    from treetrain.memory.persistent import full_finetune_bytes, model_persistent_bytes

    lora = model_persistent_bytes(models.policy, ref_model=models.reference, optimizer=True)
    full = full_finetune_bytes(models.policy, reference=cfg.loss.needs_reference)
    return lora, full


def lora_text(lora: PersistentBytes, full: PersistentBytes) -> str:
    def line(name: str, b: PersistentBytes) -> str:
        return (
            f"{name}: {format_bytes(b.run_persistent + b.update_boundary)} = parameters {format_bytes(b.params)}"
            f" + gradients {format_bytes(b.grads)} + optimizer state {format_bytes(b.optimizer + b.master)}"
            f" + reference {format_bytes(b.reference)}"
        )

    saved = (full.run_persistent + full.update_boundary) - (lora.run_persistent + lora.update_boundary)
    return "\n".join(
        [
            line("LoRA adapters (base frozen)", lora),
            line("full fine-tuning, same model", full),
            f"LoRA saves {format_bytes(saved)} of persistent and gradient memory per process",
        ]
    )


def run(args: argparse.Namespace) -> int:
    if args.no_progress:
        from treetrain.train.progress import hide_library_bars

        hide_library_bars()
    if not args.trees:
        return _check_model(args)
    if args.budget is None:
        return _fail("give --budget (8GiB, 512MiB, ...) to plan TREES within it")
    named: list[tuple[str, tuple[TrajectoryTree, ...]]] = []
    for path in args.trees:
        try:
            named.extend(tree_groups(path))
        except TreeFormatError as e:
            return _fail(str(e))
        except OSError as e:
            return _fail(f"cannot read {e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    try:
        check_distinct(named)
    except TreeFormatError as e:
        return _fail(str(e))
    try:  # before any model loads: a forced chunk size that a plan cannot price in bounded time
        check_planning_work(named, args.chunk_size, "--chunk-size")
    except TreetrainError as e:
        return _fail(str(e))
    if args.config or args.overrides:
        return _from_config(args, named)
    if not args.model:
        return _fail("give --model ('demo', a local model directory or tiny-<family>) or --config")
    # the arguments are checked above; only now load torch and transformers (seconds)
    import torch
    from safetensors import SafetensorError

    from treetrain.loss.advantages import AdvantageConfig
    from treetrain.loss.loss_config import LossConfig
    from treetrain.memory.overrides import Overrides
    from treetrain.memory.persistent import model_persistent_bytes
    from treetrain.memory.planner import plan_update
    from treetrain.models.presets import load_model
    from treetrain.replay.batch import ReplayConfig
    from treetrain.train.models import broken_weights, resolve_model_path

    try:
        path = resolve_model_path(args.model, "--model")  # the same names `treetrain train` accepts
        vocab = _vocabulary(args, path, named)
        check_vocabulary(named, vocab)  # before the model is built
        dtype = getattr(torch, args.dtype or "float32")
        model = load_model(path, vocab_size=vocab, dtype=dtype, attn=args.attn or "sdpa")
    except TreetrainError as e:
        return _fail(str(e))
    except (OSError, ValueError) as e:
        return _fail(f"--model: cannot load model {args.model!r}: {e}")
    except SafetensorError:
        return _fail(f"--model: {broken_weights(path)}")
    overrides = Overrides(
        mode=args.mode, microbatch=args.microbatch, chunk_size=args.chunk_size, retention=args.retention,
        keep_graphs=args.keep_graphs,
    )  # fmt: skip
    persistent = model_persistent_bytes(model, zero_stage=args.zero_stage or 0, world_size=args.world_size)
    try:
        plan = plan_update(
            _batch(named, LossConfig(), AdvantageConfig(zero_variance="keep")), model, budget=args.budget,
            base=ReplayConfig(contract=args.contract or "exact", context_parallel=args.context_parallel),
            overrides=overrides,
            min_speedup=args.min_speedup, persistent=persistent,
        )  # fmt: skip
    except TreetrainError as e:
        return _fail(str(e))
    print(json.dumps(plan_json(plan), indent=2) if args.json else render(plan))
    return 0


def _check_model(args: argparse.Namespace) -> int:
    """`treetrain plan --model PATH` without trees: `treetrain train`'s start-up checks, and what they found."""
    from dataclasses import replace

    from treetrain.train.config import load_config
    from treetrain.train.model_check import check_model

    if not (args.model or args.config or args.overrides):
        return _fail(
            "give tree files to plan, or --model ('demo', a model directory, tiny-<family>) to check"
        )
    try:
        cfg = load_config(args.config, args.overrides)
        section = replace(
            cfg.model, path=args.model or cfg.model.path, dtype=args.dtype or cfg.model.dtype,
            attn=args.attn or cfg.model.attn,
        )  # fmt: skip
        found = check_model(replace(cfg, model=section))
    except TreetrainError as e:
        return _fail(str(e))
    print(found.text())
    return 0


def _vocabulary(args: argparse.Namespace, path: str, named: NamedTrees) -> int:
    """The model's vocabulary, known before it is built: a checkpoint's config, `--vocab`, or for a preset
    the largest token id + 1, refused past `MAX_INFERRED_VOCAB` (a file's ids never size an embedding)."""
    if not path.startswith("tiny-"):
        from treetrain.models.presets import model_config

        return int(
            model_config(path).vocab_size
        )  # config.json read within limits (models/checkpoint_bounds.py)
    if args.vocab:
        return int(args.vocab)
    name, (top, trajectory) = max(((n, largest_token(g)) for n, g in named), key=lambda item: item[1][0])
    if top >= MAX_INFERRED_VOCAB:
        raise TreeFormatError(
            f"{name}: token id {top} (in trajectory {short_repr(trajectory, 40)}) is too large to size a "
            f"{args.model} vocabulary from (at most {MAX_INFERRED_VOCAB - 1} without --vocab); give --vocab N "
            "if the model really has that many"
        )
    return max(top + 1, 1)


def render(plan: Plan) -> str:
    ledger = plan.ledger
    lines = [
        ledger.table(),
        f"minimum retention budget {format_bytes(ledger.minimum_budget)}; "
        f"recomputes forced by retention: {ledger.recomputes}",
        "",
        plan.explain(),
    ]
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, object]:
    return {
        "decision": {
            "mode": plan.mode,
            "contract": plan.contract,
            "microbatch": plan.microbatch,
            "chunk_size": plan.chunk_size,
            "retention": plan.retention,
            "kept_graphs": sorted([t, u] for t, u in plan.keep_graph),
            "budget": plan.budget,
            "min_speedup": plan.min_speedup,
            "speedup": plan.speedup,
            "reasons": list(plan.reasons),
            "forced": list(plan.forced),
            "attention": plan.attention,
        },
        "costs": {
            c.mode: {"token_cost": c.token_cost, "flops": c.flops, "peak": c.peak, "fits": c.fits}
            for c in (plan.tree, plan.flat)
        },
        "ledger": plan.ledger.as_dict(),
    }
