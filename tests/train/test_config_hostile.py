"""Config files and `--set` values are untrusted input to `treetrain train` and `treetrain plan`.

Every bad one exits with status 2 and one line naming the file or field: never a traceback, a hang, or a
number that reaches torch or numpy unchecked. The fuzz tests mutate valid YAML and TOML configs and
`--set` values; whatever is accepted must print back as a config that loads again.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.cli.main import main
from treetrain.errors import ConfigError
from treetrain.train.config import RolloutSection, TrainConfig, config_template, load_config
from treetrain.train.config_file import MAX_CONFIG_BYTES
from treetrain.train.typed import from_dict

ROOT = Path(__file__).resolve().parents[2]
TREE = str(ROOT / "tests" / "assets" / "tree_tiny.msgpack")
DEMO = ROOT / "treetrain" / "assets" / "demo_model"


def _alias_bomb() -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    prev = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
        prev = name
    return "env:\n  kwargs:\n" + "".join(f"    {line}\n" for line in lines)


# (file name, content, what the one-line error must contain)
HOSTILE_FILES: list[tuple[str, bytes, str]] = [
    ("bomb.yaml", _alias_bomb().encode(), "alias"),
    (
        "dup.yaml",
        b"seed: 1\nrollout:\n  sampling:\n    top_p: 0.5\n    top_p: 0.6\n",
        "duplicate key 'top_p'",
    ),
    ("dup.toml", b"seed = 1\nseed = 2\n", "line 2: duplicate key 'seed'"),
    ("dup_dotted.toml", b"[loss]\nkl_coef = 1\n[model]\nx.y = 1\nx.y = 2\n", "duplicate key 'x.y'"),
    (
        "dup_section.toml",
        b"[rollout.sampling]\ntemperature = 2\n[rollout.sampling]\ntop_p = 0.5\n",
        "('rollout', 'sampling') twice",
    ),
    ("stage.toml", b"[distributed]\nzero_stage = true\n", "distributed.zero_stage"),
    ("stage_float.yaml", b"distributed:\n  zero_stage: 1.0\n", "distributed.zero_stage"),
    ("text_float.toml", b'[rollout.sampling]\ntemperature = "0.5"\n', "rollout.sampling.temperature"),
    ("float_int.toml", b"updates = 7.0\n", "updates"),
    ("date.toml", b"run_dir = 1979-05-27\n", "run_dir"),
    ("latin1.yaml", b"run_dir: caf\xe9\n", "not UTF-8"),
    ("binary.toml", b"\x00\xff\xfe\x80", "not UTF-8"),
    ("seed.yaml", f"seed: {2**70}\n".encode(), "seed"),
    ("seed.toml", f"seed = {2**63 - 1}\n".encode(), "seed"),
    ("lr.toml", f"[optim]\nlr = {10**400}\n".encode(), "optim.lr"),
    ("digits.yaml", b"updates: " + b"9" * 5000 + b"\n", "digits.yaml"),
    ("digits.toml", b"updates = " + b"9" * 5000 + b"\n", "digits.toml"),
    ("inf.yaml", b"optim:\n  lr: .inf\n", "optim.lr"),
    ("nan.toml", b"[optim]\nlr = nan\n", "optim.lr"),
    ("deep_flow.yaml", b"env:\n  kwargs:\n    x: " + b"[" * 30_000 + b"]" * 30_000 + b"\n", "deeper"),
    ("deep_block.yaml", "".join(" " * i + f"k{i}:\n" for i in range(300)).encode(), "deeper"),
    ("deep.toml", b"x = " + b"[" * 30_000 + b"]" * 30_000 + b"\n", "deep.toml"),
    ("loop.yaml", b"env:\n  kwargs:\n    x: &a [*a]\n", "deeper"),
    ("surrogate.yaml", b'run_dir: "\\ud800"\n', "Unicode"),
    ("nul.yaml", b'run_dir: "a\\0b"\n', "NUL"),
    ("intkey.yaml", b"1: 2\n", "field name"),
    ("nullkey.yaml", b"~: 2\n", "field name"),
    ("list.yaml", b"- 1\n- 2\n", "top level"),
    ("scalar.toml", b"= 1\n", "not valid TOML"),
    ("big.yaml", b"# " + b"x" * MAX_CONFIG_BYTES + b"\n", "larger than"),
    ("wide.yaml", b"env:\n  kwargs:\n    x: [" + b"0," * 11_000 + b"]\n", "values"),
    ("tab.yaml", b"rollout:\n\tsampling: {top_p: 0.5}\n", "not valid YAML"),
    ("unknown.toml", b"[rollout]\nbranching = 2\n", "rollout.branching: unknown field"),
    ("section.yaml", b"rollout: 3\n", "rollout"),
    ("fanout_section.toml", b"[rollout]\nfanout = 2\n", "rollout.fanout: expected a section"),
    (
        "fanout.yaml",
        b"rollout:\n  fanout:\n    root: 1000000000\n",
        "rollout.fanout.root: must be in [1, 4096]",
    ),
    ("fanout_leaves.toml", b"[rollout.fanout]\nafter_tool_result = 64\n", "rollout.fanout.max_trajectories"),
    (
        "renamed.yaml",
        b"rollout:\n  fanout_env: 2\n",
        "rollout.fanout_env was renamed rollout.fanout.after_assistant_turn",
    ),
    ("threads.toml", b"threads = 1000000\n", "threads"),
    ("config.txt", b"seed: 1\n", "use .toml"),
]


def _one_line_error(err: str, *needles: str) -> None:
    # transformers' own progress bars (loading weights) are not error lines
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(("name", "content", "needle"), HOSTILE_FILES, ids=[c[0] for c in HOSTILE_FILES])
def test_hostile_config_files_are_one_line_errors(tmp_path: Path, capsys, name, content, needle) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    start = time.perf_counter()
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    assert time.perf_counter() - start < 20, "a hostile config took too long to refuse"
    _one_line_error(capsys.readouterr().err, needle)
    assert main(["plan", TREE, "--budget", "1GiB", "--config", str(path)]) == 2
    _one_line_error(capsys.readouterr().err, needle)


def test_not_a_regular_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "dir.yaml").mkdir()
    assert main(["train", "--config", str(tmp_path / "dir.yaml"), "--print-config"]) == 2
    _one_line_error(capsys.readouterr().err, "dir.yaml' is a directory, not a file")
    if hasattr(os, "mkfifo"):  # reading a FIFO would block forever
        os.mkfifo(tmp_path / "fifo.yaml")
        assert main(["train", "--config", str(tmp_path / "fifo.yaml"), "--print-config"]) == 2
        _one_line_error(capsys.readouterr().err, "fifo.yaml' is not a regular file")


def test_missing_and_wrong_kind_of_config_file(tmp_path: Path, capsys) -> None:
    """The path is named once, as given, and the problem in plain words (no PosixPath repr)."""
    assert main(["train", "--config", str(tmp_path / "nope.yaml"), "--print-config"]) == 2
    err = capsys.readouterr().err
    _one_line_error(err, f"config file: '{tmp_path / 'nope.yaml'}' does not exist")
    assert "PosixPath" not in err and err.count("nope.yaml") == 1
    (tmp_path / "notes.md").write_text("# notes\n")
    assert main(["train", "--config", str(tmp_path / "notes.md"), "--print-config"]) == 2
    _one_line_error(capsys.readouterr().err, "notes.md: not a config file; use .toml, .yaml or .yml")
    (tmp_path / "ok.yaml").write_text("updates: 2\n")  # negative control: a good file is read
    assert main(["train", "--config", str(tmp_path / "ok.yaml"), "--print-config"]) == 0
    assert "updates: 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("seed=2**70", "seed"),
        (f"seed={2**70}", "seed"),
        ("seed=-1", "seed"),
        (f"replay.max_logit_elements={2**64}", "replay.max_logit_elements"),
        ("optim.lr=1e999", "optim.lr"),
        (f"optim.lr={10**400}", "optim.lr"),
        ("optim.betas=[0.9, 1e999]", "optim.betas"),
        ("rollout.episode.max_turn_tokens=1e9", "rollout.episode.max_turn_tokens"),
        ("rollout.episode.max_episode_tokens=4294967296", "rollout.episode.max_episode_tokens"),
        ("distributed.zero_stage=true", "distributed.zero_stage"),
        ("env.kwargs=" + "[" * 10_000, "env.kwargs"),
        ("env.kwargs={a: &x [*x]}", "env.kwargs"),
        ('run_dir="\\ud800"', "run_dir"),
        ("updates=" + "9" * 5000, "updates"),
        ("seed", "seed"),
        ("=1", "names no field"),
        ("seed.x=1", "seed"),
        ("loss.clip_high=1e308", "loss.clip_high"),
        ("loss.entropy_coef=1e31", "loss.entropy_coef"),
        ("loss.seq_sum_normalizer=1e-320", "loss.seq_sum_normalizer"),
        ("rollout.sampling.temperature=1e-320", "rollout.sampling.temperature"),
        ("rollout.episode.step_timeout_s=1e12", "rollout.episode.step_timeout_s: must be in (0, 604800]"),
        ("rollout.episode.max_turns=0", "rollout.episode.max_turns: must be in [1, 4096], got 0"),
        ("rollout.episode.max_turns=4097", "rollout.episode.max_turns: must be in [1, 4096], got 4097"),
        ("rollout.episode.max_episode_tokens=1.5", "rollout.episode.max_episode_tokens: expected an integer"),
        ("rollout.sampling.temperature=0", "rollout.sampling.temperature: must be > 0 for RL sampling"),
        ("rollout.sampling.temperature=-1", "rollout.sampling.temperature: must be >= 0"),
        ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p: must be in (0, 1], got 1.5"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p: must be in (0, 1], got 0"),
        ("rollout.groups_per_update=65537", "rollout.groups_per_update: must be in [1, 65536], got 65537"),
        ("run_dir=", "run_dir: must not be empty"),
        ("rollout.trees=''", "rollout.trees: must not be empty"),
        ("model.reference=", "model.reference: must not be empty"),
        ("rollout.vllm.weight_sync=ftp", "rollout.vllm.weight_sync: must be one of ('files', 'gloo')"),
        ("rollout.vllm.transfer_host='a b'", "rollout.vllm.transfer_host: must be a host name"),
        ("rollout.vllm.transfer_host=http://x", "rollout.vllm.transfer_host: must be a host name"),
    ],
)
def test_hostile_set_values_are_one_line_errors(capsys, override: str, needle: str) -> None:
    with pytest.raises(ConfigError):
        load_config(None, [override])
    assert main(["train", "--set", override, "--print-config"]) == 2
    _one_line_error(capsys.readouterr().err, needle)
    assert main(["plan", TREE, "--budget", "1GiB", "--set", override]) == 2
    _one_line_error(capsys.readouterr().err, needle)


def test_streamed_weights_are_refused_for_an_asynchronous_run() -> None:
    sets = [
        "rollout.engine=vllm-server",
        'rollout.vllm.urls=["http://127.0.0.1:8000"]',
        "rollout.vllm.weight_sync=gloo",
    ]
    load_config(None, sets)  # synchronous: accepted
    with pytest.raises(
        ConfigError, match=r"^rollout.vllm.weight_sync: gloo streams .*set rollout.vllm.weight_sync=files"
    ):
        load_config(None, [*sets, "rollout.max_staleness=1"])


@pytest.mark.parametrize(("old", "new"), sorted(RolloutSection.RENAMED_FIELDS.items()))
def test_a_renamed_key_fails_naming_its_new_key(tmp_path: Path, capsys, old: str, new: str) -> None:
    """An earlier config file fails loudly instead of losing the setting; the new key loads the value."""
    path = tmp_path / "old.yaml"
    path.write_text(f"rollout:\n  {old}: 2\n")
    for source in (["--config", str(path)], ["--set", f"rollout.{old}=2"]):
        assert main(["train", *source, "--print-config"]) == 2
        _one_line_error(capsys.readouterr().err, f"rollout.{old} was renamed rollout.{new}")
    value = 0.5 if new == "sampling.top_p" else 2  # a value the new key accepts
    assert main(["train", "--set", f"rollout.{new}={value}", "--print-config"]) == 0  # the control: it loads
    section, key = new.split(".")
    assert getattr(getattr(load_config(None, [f"rollout.{new}={value}"]).rollout, section), key) == value
    assert f"| `rollout.{old}` | `rollout.{new}` |" in (ROOT / "docs" / "configuration.md").read_text()


def test_an_unknown_key_beside_a_renamed_one_still_names_the_rename() -> None:
    with pytest.raises(
        ConfigError, match=r"^rollout\.max_branch_depth was renamed rollout\.fanout\.max_depth$"
    ):
        load_config(None, ["rollout.aaa=1", "rollout.max_branch_depth=2"])
    with pytest.raises(ConfigError, match=r"^rollout\.aaa: unknown field"):
        load_config(None, ["rollout.aaa=1"])


def test_yaml_exponent_floats_and_merge_keys_still_load(tmp_path: Path) -> None:
    """YAML 1.2 numbers (5e-4) are numbers; a merge key (<<) overriding a merged key is not a duplicate."""
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {kl_coef: 0.1, entropy_coef: 0.01}\n")
    with pytest.raises(ConfigError, match="base"):
        load_config(path)
    path.write_text(
        "optim:\n  lr: 5e-4\nloss: {<<: {kl_coef: 0.1, entropy_coef: 0.01}, kl_coef: 0.2}\n"
        "model:\n  reference: initial\n"
    )
    cfg = load_config(path, ["optim.eps=1E-7"])
    assert cfg.optim.lr == 5e-4 and cfg.optim.eps == 1e-7
    assert cfg.loss.kl_coef == 0.2 and cfg.loss.entropy_coef == 0.01


def test_truncated_safetensors_names_the_file(tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    shutil.copytree(DEMO, model)
    weights = model / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    run = tmp_path / "run"
    assert main(["train", "--set", f"model.path={model}", "--run-dir", str(run), "--no-progress"]) == 2
    _one_line_error(capsys.readouterr().err, "model.path", str(weights), "not a complete safetensors file")
    assert main(["plan", TREE, "--budget", "1GiB", "--set", f"model.path={model}"]) == 2
    _one_line_error(capsys.readouterr().err, str(weights))
    assert main(["plan", TREE, "--budget", "1GiB", "--model", str(model)]) == 2
    _one_line_error(capsys.readouterr().err, "--model", str(weights))
    assert main(["train", "--set", f"model.reference={model}", "--run-dir", str(run), "--no-progress"]) == 2
    _one_line_error(capsys.readouterr().err, "model.reference", str(weights))


# ----- fuzzing ------------------------------------------------------------------------------------------
BASE_YAML = (
    "run_dir: runs/x\nseed: 3\nupdates: 2\nmodel:\n  path: tiny-llama\n  reference: initial\n"
    "rollout:\n  fanout:\n    root: 4\n  sampling:\n    temperature: 1.0\n  trees: null\nloss:\n  kl_coef: 0.05\n"
    "optim:\n  lr: 5e-4\n  betas: [0.9, 0.99]\nenv:\n  kwargs: {a: 1, b: [x, y]}\n"
    "distributed:\n  zero_stage: 2\n"
)
BASE_TOML = (
    'run_dir = "runs/x"\nseed = 3\nupdates = 2\n[model]\npath = "tiny-llama"\nreference = "initial"\n'
    "[rollout.sampling]\ntemperature = 1.0\n[rollout.fanout]\nroot = 4\n[loss]\nkl_coef = 0.05\n"
    "[optim]\nlr = 5e-4\nbetas = [0.9, 0.99]\n[env.kwargs]\na = 1\nb = ['x', 'y']\n"
    "[distributed]\nzero_stage = 2\n"
)
HOSTILE_SNIPPETS = [
    b"&a [*a, *a]", b"*undefined", b"!!python/object:os.system", b"[" * 200, b"{" * 200, b"\xff\xfe",
    b"\x00", str(2**70).encode(), b"9" * 5000, b".nan", b"-.inf", b"1e999", b"true", b"~", b"''",
    b'"\\ud800"', b"<<: *a", b"? [a, b]\n: c", b"\n  \t", b"---\n", b"...", b"%YAML 1.1\n", b"0x7fffffffffffffffff",
    b"1979-05-27T07:32:00Z", b"inf", b"nan", b"-0", b'"""', b"[[a]]\n", b"[a.b.c]\n", b"a.b = 1\n",
]  # fmt: skip
FIELDS = [
    "seed", "updates", "threads", "memory_budget", "checkpoint_every", "mode", "run_dir",
    "model.path", "model.dtype", "model.reference", "rollout.fanout.root", "rollout.sampling.temperature",
    "rollout.sampling.top_p", "rollout.episode.step_timeout_s", "rollout.episode.max_turn_tokens", "rollout.trees",
    "rollout.fanout.max_depth", "rollout.fanout_env", "rollout.fanout", "rollout.sampling", "rollout.episode",
    "rollout.episode.max_turns", "rollout.episode.max_episode_tokens", "rollout.temperature", "rollout.max_turns",
    "replay.microbatch", "replay.retention", "replay.max_logit_elements", "replay.keep_graphs",
    "loss.kl_coef", "loss.dual_clip", "optim.lr", "optim.betas", "optim.name", "env.kwargs", "env.name",
    "distributed.zero_stage", "distributed.backend", "advantages.eps", "nonsense", "rollout.nonsense.x",
    "env.kwargs.eval_fraction", "env.template_kwargs.x",
]  # fmt: skip
VALUES = [
    "0", "-1", "1", "2**70", str(2**63), str(-(2**63) - 1), "9" * 5000, "1e999", "-1e-999", ".nan", "nan",
    "inf", "true", "null", "~", "''", "[]", "{}", "[1, 2]", "[0.9, 0.99, 0.5]", "{a: 1}", "&a [*a]",
    "*a", "[" * 100, "x" * 70_000, "\\ud800", '"\\ud800"', "1.0", "3", "tree", "float64", "8GiB",
    "1e308GiB", "-5GiB", "unbounded", "*.msgpack", "a: b", "- 1", "'", '"', "\t", "%", "@", "`",
]  # fmt: skip
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _check_cli(path: Path | None, overrides: list[str], capsys) -> None:
    """Exit 0 with a config that loads again, or exit 2 with one line; plan agrees on refusals."""
    args = ["train", "--print-config"] + (["--config", str(path)] if path else [])
    for o in overrides:
        args += ["--set", o]
    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if code == 0:  # what was accepted prints as a config that loads to the same thing
        again = from_dict(TrainConfig, yaml.safe_load(out))
        assert config_template(again) == out
        return
    assert code == 2
    _one_line_error(err)
    plan = ["plan", TREE, "--budget", "1GiB"] + (["--config", str(path)] if path else [])
    for o in overrides:
        plan += ["--set", o]
    assert main(plan) == 2
    _one_line_error(capsys.readouterr().err)


