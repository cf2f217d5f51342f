"""The in-process vLLM logs no false warnings: neither the chat-template warm-up (the engine has no
tokenizer, by design) nor `RotaryEmbedding: Failed to load weights` at a weight sync. Each is checked
with the filter in place and, as the negative control, with it removed (the warning then appears)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from transformers import LlamaForCausalLM

from treetrain.rollout.engines.vllm_logs import LOGGERS
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
    try:
        yield handler.messages
    finally:
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
