"""vLLM's log noise, quieted: its loggers at ERROR, its Python warnings off, and two false warnings dropped.

**Level.** Before vLLM is imported, `quiet_vllm_logs` sets `VLLM_LOGGING_LEVEL` to `ERROR` (unless the user
set it: `VLLM_LOGGING_LEVEL=WARNING` brings vLLM's warnings back) and the `vllm` logger to that level. Until
an engine starts, vLLM's loggers propagate to the root logger, so its import-time lines (Triton's CPU
backend, drivers found) came out as the run's own; at the start vLLM configures its handler with the same
level. What is left are errors, which a user can act on; the start-up notes and deprecation warnings of a
library that works are not. Its `FutureWarning`s and `DeprecationWarning`s (from `vllm.*` modules only) are
ignored the same way.

Two of vLLM's warnings are also false for the in-process engine, dropped where vLLM logs them (they matter
at `VLLM_LOGGING_LEVEL=WARNING`):

- **`Chat template warmup failed`** (with a traceback), once at start: `vllm.LLM` always renders a warm-up
  chat message, and the engine starts it with `skip_tokenizer_init=True` (token ids in and out, nothing is
  rendered or detokenized by vLLM), so there is no tokenizer to render with. The template is never used.
- **`RotaryEmbedding: Failed to load weights`**, once per layer at every weight sync: vLLM's in-place
  reload counts a rotary embedding's `cos_sin_cache` buffer as a weight to load, finds none in the update
  (no checkpoint has one: it is computed from the config), and puts the unchanged buffer back.

Only these records are dropped: a failure to load any other layer's weights is still a warning, since it
would mean the engine samples from weights other than the trainer's.

Example:
    >>> import logging
    >>> record = logging.LogRecord("x", logging.WARNING, "", 0, "%s: Failed to load weights", ("Linear",), None)
    >>> KnownFalseWarnings().filter(record)
    True
    >>> record.args = ("Llama3RotaryEmbedding",)
    >>> KnownFalseWarnings().filter(record)
    False
"""

from __future__ import annotations

import logging
import os
import warnings

QUIET_LEVEL = "ERROR"
"""vLLM's log level unless `VLLM_LOGGING_LEVEL` says otherwise."""
LOGGERS = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")
"""Where vLLM logs the two warnings."""


class KnownFalseWarnings(logging.Filter):
    """Drops the two records of the module docstring, and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Chat template warmup failed":
            return False
        if record.msg == "%s: Failed to load weights" and isinstance(record.args, tuple) and record.args:
            return "RotaryEmbedding" not in str(record.args[0])
        return True


def quiet_known_false_warnings() -> None:
    """Install the filter on vLLM's two loggers (once; idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownFalseWarnings) for f in logger.filters):
            logger.addFilter(KnownFalseWarnings())


def quiet_vllm_logs() -> None:
    """Before vLLM is imported: its loggers at `VLLM_LOGGING_LEVEL` (default `QUIET_LEVEL`), its Python
    warnings of deprecation ignored, and the two false warnings filtered."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", QUIET_LEVEL).upper()
    if isinstance(logging.getLevelName(level), int):  # a name vLLM itself would refuse is left to vLLM
        logging.getLogger("vllm").setLevel(level)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"vllm(\.|$)")
    quiet_known_false_warnings()