@FUZZ
@given(
    st.sampled_from([("c.yaml", BASE_YAML), ("c.toml", BASE_TOML)]),
    st.lists(
        st.tuples(
            st.sampled_from(["truncate", "flip", "set", "insert", "delete"]),
            st.integers(0),
            st.integers(0, 255),
            st.sampled_from(HOSTILE_SNIPPETS),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_fuzz_config_files(tmp_path: Path, capsys, base, ops) -> None:
    name, text = base
    blob = bytearray(text.encode())
    for op, at, byte, snippet in ops:
        at %= max(1, len(blob))
        if op == "truncate":
            del blob[at:]
        elif op == "flip" and blob:
            blob[at] ^= 1 << (byte % 8)
        elif op == "set" and blob:
            blob[at] = byte
        elif op == "insert":
            blob[at:at] = snippet
        elif op == "delete":
            del blob[at : at + 1 + byte % 16]
    path = tmp_path / name
    path.write_bytes(bytes(blob))
    _check_cli(path, [], capsys)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(FIELDS), st.sampled_from(VALUES)), min_size=1, max_size=3))
def test_fuzz_set_values(capsys, assignments) -> None:
    _check_cli(None, [f"{field}={value}" for field, value in assignments], capsys)


def test_a_huge_field_name_gives_a_short_line(capsys) -> None:
    for override in ("x" * 10_000 + "=1", "x" * 10_000, "rollout." + "y" * 10_000 + "=1"):
        assert main(["train", "--set", override, "--print-config"]) == 2
        line = capsys.readouterr().err.strip()
        assert "\n" not in line and len(line) < 600, line[:200]


