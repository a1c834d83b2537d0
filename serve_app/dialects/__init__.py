"""The public APIs spoken at the edge over chat completions inside: OpenAI's Responses API
(``responses.py``, with the stored responses ``previous_response_id`` continues, ``stored.py``)
and Anthropic's Messages API (``messages.py``); the seam they share is ``base.py``."""

from serve_app.dialects.base import Dialect
from serve_app.dialects.messages import MessagesDialect
from serve_app.dialects.responses import ResponsesDialect
from serve_app.dialects.stored import StoredResponses

__all__ = ["Dialect", "MessagesDialect", "ResponsesDialect", "StoredResponses"]
