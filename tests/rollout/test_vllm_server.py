"""The vllm-server engine against servers that misbehave (stand-ins on loopback speaking vLLM's protocol
badly), its start-up checks and reload confirmations, and its routing: one line naming the URL and the
fault, and no tree file written half. `test_served_engine.py` meets a real `vllm serve`."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.env_fixtures import FixedTurnsEnv, tiny_model, tokenizer
from support.ports import free_port
from support.vllm_standin import EXPECTED, INFO, MODELS, Answer, Standin, good, reload_answer, standins

from envs import EpisodeLimits, WrapperConfig
from treetrain.cli.main import main
from treetrain.errors import TreetrainError
from treetrain.rollout import FanOut, RolloutConfig, SamplerConfig, Sampling, rollout_trees
from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import EngineError, GenerationRequest
from treetrain.rollout.engines.server_checks import Expected, ServedConfig, mismatch
from treetrain.rollout.engines.vllm_server import VLLMServerEngine


@pytest.fixture
def server() -> Iterator[Callable[..., str]]:
    with standins() as start:
        yield start


def _engine(urls: list[str], tmp_path: Path, timeout: float = 5.0) -> VLLMServerEngine:
    return VLLMServerEngine(
        VLLMSettings(urls=tuple(urls), request_timeout_s=timeout),
        weights_dir=tmp_path / "w",
        expected=EXPECTED,
    )


def _rollout(engine: VLLMServerEngine, tmp_path: Path) -> object:
    config = RolloutConfig(
        FanOut(root=2),
        SamplerConfig(Sampling()),
        WrapperConfig(EpisodeLimits(max_turns=2, max_turn_tokens=4)),
    )
    return rollout_trees(
        tiny_model(), tokenizer(), FixedTurnsEnv, [0, 1], tmp_path / "run", config, engine=engine
    )


def test_a_well_behaved_server_grows_the_trees(server: Callable[..., str], tmp_path: Path) -> None:
    engine = _engine([server(good)], tmp_path)
    result = _rollout(engine, tmp_path)
    assert len(result.trees) == 2  # type: ignore[attr-defined]
    assert engine.stats.cached_tokens == 3 * engine.stats.requests


def test_a_server_that_is_down_is_named_at_start(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=rf"^vllm-server {url}/v1/models: cannot connect: .*refused"):
        _engine([url], tmp_path)


@pytest.mark.parametrize(
    ("answer", "fault"),
    [
        (lambda body: (200, b"{not json"), "the answer is not JSON"),
        (lambda body: (500, b"engine exploded"), "HTTP 500 .*engine exploded"),
        (lambda body: (200, json.dumps({"choices": [{"index": 0}]}).encode()), "outside the protocol"),
        (lambda body: (200, json.dumps({"choices": [{"index": 0, "token_ids": [1, "x"], "logprobs": {"token_logprobs": [0, 0]}}]}).encode()), "outside the protocol"),
        (lambda body: (200, json.dumps({"choices": []}).encode()), "0 samples for a request of n=2"),
        (lambda body: (time.sleep(3), good(body))[1], "no answer within 1s"),
    ],
)  # fmt: skip
def test_a_misbehaving_server_stops_the_rollout_in_one_line(
    server: Callable[..., str], tmp_path: Path, answer: Answer, fault: str
) -> None:
    url = server(answer)
    # Only the slow server's case times out; the others get a timeout a loaded CI machine cannot reach.
    timeout = 1.0 if fault.startswith("no answer") else 60.0
    with pytest.raises(EngineError) as caught:
        _rollout(_engine([url], tmp_path, timeout=timeout), tmp_path)
    line = str(caught.value)
    assert "\n" not in line and isinstance(caught.value, TreetrainError)
    assert line.startswith(f"vllm-server {url}/v1/completions: ") and re.search(fault, line)
    assert not list(
        (tmp_path / "run" / "trees").glob("*.msgpack")
    )  # nothing half: no tree without its answers


def test_every_request_of_a_tree_goes_to_one_server(server: Callable[..., str], tmp_path: Path) -> None:
    seen: dict[str, list[int]] = {}

    def recorder(name: str) -> Answer:
        def answer(body: dict) -> tuple[int, bytes]:
            seen.setdefault(name, []).append(body["prompt"][-1])
            return good(body)

        return answer

    urls = [server(recorder("a")), server(recorder("b"))]
    engine = _engine(urls, tmp_path)
    groups = [f"task-{i}" for i in range(8)]
    for i, g in enumerate(groups):
        for turn in range(3):  # the last prompt token says which tree a request belongs to
            engine.submit(GenerationRequest((1, 2, 3 + turn, 10 + i), 1, 4, Sampling(), ((2,),), group=g))
    while engine.busy:
        engine.poll()
    assert sum(len(v) for v in seen.values()) == 24
    trees = {name: {t - 10 for t in tokens} for name, tokens in seen.items()}
    assert set(trees) == {"a", "b"} and not trees["a"] & trees["b"]  # each tree on one server, both used


def test_bad_urls_are_refused_at_load() -> None:
    for bad in ["localhost:8000", "ftp://x", "http://", "http://h:0", "http://h/?q=1"]:
        with pytest.raises(TreetrainError, match=r"^urls: "):
            VLLMSettings(urls=(bad,))
    with pytest.raises(TreetrainError, match="twice"):
        VLLMSettings(urls=("http://a:1", "http://a:1"))


def test_a_sync_sends_the_reload_labels_the_weights_and_probes_them(
    server: Callable[..., str], tmp_path: Path
) -> None:
    standin = Standin(model=tiny_model())
    engine = _engine([server(standin)], tmp_path)
    engine.sync_weights(standin.model, 3)
    (reload,) = standin.reloads
    assert reload == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "w" / "current")}}
    assert standin.version == engine.label == f"{(tmp_path / 'w').resolve()}@3" and engine.version == 3
    assert list((tmp_path / "w" / "current").glob("*.safetensors"))
    engine.close()  # the servers hold the weights: the copy written for them goes
    assert not (tmp_path / "w").exists()


def test_weights_a_server_may_still_be_reading_are_kept_at_close(
    server: Callable[..., str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload that did not answer in time: its server may still read the files, so closing the engine
    (the run's error exit) leaves them; one that answered, even with a refusal, does not."""

    def slow(body: dict) -> tuple[int, bytes]:
        time.sleep(1.5)
        return reload_answer(body)

    standin = Standin(model=tiny_model(), posts={"/collective_rpc": slow})
    engine = _engine([server(standin)], tmp_path, timeout=0.5)
    with pytest.raises(EngineError, match="collective_rpc"):
        engine.sync_weights(standin.model, 1)
    with caplog.at_level("WARNING"):
        engine.close()
    assert list((tmp_path / "w" / "current").glob("*.safetensors"))
    assert "a server may still be reading it" in caplog.text

    refused = Standin(model=tiny_model(), posts={"/collective_rpc": lambda body: (200, b"")})
    engine = _engine([server(refused)], tmp_path / "other")
    with pytest.raises(EngineError, match="was not confirmed"):
        engine.sync_weights(refused.model, 1)
    engine.close()  # the negative control: every reload answered, so nothing reads the files
    assert not (tmp_path / "other" / "w").exists()


