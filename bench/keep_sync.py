"""A weight sync in the middle of long samples: vLLM's `/pause?mode=keep` against interrupt-and-resubmit.

Against a running `vllm serve` (`--url`, started with the command of docs/rollout-engines.md) on the wide
demo model. Each round streams one request of `--samples` samples from the context of a demo task, on the
trainer's weights v0. Once every sample has drawn `--drawn` tokens the trainer takes one AdamW step, writes
v1, and the server takes it in one of two ways:

- **interrupt** (what an asynchronous run does today): the stream is closed (vLLM aborts the request), the
  server reloads v1 and resets its prefix cache, and each sample is sent again as its context plus the
  tokens it drew, to draw the rest under v1;
- **keep**: `POST /pause?mode=keep` freezes the request with its KV cache, the server reloads v1 (no cache
  reset), `POST /resume`, and the same stream goes on.

Reported per method, as the median over `--rounds` rounds:

- the prompt tokens the server encoded again for the sync (`usage.prompt_tokens` less
  `prompt_tokens_details.cached_tokens` of the resubmitted requests; 0 when the stream goes on);
- the sync's seconds (stop to the first token after it);
- the sampler/trainer gap after the sync: |server logprob - trainer logprob under v1| of every token drawn
  after it, the trainer scoring the whole sequence under v1. Under `keep` a token after the sync is drawn
  on KV the old weights computed, which training under v1 does not reproduce: that is the gap it costs.

    python bench/keep_sync.py --url http://127.0.0.1:8000 --out bench/out/keep_sync.md
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from treetrain.benchmark.report import publish
from treetrain.rollout.engines.generation import GenerationRequest
from treetrain.rollout.engines.served_checkpoint import write_weights
from treetrain.rollout.engines.server_calls import call_server, fetch_text
from treetrain.rollout.engines.server_fleet import MAX_METRICS_BYTES
from treetrain.rollout.engines.server_stream import StreamedAnswer, stream_server
from treetrain.rollout.sampling import Sampling
from treetrain.train.models import WIDE_DEMO_MODEL

TIMEOUT = 120.0


@dataclass(frozen=True)
class Round:
    """One sync in the middle of one request's samples."""

    method: str
    reencoded: int
    """Prompt tokens the server encoded again for the sync."""
    seconds: float
    """From stopping the samples to the first token after the sync."""
    gap_after: float
    """Largest |server - trainer under v1| logprob of a token drawn after the sync."""
    gap_before: float
    """Largest |server - trainer under v0| logprob of a token drawn before it (the noise floor)."""
    gap_control: float
    """Largest |server - trainer under v0| logprob of a token drawn after the sync (the negative control:
    large when the sync changed the weights the tokens were drawn with)."""
    after: int
    """Tokens drawn after the sync."""
    preempted: int
    """Requests the server preempted during the round (`vllm:num_preemptions_total`): a preempted request's
    KV is freed and computed again when it runs on, by the server itself."""


def _context() -> list[int]:
    tok = AutoTokenizer.from_pretrained(WIDE_DEMO_MODEL)
    return list(tok.encode("<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n"))


def _reload(url: str, path: Path, reset: bool) -> None:
    answer = call_server(
        url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}, TIMEOUT
    )
    if not isinstance(answer, dict) or any(r is not None for r in answer.get("results", [0])):
        raise SystemExit(f"keep_sync: the reload of {path} was not confirmed: {answer!r:.200}")
    if reset:
        call_server(url, "/reset_prefix_cache", {}, TIMEOUT)


