"""vLLM logs only its errors unless asked for more (`quiet_vllm_logs`), and the in-process vLLM logs no
false warnings even at `VLLM_LOGGING_LEVEL=WARNING`: neither the chat-template warm-up (the engine has no
tokenizer, by design) nor `RotaryEmbedding: Failed to load weights` at a weight sync. Each is checked
with the filter in place and, as the negative control, with it removed (the warning then appears)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from transformers import LlamaForCausalLM

from treetrain.rollout.engines.vllm_logs import LOGGERS, quiet_vllm_logs
from treetrain.train.models import WIDE_DEMO_MODEL


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _logged(name: str, *, filtered: bool) -> Iterator[list[str]]:
    """The messages `name` emits inside the block, with its filters in place or removed."""
    logger, handler = logging.getLogger(name), _Records()
    removed = [] if filtered else list(logger.filters)
    for f in removed:
        logger.removeFilter(f)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING)  # as with VLLM_LOGGING_LEVEL=WARNING: the level a filter matters at
    try:
        yield handler.messages
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)
        for f in removed:
            logger.addFilter(f)


def _both(name: str, action: Callable[[], None], message: str) -> None:
    with _logged(name, filtered=True) as kept:
        action()
    with _logged(name, filtered=False) as unfiltered:
        action()
    assert not [m for m in kept if message in m], kept
    assert [m for m in unfiltered if message in m], unfiltered  # the check can fail


def test_a_weight_sync_logs_no_rotary_warning(vllm_engine: Any) -> None:
    model = LlamaForCausalLM.from_pretrained(WIDE_DEMO_MODEL)
    _both(
        LOGGERS[1],
        lambda: vllm_engine.sync_weights(model, vllm_engine.version + 1),
        "RotaryEmbedding: Failed to load weights",
    )


def test_the_chat_template_warmup_logs_nothing(vllm_engine: Any) -> None:
    from vllm.renderers import ChatParams

    llm = vllm_engine.llm
    _both(
        LOGGERS[0],
        lambda: llm.renderer.warmup(ChatParams(chat_template=llm.chat_template)),
        "Chat template warmup failed",
    )


def test_vllm_logs_only_its_errors_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before vLLM is imported its loggers propagate to the run's own, so its start-up notes (Triton's CPU
    backend, drivers found) and deprecation warnings came out as the run's lines; `quiet_vllm_logs` keeps
    its errors only. The control: `VLLM_LOGGING_LEVEL=WARNING` brings its warnings back."""
    base, child = logging.getLogger("vllm"), logging.getLogger("vllm.triton_utils.importing")
    handler, before = _Records(), base.level
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")  # recorded, so the process's own value comes back
    base.addHandler(handler)
    try:
        for asked, kept in ((None, ["an error"]), ("WARNING", ["Triton has no CPU backend", "an error"])):
            if asked is None:
                monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
            else:
                monkeypatch.setenv("VLLM_LOGGING_LEVEL", asked)
            handler.messages.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                quiet_vllm_logs()
                for module in ("vllm.triton_utils.dispatcher", "treetrain.elsewhere"):
                    warnings.warn_explicit(f"deprecated in {module}", FutureWarning, "f.py", 1, module=module)
                child.info("Triton not installed or not compatible")
                child.warning("Triton has no CPU backend")
                child.error("an error")
            assert handler.messages == kept, asked
            assert [str(w.message) for w in caught] == ["deprecated in treetrain.elsewhere"]  # ours stay
    finally:
        base.removeHandler(handler)
        base.setLevel(before)