@pytest.mark.parametrize(
    ("posts", "fault"),
    [
        ({"/collective_rpc": lambda body: (200, b"")}, "the reload of .* was not confirmed"),
        ({"/collective_rpc": lambda body: (200, b'{"results": ["boom"]}')}, "was not confirmed"),
        ({"/collective_rpc": lambda body: (500, b"start (0) + length (512) exceeds")}, "is that this run's model"),
        ({"/reset_prefix_cache": lambda body: (200, b'{"success": false}')}, "reset was not confirmed"),
        ({"/update_weight_version": lambda body: (200, b"")}, "update_weight_version: not confirmed"),
    ],
)  # fmt: skip
def test_a_reload_that_is_not_confirmed_stops_the_run(
    server: Callable[..., str], tmp_path: Path, posts: dict[str, Answer], fault: str
) -> None:
    standin = Standin(model=tiny_model(), posts=posts)
    url = server(standin)
    with pytest.raises(EngineError) as caught:
        _engine([url], tmp_path).sync_weights(standin.model, 1)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"vllm-server {url}") and re.search(fault, line), line


def test_weights_that_did_not_arrive_fail_the_probe(server: Callable[..., str], tmp_path: Path) -> None:
    standin = Standin(model=tiny_model(seed=1))  # the server holds other weights than the trainer's
    engine = _engine([server(standin)], tmp_path)
    with pytest.raises(EngineError, match=r"weight probe\): its logprobs differ from the trainer's by up to"):
        engine.sync_weights(tiny_model(seed=0), 1)
    engine.sync_weights(standin.model, 1)  # the same check passes on the weights the server holds