def _preemptions(url: str) -> int:
    text = fetch_text(url, "/metrics", TIMEOUT, MAX_METRICS_BYTES) or ""
    found = re.search(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


def _step(model: Any, context: list[int], tokens: list[int]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(torch.tensor([context + tokens])).logits[0, len(context) - 1 : -1]
    logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).sum().backward()
    optimizer.step()
    model.zero_grad()


@torch.no_grad()
def _gap(
    model: Any, context: list[int], tokens: list[int], logprobs: list[float], start: int, end: int
) -> float:
    """Largest |trainer - server| logprob over tokens[start:end], the trainer scoring the whole sequence."""
    if end <= start:
        return 0.0
    logp = model(torch.tensor([context + tokens])).logits[0, len(context) - 1 : -1].log_softmax(-1)
    own = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return float((own[start:end] - torch.tensor(logprobs[start:end])).abs().max())


def _body(served: str, prompt: list[int], n: int, max_tokens: int, seed: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": served, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
        "logprobs": 0, "ignore_eos": True, "skip_special_tokens": False, "return_token_ids": True,
    }  # fmt: skip
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _stream(url: str, body: dict[str, Any], request: GenerationRequest) -> tuple[StreamedAnswer, float]:
    """Stream `body` to the end: its answer, and when its first token came (`time.perf_counter`)."""
    answer, first = StreamedAnswer(request, 1), [0.0]

    def on_event(event: Any) -> bool:
        answer.add(event)
        if not first[0] and any(answer.tokens):
            first[0] = time.perf_counter()
        return True

    stream_server(url, "/v1/completions", body, TIMEOUT, on_event)
    return answer, first[0]


def one_round(url: str, served: str, method: str, args: argparse.Namespace, seed: int, work: Path) -> Round:
    context = _context()
    v0 = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL).eval()
    v1 = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL)
    _step(v1, context[:8], context[8:])  # the update the sync brings, ready before the samples start
    v1.eval()
    _reload(url, write_weights(v0, work, "v0"), reset=True)
    v1_path = write_weights(v1, work, "v1")
    preempted = _preemptions(url)
    request = GenerationRequest(tuple(context), args.samples, args.tokens, Sampling(), ((2,),))
    answer, lock, stop = StreamedAnswer(request, 0), threading.Lock(), threading.Event()

    def on_event(event: Any) -> bool:
        with lock:
            answer.add(event)
        return not stop.is_set()

    body = _body(served, context, args.samples, args.tokens, seed, stream=True)
    reader = threading.Thread(target=stream_server, args=(url, "/v1/completions", body, TIMEOUT, on_event))
    reader.start()
    while True:
        with lock:
            if min(len(t) for t in answer.tokens) >= args.drawn:
                break
        time.sleep(0.005)
    started = time.perf_counter()
    reencoded = 0
    if method == "keep":
        call_server(url, "/pause?mode=keep", {}, TIMEOUT)
        _reload(url, v1_path, reset=False)
        with lock:  # what arrived until now was drawn before the pause
            boundary = [len(t) for t in answer.tokens]
        call_server(url, "/resume", {}, TIMEOUT)
        while True:
            with lock:
                if any(len(t) > b for t, b in zip(answer.tokens, boundary)) or not reader.is_alive():
                    break
            time.sleep(0.001)
        seconds = time.perf_counter() - started
        reader.join()
        tokens, logprobs = answer.tokens, answer.logprobs
    else:
        stop.set()
        reader.join()  # the connection closed: vLLM aborts the request
        boundary = [len(t) for t in answer.tokens]
        _reload(url, v1_path, reset=True)
        tokens, logprobs, firsts = [], [], []
        for i, (drawn, lps) in enumerate(zip(answer.tokens, answer.logprobs)):
            rest = GenerationRequest(tuple(context + drawn), 1, args.tokens - len(drawn), Sampling(), ((2,),))
            body = _body(served, context + drawn, 1, args.tokens - len(drawn), seed + i + 1, stream=True)
            more, first = _stream(url, body, rest)
            firsts.append(first)
            usage = more.usage or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            reencoded += int(usage.get("prompt_tokens", 0)) - int(cached)
            tokens.append(drawn + more.tokens[0])
            logprobs.append(lps + more.logprobs[0])
        seconds = firsts[0] - started
    after = before = control = 0.0
    for t, lp, b in zip(tokens, logprobs, boundary):
        before = max(before, _gap(v0, context, t, lp, 0, b))
        after = max(after, _gap(v1, context, t, lp, b, len(t)))
        control = max(control, _gap(v0, context, t, lp, b, len(t)))
    drawn_after = sum(len(t) - b for t, b in zip(tokens, boundary))
    preempted = _preemptions(url) - preempted
    return Round(method, reencoded, seconds, after, before, control, drawn_after, preempted)


def report(rounds: list[Round], command: str) -> str:
    lines = [
        f"`{command}`: one sync in the middle of each request's samples, medians over the rounds",
        "",
        "| method | prompt tokens encoded again per sync | sync seconds | gap after the sync (max) | gap before it (max, the floor) | after the sync, scored under v0 (the control) | tokens after the sync | requests the server preempted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in ("interrupt", "keep"):
        mine = [r for r in rounds if r.method == method]
        med = statistics.median
        lines.append(
            f"| {method} | {med(r.reencoded for r in mine):.0f} | {med(r.seconds for r in mine):.3f} | "
            f"{med(r.gap_after for r in mine):.3g} | {med(r.gap_before for r in mine):.3g} | "
            f"{med(r.gap_control for r in mine):.3g} | {med(r.after for r in mine):.0f} | "
            f"{med(r.preempted for r in mine):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a running server's base URL (the docs' command)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--drawn", type=int, default=32, help="tokens each sample draws before the sync")
    parser.add_argument("--tokens", type=int, default=160, help="tokens each sample draws in all")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per method, in the order A B B A ...")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not 0 < args.drawn < args.tokens or args.samples < 1 or args.rounds < 1:
        print("keep_sync: 0 < --drawn < --tokens, --samples >= 1, --rounds >= 1", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    served = call_server(url, "/v1/models", None, TIMEOUT)["data"][0]["id"]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for method in ("interrupt", "keep") if r % 2 == 0 else ("keep", "interrupt"):
                done = one_round(url, served, method, args, 100 + r, Path(tmp))
                print(f"{method}: {done}", file=sys.stderr)
                rounds.append(done)
    command = "python bench/keep_sync.py " + " ".join(sys.argv[1:])
    publish(report(rounds, command.strip()), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
