"""A corpus of hostile inputs of our own making, for the CLI fuzz tests: corrupt tree files (truncation,
byte flips, type swaps, huge headers, non-finite rewards, duplicates, not msgpack at all), valid tree
files with out-of-range token ids, and hostile JSONL for `treetrain import`."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from support.tree_samples import TINY_BYTES, first_tree, tiny_doc
from treetrain.tree.format import TreeFormatError, trees_from_bytes


def _pack(doc: Any) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _edit(mutate: Callable[[dict[str, Any]], None]) -> bytes:
    doc = tiny_doc()
    mutate(doc)
    return _pack(doc)


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        target: Any = first_tree(doc)
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    return mutate


def _drop_ids(doc: dict[str, Any]) -> None:
    first_tree(doc).pop("id")
    for node in first_tree(doc)["nodes"]:
        node.pop("id")


def _token(value: int) -> Callable[[dict[str, Any]], None]:
    """Replace the last token of the last node (a leaf) with `value`; ids are recomputed on load."""

    def mutate(doc: dict[str, Any]) -> None:
        _drop_ids(doc)
        node = first_tree(doc)["nodes"][-1]
        tokens = np.frombuffer(node["tokens"], dtype="<u4").copy()
        tokens[-1] = value
        node["tokens"] = tokens.tobytes()

    return mutate


def _is_corrupt(blob: bytes) -> bool:
    try:
        trees_from_bytes(blob)
    except TreeFormatError:
        return True
    return False


def corrupt_tree_files() -> dict[str, bytes]:
    """Bytes that no reader may accept: each must be refused by every verb that reads tree files."""
    n = len(TINY_BYTES)
    out: dict[str, bytes] = {f"truncated at {k}": TINY_BYTES[:k] for k in (0, 1, n // 4, n // 2, n - 1)}
    rng = random.Random(0)
    for k in range(40):
        blob = bytearray(TINY_BYTES)
        for _ in range(1 + k % 3):
            blob[rng.randrange(n)] ^= 1 << rng.randrange(8)
        out[f"byte flips {k}"] = bytes(blob)
    swaps: dict[str, tuple[str, object]] = {
        "reward as str": ("trajectories.0.reward", "1"),
        "nodes as map": ("nodes", {}),
        "trajectories as int": ("trajectories", 42),
        "tokens as array": ("nodes.1.tokens", [11, 12, 13, 21]),
        "parent as str": ("nodes.2.parent", "1"),
        "calls as nil": ("trajectories.0.calls", None),
        "segment length float": ("trajectories.1.calls.0.segment_lengths", [1.5, 3.5]),
        "extra as array": ("trajectories.0.meta.extra", [1]),
        "seed as float": ("trajectories.0.meta.seed", 1.5),
        "nan reward": ("trajectories.0.reward", math.nan),
        "inf reward": ("trajectories.1.reward", math.inf),
        "-inf reward": ("trajectories.2.reward", -math.inf),
        "nan step reward": ("trajectories.0.step_rewards", [math.nan, 1.0]),
        "nan logprob": ("trajectories.0.calls.0.logprobs.1", np.float64(math.nan).tobytes()),
        "duplicate trajectory id": ("trajectories.1.id", "a"),
        "huge parent": ("nodes.2.parent", 2**64 - 1),
    }
    for name, (path, value) in swaps.items():
        out[name] = _edit(_set(path, value))
    out["version as str"] = _edit(lambda d: d.update(version="1"))
    out["group holding one tree twice"] = _edit(lambda d: d["trees"].append(copy.deepcopy(d["trees"][0])))
    out["array32 header of 2**32-1"] = b"\xdd\xff\xff\xff\xff"
    out["map32 header of 2**32-1"] = b"\xdf\xff\xff\xff\xff"
    out["str32 header of 2**32-1"] = b"\xdb\xff\xff\xff\xff" + b"x" * 16
    out["bin32 token header"] = TINY_BYTES.replace(b"\xc4\x10", b"\xc6\xff\xff\xff\xf0", 1)
    out["trees array32 claims 2**31"] = _pack({"format": "treetrain.tree", "version": 1})[:-1] + (
        b"\xa5trees\xdd\x80\x00\x00\x00"
    )
    out["nested 100000 deep"] = b"\x91" * 100_000 + b"\xc0"
    out["ext type"] = msgpack.packb(msgpack.ExtType(5, b"abc"))
    out["json text"] = json.dumps({"format": "treetrain.tree", "version": 1, "trees": []}).encode()
    out["random bytes"] = random.Random(1).randbytes(1024)
    out["trailing bytes"] = TINY_BYTES + b"\x00"
    corrupt = {name: blob for name, blob in out.items() if _is_corrupt(blob)}
    assert len(corrupt) >= 60, f"the corpus lost too many cases to valid mutations: {len(corrupt)}"
    return corrupt


def out_of_range_tree_files() -> dict[str, tuple[bytes, int]]:
    """Valid tree files whose token ids no small model has: (bytes, the id)."""
    return {f"token id {value}": (_edit(_token(value)), value) for value in (0xFFFFFFFF, 10**7, 1 << 20)}


def _line(**changes: Any) -> str:
    row: dict[str, Any] = {
        "trajectory_id": "t0", "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5],
        "response_logprobs": [-0.5, -1.0], "reward": 1.0,
    }  # fmt: skip
    row.update(changes)
    return json.dumps({k: v for k, v in row.items() if v is not ...})


def hostile_jsonl() -> dict[str, bytes]:
    """JSONL files `treetrain import` must refuse in one line, writing nothing."""
    good = _line()
    base = '{"trajectory_id":"t","prompt_token_ids":[1],"response_token_ids":[2],"reward":'
    cases: dict[str, str | bytes] = {
        "5000-digit token": base.replace("[2]", "[" + "9" * 5000 + "]") + "1}",
        "5000-digit reward": base + "9" * 5000 + "}",
        "400-digit reward": base + "9" * 400 + "}",
        "400-digit float reward": base + "9" * 400 + ".5}",
        "lone surrogate id": base.replace('"t"', '"\\ud800"') + "1}",
        "lone surrogate metadata key": base + '1,"metadata":{"\\udc80":"x"}}',
        "deeply nested metadata": base + '1,"metadata":{"a":' + "[" * 100_000 + "]" * 100_000 + "}}",
        "2 MiB trajectory id": _line(trajectory_id="x" * (2 << 20)),
        "2 MiB metadata value": _line(metadata={"k": "v" * (2 << 20)}),
        "70,000 metadata keys": _line(metadata={f"k{i}": "v" for i in range(70_000)}),
        "NaN reward": base + "NaN}",
        "Infinity reward": base + "Infinity}",
        "-Infinity step reward": _line(step_rewards=[1.0]).replace("[1.0]", "[-Infinity]"),
        "NaN logprob": _line(response_logprobs=[-0.5, 0.0]).replace("0.0]", "NaN]"),
        "positive logprob": _line(response_logprobs=[-0.5, 0.5]),
        "logprob count": _line(response_logprobs=[-0.5]),
        "token id 2**32": _line(response_token_ids=[4, 2**32]),
        "negative token": _line(prompt_token_ids=[-1, 2]),
        "float token": _line(prompt_token_ids=[1.5]),
        "bool token": _line(prompt_token_ids=[True]),
        "tokens as str": _line(prompt_token_ids="abc"),
        "empty tokens": _line(response_token_ids=[]),
        "id as int": _line(trajectory_id=5),
        "empty id": _line(trajectory_id=""),
        "reward as str": _line(reward="1"),
        "no reward": _line(reward=...),
        "metadata as list": _line(metadata=[1]),
        "messages as object": _line(messages={}),
        "segments of ints": _line(
            prompt_token_ids=..., response_token_ids=..., response_logprobs=..., segments=[1]
        ),
        "unknown role": _line(
            prompt_token_ids=...,
            response_token_ids=...,
            response_logprobs=...,
            segments=[{"role": "system", "token_ids": [1]}],
        ),
        "unknown field": _line(colour="red"),
        "call_index -1": _line(call_index=-1),
        "seed 2**70": _line(seed=2**70),
        "truncated line": good[: len(good) // 2],
        "array line": "[1, 2, 3]",
        "null line": "null",
        "conflicting rewards": good + "\n" + _line(reward=0.0),
        "duplicate call_index": good + "\n" + good,
        "empty file": "",
        "only blank lines": "\n\n  \n",
        "not UTF-8": good.encode()[:10] + b"\xff\xfe" + good.encode()[10:],
        "duplicate key reward": good[:-1] + ', "reward": 0.0}',
        "duplicate key trajectory_id": good[:-1] + ', "trajectory_id": "t1"}',
        "duplicate metadata key": _line(metadata={"k": "1"})[:-2] + ', "k": "2"}}',
        "duplicate segment key": _line(
            prompt_token_ids=...,
            response_token_ids=...,
            response_logprobs=...,
            segments=[{"role": "prompt", "token_ids": [1]}, {"role": "policy", "token_ids": [2]}],
        ).replace('"token_ids": [2]', '"token_ids": [2], "token_ids": [3]'),
    }
    return {name: text if isinstance(text, bytes) else (text + "\n").encode() for name, text in cases.items()}


def hostile_task_files() -> dict[str, bytes]:
    """JSONL task files the dataset environment must refuse in one line naming the file and the row: each
    second row is hostile (non-finite numbers anywhere, wrong shapes), the first a good one."""
    good = json.dumps({"prompt": "What is 1 + 1?", "answer": "2"})
    rows = {
        "NaN answer": '{"prompt": "x", "answer": NaN}',
        "Infinity answer": '{"prompt": "x", "answer": Infinity}',
        "-Infinity answer": '{"prompt": "x", "answer": -Infinity}',
        "1e999 answer": '{"prompt": "x", "answer": 1e999}',
        "-1e999 answer": '{"prompt": "x", "answer": -1e999}',
        "NaN in another field": '{"prompt": "x", "answer": 1, "weight": NaN}',
        "Infinity nested in a list": '{"prompt": "x", "answer": 1, "meta": {"w": [1, 2, Infinity]}}',
        "answer as a list": '{"prompt": "x", "answer": [1]}',
        "answer as bool": '{"prompt": "x", "answer": true}',
        "no answer": '{"prompt": "x"}',
        "empty prompt": '{"prompt": "", "answer": 1}',
        "prompt as number": '{"prompt": 5, "answer": 1}',
        "assistant opening": '{"messages": [{"role": "assistant", "content": "x"}], "answer": 1}',
        "not JSON": '{"prompt": "x", "answer": ',
        "a JSON list": "[1, 2]",
    }
    return {name: f"{good}\n{row}\n".encode() for name, row in rows.items()}


def damaged_weights(good: bytes, other: bytes) -> dict[str, bytes]:
    """Safetensors files that must never be loaded as a checkpoint's weights, made from a good file (`good`)
    and another model's (`other`): cut anywhere, overwritten, a header that lies about its length or its
    byte ranges, and the other model's tensors under the same names."""
    size = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + size])
    first = next(k for k in header if k != "__metadata__")
    past_end = copy.deepcopy(header)
    past_end[first]["data_offsets"][1] += 1 << 20
    lying = json.dumps(past_end).encode()
    cases = {
        f"cut at {k}": good[:k] for k in (0, 7, 8, 8 + size // 2, 8 + size, len(good) // 2, len(good) - 1)
    }
    cases.update(
        {
            "random bytes": random.Random(2).randbytes(len(good)),
            "header length 2**63": (1 << 63).to_bytes(8, "little") + good[8:],
            "header length past the end": (len(good) + 1).to_bytes(8, "little") + good[8:],
            "header not JSON": len(b"{nope").to_bytes(8, "little") + b"{nope" + good[8 + size :],
            "offsets past the end": len(lying).to_bytes(8, "little") + lying + good[8 + size :],
            "one byte more": good + b"\x00",
            "another model's weights": other,
        }
    )
    return cases
