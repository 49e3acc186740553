"""Machine-generated bad input (hypothesis) against a real uvicorn server on loopback (tiny
random-init model, TP=2, equarx-int8): request bodies built field by field from well-formed,
out-of-range and wrongly typed values (huge and negative integers, NaN and infinities, lone
surrogates, nested junk, unknown and unsupported fields), streamed or not, and raw bytes.
Every answer must be a 200 with a well-formed completion or stream, or a 4xx with OpenAI's
error shape; never a 5xx; afterwards the server is healthy with nothing in flight. Bounded:
a fixed number of cases per test (hypothesis draws anew each run, so runs add up to more);
EQUARX_HYPOTHESIS_PROFILE=explore runs 10x as many. Each test prints how many ran, by status."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator

import httpx
import pytest
from _serving import gated_generator, metric, serving, sse_events, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.server import create_app
from equarx_serve.server.settings import HTTPSettings

MODEL = "tiny"
# As the engines of server_test.py and server_hardening_test.py: the same programs, so each is
# compiled once per session (the compilation cache in conftest.py).
MAX_LENGTH = 256
MAX_PROMPT = 64
BODY_LIMIT = 16 << 10
# Cases per test, sized for `make test`; the "explore" profile (named as in
# allreduce_property_test.py) draws 10x as many.
SCALE = 10 if os.environ.get("EQUARX_HYPOTHESIS_PROFILE") == "explore" else 1
CASES = {"completions": 80 * SCALE, "chat": 50 * SCALE, "raw": 60 * SCALE}
ALLOWED = {200, 400, 404, 413}

FUZZ = settings(
    deadline=None,
    database=None,  # nothing written to the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Server:
    def __init__(self, url: str, app):
        self.url, self.app = url, app
        self.client = httpx.Client(base_url=url, timeout=60)
        self.statuses: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = PrefillEngine.from_name(MODEL, 2, "equarx-int8", max_length=MAX_LENGTH)
    http = HTTPSettings(max_body_bytes=BODY_LIMIT)
    app = create_app(
        gated_generator(engine),
        model_name=MODEL,
        max_prompt_tokens=MAX_PROMPT,
        default_max_tokens=4,  # a chat request without max_tokens stays short
        http=http,
    )
    with serving(app, http) as url:
        yield Server(url, app)


@pytest.fixture
def report(server, capsys):
    """Clears the status counts; after the test, checks the server and prints the counts."""
    server.statuses.clear()
    yield server.statuses
    assert server.client.get("/health").status_code == 200
    wait_until(lambda: metric(server.client.get("/metrics").text, "equarx_requests_in_flight") == 0)
    with capsys.disabled():
        counts = ", ".join(f"{status}: {n}" for status, n in sorted(server.statuses.items()))
        print(f"\n  {sum(server.statuses.values())} generated requests ({counts})")


# -- values -------------------------------------------------------------------------------------
surrogates = st.characters(categories=["Cs"]).map(lambda c: f"a{c}")
texts = st.text(max_size=40) | surrogates | st.sampled_from(["", " ", "<end_of_turn>", "\x00"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**31, 2**63, 2**64 + 1, -(2**70), 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


VOCAB = 512  # the tiny model's
plain_text = st.text(min_size=1, max_size=30)
ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
message = st.fixed_dictionaries(
    {"role": st.just("user"), "content": plain_text},
)
# Per field: (values a client may send, values it must be refused for). Junk of any JSON type
# is refused for every field.
COMMON = {
    "max_tokens": (st.integers(1, 4), st.integers(max_value=0) | st.integers(min_value=10**6)),
    "temperature": (st.floats(0, 2), st.floats(2.0001) | st.floats(max_value=-0.0001)),
    "top_p": (st.floats(0.0001, 1), st.floats(max_value=0) | st.floats(1.0001)),
    "top_k": (st.integers(1, 300) | st.sampled_from([2**31, 2**63 - 1]), st.integers(max_value=0)),
    "seed": (st.integers() | st.sampled_from([2**64 + 1, -(2**70)]), st.floats()),
    "stop": (plain_text | st.lists(plain_text, max_size=4), st.lists(plain_text, min_size=5)),
    "stream": (st.booleans(), st.sampled_from(["true", 1])),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), texts),
    "n": (st.just(1), st.integers(2, 5) | st.integers(max_value=0)),
    "model": (st.just(MODEL), texts),
    "logprobs": (st.sampled_from([None, False, 0]), st.integers(1, 5)),
    "user": (junk, st.nothing()),
}
COMPLETION = COMMON | {
    "prompt": (
        plain_text | ids | st.lists(plain_text, min_size=1, max_size=3),
        st.sampled_from(["", [], [""], [[]]]) | st.lists(st.integers(VOCAB), min_size=1),
    ),
}
CHAT = COMMON | {
    "messages": (
        st.lists(message, min_size=1, max_size=1),
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["tool", "assistant"]), "content": texts}
            ),
            max_size=3,
        ),
    ),
    "max_completion_tokens": COMMON["max_tokens"],
}


@st.composite
def bodies(draw, fields: dict, required: str) -> object:
    """A valid body, one with one field refused, or any JSON value."""
    good = {name: ok for name, (ok, _) in fields.items()}
    body = draw(st.fixed_dictionaries({required: good.pop(required)}, optional=good))
    kind = draw(st.sampled_from(["valid", "valid", "one bad field", "junk"]))
    if kind == "one bad field":
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(fields[name][1] | junk)
    return draw(junk) if kind == "junk" else body


# -- checks -------------------------------------------------------------------------------------
def check_answer(server: Server, path: str, body: bytes) -> None:
    with server.client.stream(
        "POST", path, content=body, headers={"content-type": "application/json"}
    ) as r:
        text = r.read().decode()
    server.statuses[r.status_code] += 1
    assert r.status_code in ALLOWED, (r.status_code, text, body[:300])
    if r.status_code != 200:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(text)
        assert events[-1] == "[DONE]"
        assert all("error" not in event for event in events[:-1]), events
    else:
        answer = json.loads(text)
        # A completion may be empty: the first sampled token can end it (EOS, a stop string).
        assert answer["choices"]
        assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
        usage = answer["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # lone surrogates escaped as \udXXX


@settings(FUZZ, max_examples=CASES["completions"])
@given(body=bodies(COMPLETION, "prompt"))
def test_generated_completion_requests(server, report, body):
    check_answer(server, "/v1/completions", encode(body))


@settings(FUZZ, max_examples=CASES["chat"])
@given(body=bodies(CHAT, "messages"))
def test_generated_chat_requests(server, report, body):
    check_answer(server, "/v1/chat/completions", encode(body))


@settings(FUZZ, max_examples=CASES["raw"])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.binary(max_size=200)
    | st.integers(BODY_LIMIT + 1, 4 * BODY_LIMIT).map(lambda size: b"{" * size),
)
def test_generated_raw_bodies(server, report, path, body):
    check_answer(server, path, body)
