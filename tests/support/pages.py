"""The documentation pages' fenced blocks, as the docs tests read them."""

from __future__ import annotations

import re

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
"""A fenced block: its language (group 1, possibly empty) and its body (group 2)."""