def test_empty_run_dir_and_trees_flags_are_refused_not_ignored(capsys) -> None:
    """`--run-dir "$UNSET"` would otherwise run in runs/demo and `--trees "$UNSET"` sample rollouts."""
    for flag in ("--run-dir", "--trees"):
        assert main(["train", flag, "", "--print-config"]) == 2
        _one_line_error(capsys.readouterr().err, "must not be empty")


def test_env_kwargs_must_be_json_values() -> None:
    """The environment is built in a worker process from `env.kwargs`, sent as JSON: a YAML date is refused
    at load time, in one line naming the key (a JSON value loads, the control)."""
    with pytest.raises(ConfigError, match=r"env\.kwargs: must be JSON values"):
        load_config(None, ["env.kwargs={when: 2024-01-01}"])
    assert dict(load_config(None, ["env.kwargs={n: 3}"]).env.kwargs) == {"n": 3}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("env.kwargs.eval_fraction=.nan", "env.kwargs.eval_fraction"),
        ("env.kwargs.weights=[1, -.inf]", "env.kwargs.weights[1]"),
        ("env.kwargs.judge={scale: 1e999}", "env.kwargs.judge.scale"),
        ("env.template_kwargs.budget=.inf", "env.template_kwargs.budget"),
        ("optim.lr=.nan", "optim.lr"),
        ("optim.betas=[0.9, .nan]", "optim.betas[1]"),
        ("rollout.sampling.temperature=-.inf", "rollout.sampling.temperature"),
    ],
)
def test_a_non_finite_number_is_refused_naming_its_field_wherever_it_is(
    tmp_path: Path, override: str, field: str
) -> None:
    """Typed float fields and free-form values (`env.kwargs`, sent to the worker as JSON) alike."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert str(caught.value).startswith(f"{field}: expected a finite number, got "), caught.value
    key, value = override.split("=", 1)
    *sections, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(
        "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
        + f"{'  ' * len(sections)}{name}: {value}\n"
    )
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: expected a finite number"):
        load_config(path)
    assert load_config(None, ["env.kwargs.eval_fraction=0.25"]).env.kwargs["eval_fraction"] == 0.25