def test_a_restarted_server_is_noticed_when_the_engine_falls_idle(
    server: Callable[..., str], tmp_path: Path
) -> None:
    standin = Standin(model=tiny_model())
    engine = _engine([server(standin)], tmp_path)
    engine.sync_weights(standin.model, 1)
    engine.submit(GenerationRequest((1, 2, 3), 1, 4, Sampling(), ((2,),)))
    while engine.busy:  # its own label passes
        engine.poll()
    standin.version = "default"  # what a restarted server reports
    engine.submit(GenerationRequest((1, 2, 3), 1, 4, Sampling(), ((2,),)))
    with pytest.raises(EngineError, match=r"weight version is 'default', expected .*restarted"):
        while engine.busy:
            engine.poll()


def test_a_server_without_dev_mode_is_refused_at_start(server: Callable[..., str], tmp_path: Path) -> None:
    url = server(Standin(info={}))
    with pytest.raises(
        EngineError, match=r"/server_info: not found: start the server with VLLM_SERVER_DEV_MODE=1"
    ):
        _engine([url], tmp_path)


SERVED = ServedConfig(
    model="demo", root="/ckpt/demo", max_model_len=4096, dtype="float32", prefix_caching=True,
    logprobs_mode="processed_logprobs", chunked_prefill=False, max_num_batched_tokens=8192, max_num_seqs=128,
    device="cpu",
)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"max_model_len": 32}, "--max-model-len 64"),
        ({"dtype": "bfloat16"}, "--dtype float32"),
        ({"logprobs_mode": "raw_logprobs"}, "--logprobs-mode processed_logprobs"),
        ({"prefix_caching": False}, "--enable-prefix-caching"),
        ({"chunked_prefill": True}, "--no-enable-chunked-prefill"),
    ],
)
def test_each_mismatch_names_its_flag(change: dict[str, Any], flag: str) -> None:
    assert mismatch(SERVED, EXPECTED) is None
    line = mismatch(dataclasses.replace(SERVED, **change), EXPECTED)
    assert line is not None and flag in line
    if "chunked_prefill" in change:  # a GPU's generator takes offsets: chunked prefill is fine there
        assert mismatch(dataclasses.replace(SERVED, device="cuda", **change), EXPECTED) is None


def test_a_mismatch_is_refused_at_start_in_one_line(server: Callable[..., str], tmp_path: Path) -> None:
    info = {**INFO, "model_config": {**INFO["model_config"], "logprobs_mode": "raw_logprobs"}}
    url = server(Standin(info=info))
    with pytest.raises(EngineError) as caught:
        _engine([url], tmp_path)
    assert str(caught.value) == (
        f"vllm-server {url} (serving /ckpt/demo): it returns raw_logprobs, not the logprobs of the "
        "distribution it sampled: start it with --logprobs-mode processed_logprobs"
    )


