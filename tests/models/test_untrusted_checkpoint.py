"""A checkpoint directory's config.json never sizes a model by itself (treetrain.models.checkpoint_bounds).

Each case is the shipped demo checkpoint with one hostile change. The library refuses it with one line
naming the file and the limit, before transformers builds or allocates anything; `plan --model` and
`train` answer it in one line, exit 2, no traceback. The unchanged demo passes (the negative control).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from treetrain.cli.main import main
from treetrain.models.checkpoint_bounds import MAX_LAYERS, check_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "treetrain" / "assets" / "demo_model"
TREE = str(ROOT / "tests" / "assets" / "tree_tiny.msgpack")


def _checkpoint(root: Path, name: str, config: dict[str, Any] | None = None, **files: bytes) -> Path:
    """The demo checkpoint with `config` merged into its config.json and `files` (name -> bytes) replaced."""
    out = root / name
    shutil.copytree(DEMO, out)
    if config is not None:
        data = json.loads((out / "config.json").read_text())
        data.update(config)
        (out / "config.json").write_text(json.dumps(data))
    for file, blob in files.items():
        (out / file.replace("_", ".")).write_bytes(blob)
    return out


def _header_only(header: dict[str, Any]) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


# (case, config changes, replaced files, what the message must say)
CASES: list[tuple[str, dict[str, Any] | None, dict[str, bytes], str]] = [
    ("vocab 2**40", {"vocab_size": 2**40}, {}, "MAX_VOCAB"),
    ("vocab -5", {"vocab_size": -5}, {}, "MAX_VOCAB"),
    ("vocab as text", {"vocab_size": "514"}, {}, "vocab_size"),
    ("layers 1e9", {"num_hidden_layers": 10**9}, {}, f"above the limit of {MAX_LAYERS}"),
    ("layers 1e9 as float", {"num_hidden_layers": 1e9}, {}, "num_hidden_layers must be a whole number"),
    ("experts 1e9", {"num_local_experts": 10**9}, {}, "MAX_EXPERTS"),
    ("hidden 2**20", {"hidden_size": 2**20}, {}, "MIN_BITS_PER_PARAMETER"),
    ("intermediate 2**36", {"intermediate_size": 2**36}, {}, "MIN_BITS_PER_PARAMETER"),
    (
        "no tensors in the weight file",
        None,
        {"model_safetensors": _header_only({})},
        "MIN_BITS_PER_PARAMETER",
    ),
    ("heads 0", {"num_attention_heads": 0}, {}, "ZeroDivisionError"),
    (
        "kv heads 3",
        {"num_key_value_heads": 3},
        {},
        "k_proj.weight is [48, 128] by config.json but [128, 128]",
    ),
    ("unknown model type", {"model_type": "no-such-family"}, {}, "not a usable model config"),
    ("not a causal LM", {"model_type": "bert", "architectures": ["BertModel"]}, {}, "supported causal LM"),
    (
        "config nested 100000 deep",
        None,
        {"config_json": b"[" * 100_000 + b"]" * 100_000},
        "nested too deeply",
    ),
    ("config a JSON list", None, {"config_json": b"[1, 2]"}, "must be an object, found a list"),
    ("config not UTF-8", None, {"config_json": b'{"model_type": "\xff"}'}, "not UTF-8 text"),
    (
        "config of 2 MiB",
        None,
        {"config_json": b'{"a": "' + b"x" * (2 << 20) + b'"}'},
        "larger than the limit",
    ),
    ("weights header of 2**63", None, {"model_safetensors": struct.pack("<Q", 2**63) + b"{}"}, "safetensors"),
]


@pytest.mark.parametrize(("case", "config", "files", "needle"), CASES, ids=[c[0] for c in CASES])
def test_hostile_checkpoints_are_refused_before_anything_is_built(
    tmp_path: Path, case: str, config: dict[str, Any] | None, files: dict[str, bytes], needle: str
) -> None:
    path = _checkpoint(tmp_path, "model", config, **files)
    with pytest.raises(ValueError) as info:
        check_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and needle in message, message
    assert str(path) in message


def test_the_demo_checkpoint_passes() -> None:
    check_checkpoint(DEMO)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("Loading weights")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.mark.timeout(180)
def test_plan_and_train_answer_a_hostile_checkpoint_in_one_line(tmp_path: Path, capsys) -> None:
    """Every case through `plan --model`; a few through `plan --set model.path` and `train` (each of those
    loads a tokenizer first)."""
    for k, (case, config, files, needle) in enumerate(CASES):
        path = _checkpoint(tmp_path, f"m{k}", config, **files)
        assert main(["plan", TREE, "--model", str(path), "--budget", "1GiB"]) == 2, case
        line = _one_line(capsys.readouterr().err)
        assert line.startswith("treetrain plan: --model") and needle in line, line
        if k % 6 == 0:
            assert main(["plan", TREE, "--budget", "1GiB", "--set", f"model.path={path}"]) == 2, case
            assert needle in _one_line(capsys.readouterr().err)
            argv = [
                "train",
                "--trees",
                TREE,
                "--set",
                f"model.path={path}",
                "--run-dir",
                str(tmp_path / f"r{k}"),
            ]
            assert main([*argv, "--no-progress", "--set", "updates=1"]) == 2, case
            line = _one_line(capsys.readouterr().err)
            assert line.startswith("treetrain train: model.path:") and needle in line, line
