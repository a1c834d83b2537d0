"""Responses state across gateway replicas: a conversation started on one replica continues on
the other (the session's graph runs two, on Redis), addressed one by one on their own ports."""

from __future__ import annotations

import openai
import pytest

from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import APP, tenant_key

pytestmark = pytest.mark.e2e

MODEL = "forge-sim"
KEY = tenant_key("agents")
OTHER_KEY = tenant_key("fuzz")


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_a_conversation_continues_on_the_other_gateway_replica(forge_url):
    replicas = replica_admin.direct_ingress_urls(APP)
    if len(replicas) < 2:
        pytest.skip("the graph runs one gateway replica (no Redis)")
    first, other = replicas[:2]
    with client(first) as one, client(other) as two, client(other, OTHER_KEY) as stranger:
        opening = one.responses.create(model=MODEL, input="Remember the word gateway.")
        follow = two.responses.create(
            model=MODEL, previous_response_id=opening.id, input="Which word?"
        )
        fetched = two.responses.retrieve(follow.id)
        unkept = one.responses.create(model=MODEL, input="Forget this.", store=False)
        with pytest.raises(openai.NotFoundError):
            stranger.responses.retrieve(opening.id)
        with pytest.raises(openai.NotFoundError):
            two.responses.retrieve(unkept.id)
        two.responses.delete(opening.id)
        with pytest.raises(openai.NotFoundError):
            one.responses.create(model=MODEL, previous_response_id=opening.id, input="Again?")
    # The follow-up's prompt held the opening turn: its input, the answer, then the question.
    assert follow.usage.input_tokens > opening.usage.input_tokens + opening.usage.output_tokens
    assert fetched.output_text == follow.output_text