def test_a_run_refused_at_its_first_reload_leaves_no_engine_weights(
    server: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The weights are written before the reload is refused; the run never started, so they go too."""
    url = server(Standin(posts={"/collective_rpc": lambda body: (200, b"")}))  # an unconfirmed reload
    run = tmp_path / "run"
    run.mkdir()
    sets = ["model.path=tiny-llama", "updates=1", "rollout.engine=vllm-server", f"rollout.vllm.urls=[{json.dumps(url)}]",
            "rollout.groups_per_update=1", "rollout.fanout.root=2", "rollout.episode.max_turn_tokens=4",
            "rollout.episode.max_episode_tokens=512"]  # fmt: skip
    assert (
        main(["train", "--run-dir", str(run), "--no-progress", *(a for kv in sets for a in ("--set", kv))])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "was not confirmed" in err and "nothing of it was left" in err, err
    assert list(run.iterdir()) == []


def test_a_server_serving_another_model_is_refused_at_start(
    server: Callable[..., str], tmp_path: Path
) -> None:
    checkpoint = tmp_path / "other-model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"vocab_size": 514, "hidden_size": 128}))
    models = {"data": [{**MODELS["data"][0], "root": str(checkpoint)}]}
    url = server(Standin(models=models))
    shape = Expected.shape_of(tiny_model().config)
    with pytest.raises(
        EngineError,
        match=r"another model than this run's \(hidden_size 128, the trainer's 32\): start it with --model",
    ):
        VLLMServerEngine(
            VLLMSettings(urls=(url,)),
            weights_dir=tmp_path / "w",
            expected=dataclasses.replace(EXPECTED, shape=shape),
        )
    (checkpoint / "config.json").write_text(json.dumps(dict(shape)))  # the same shape: accepted
    VLLMServerEngine(
        VLLMSettings(urls=(url,)),
        weights_dir=tmp_path / "w",
        expected=dataclasses.replace(EXPECTED, shape=shape),
    )


# ----- LoRA as an adapter --------------------------------------------------------------------------------
# Each sync sends the adapter only (`POST /v1/load_lora_adapter` with a PEFT directory that loads back into
# the trainer's policy), unloads the previous one, and requests and the weight probe name the current adapter.


def _lora_policy() -> Any:
    from treetrain.models.lora import apply_lora
    from treetrain.models.lora_config import LoraSection

    model = apply_lora(tiny_model(dtype=torch.float32), LoraSection(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)  # as after training
    return model


def _recording(calls: list[tuple[str, dict]], code: int = 200) -> Answer:
    def answer(body: dict) -> tuple[int, bytes]:
        calls.append(("adapter", body))
        return code, json.dumps({} if code == 200 else {"detail": "runtime LoRA updating is off"}).encode()

    return answer


def test_a_lora_sync_sends_the_adapter_and_requests_name_it(
    server: Callable[..., str], tmp_path: Path
) -> None:
    from peft import PeftModel

    from treetrain.rollout.engines.adapter_sync import lora_serving

    model = _lora_policy()
    loads: list[tuple[str, dict]] = []
    unloads: list[tuple[str, dict]] = []
    asked: list[dict] = []

    def completions(body: dict) -> tuple[int, bytes]:
        asked.append(body)
        return good(body)

    standin = Standin(completions=completions, model=model.eval(),
                      posts={"/v1/load_lora_adapter": _recording(loads),
                             "/v1/unload_lora_adapter": _recording(unloads)})  # fmt: skip
    url = server(standin)
    engine = VLLMServerEngine(
        VLLMSettings(urls=(url,)), weights_dir=tmp_path, expected=EXPECTED, lora=lora_serving(model)
    )
    try:
        engine.sync_weights(model, 1)
        engine.sync_weights(model, 2)
        engine.submit(GenerationRequest((1, 2, 3), 1, 4, Sampling(temperature=1.0), ((2,),)))
        while engine.busy:
            engine.poll()
        served = Path(loads[-1][1]["lora_path"])
        loaded = PeftModel.from_pretrained(tiny_model(dtype=torch.float32), str(served))
    finally:
        engine.close()
    assert not served.exists()  # removed at close, once the server holds it
    assert standin.reloads == []  # the base weights are never sent
    assert [b["lora_name"] for _, b in loads] == ["treetrain-v1", "treetrain-v2"]
    assert [b for _, b in unloads] == [{"lora_name": "treetrain-v1"}]
    assert [b["model"] for b in asked] == ["treetrain-v2"]
    assert not Path(loads[0][1]["lora_path"]).exists()  # the previous version's files are gone
    ids = torch.tensor([[1, 5, 9, 40]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert engine.stats.sync_bytes < sum(p.numel() * 4 for p in model.get_base_model().parameters())


def test_a_server_without_runtime_lora_says_how_to_start_it(
    server: Callable[..., str], tmp_path: Path
) -> None:
    from treetrain.rollout.engines.adapter_sync import lora_serving

    model = _lora_policy()
    url = server(Standin(model=model.eval(), posts={"/v1/load_lora_adapter": _recording([], 404)}))
    engine = VLLMServerEngine(
        VLLMSettings(urls=(url,)), weights_dir=tmp_path, expected=EXPECTED, lora=lora_serving(model)
    )
    try:
        with pytest.raises(EngineError, match=r"404.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            engine.sync_weights(model, 1)
    finally:
        engine.close()
