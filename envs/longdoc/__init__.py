"""Long document: find one fact in a document of N tokens, with a `read` tool for a span of its lines."""

from envs.longdoc.document import Document, make_document
from envs.longdoc.env import CitedCode, ExactCode, LongDocEnv, LongDocTask

__all__ = ["CitedCode", "Document", "ExactCode", "LongDocEnv", "LongDocTask", "make_document"]
