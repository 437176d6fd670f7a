"""OpenAI logprobs, echo and sampling controls through the gateway in front of
REAL services (float32 tiny Llama), read with the official `openai` client and
compared field by field with transformers in float32."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.cluster import hf_greedy
from tests.helpers.logprob_reference import LOGPROB_ATOL, position_logprobs, reference_greedy
from tests.helpers.procs import Cluster

WAIT_S = 60.0
PROMPT_IDS = [(37 * i + 11) % 700 + 4 for i in range(30)]
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
IGNORE_EOS = {"ignore_eos": True}
MODEL = "llama"  # the gateway's model id: the tiny checkpoint's directory name
pytestmark = pytest.mark.usefixtures("no_leak")  # after every test: idle, no block in use


@pytest.fixture(scope="module")
def token_text(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return lambda token_id: tokenizer.decode([token_id], clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(
        model_dir, ["--dtype", "float32", "--num-blocks", "96"], ["--max-model-len", "256"], gateway=True
    ) as c:
        yield c


def prompt_ids(grpc_client, prompt: str) -> list[int]:
    """The ids the scheduler computes for a text prompt (its prompt logprobs name them)."""
    out = grpc_client.generate(prompt, max_tokens=0, prompt_logprobs=0, timeout=WAIT_S)
    return [e.token_id for e in out.prompt_logprobs]


def assert_legacy_logprobs(logprobs, ids, reference, top_n, token_text, first_is_prompt=False):
    """/v1/completions' logprobs object for the tokens `ids`; reference row p scores ids[p]."""
    assert logprobs.tokens == [token_text(t) for t in ids]
    offsets = [sum(len(token_text(t)) for t in ids[:k]) for k in range(len(ids))]
    assert logprobs.text_offset == offsets
    for k, (token_id, logprob, top) in enumerate(zip(ids, logprobs.token_logprobs, logprobs.top_logprobs)):
        if first_is_prompt and k == 0:
            assert logprob is None and top is None
            continue
        row = reference[k]
        assert abs(logprob - row[token_id].item()) < LOGPROB_ATOL
        values, best = row.topk(top_n)
        expected: dict[str, float] = {}  # the most likely token keeps a text that several share
        for i, v in [*zip(best.tolist(), values.tolist()), (token_id, row[token_id].item())]:
            expected.setdefault(token_text(i), v)  # the chosen token is always there
        assert top.keys() == expected.keys()
        assert max(abs(top[key] - value) for key, value in expected.items()) < LOGPROB_ATOL


def test_completion_logprobs_equal_transformers(oai, model, token_text):
    done = oai.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=3, extra_body=IGNORE_EOS
    )
    [choice] = done.choices
    generated = hf_greedy(model, PROMPT_IDS, 6)
    reference = position_logprobs(model, PROMPT_IDS + generated)[len(PROMPT_IDS) - 1 :]
    assert_legacy_logprobs(choice.logprobs, generated, reference, 3, token_text)
    assert choice.text == "".join(choice.logprobs.tokens)


def test_echo_with_max_tokens_zero_scores_the_prompt(oai, model, token_text):
    """What lm-eval's loglikelihood requests look like."""
    done = oai.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=1, temperature=0)
    [choice] = done.choices
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 0
    assert choice.text == "".join(token_text(t) for t in PROMPT_IDS)
    reference = position_logprobs(model, PROMPT_IDS)
    shifted = [None, *reference[:-1]]  # prompt token p is scored at position p - 1
    assert_legacy_logprobs(choice.logprobs, PROMPT_IDS, shifted, 1, token_text, first_is_prompt=True)


def test_echo_of_a_text_prompt_with_a_completion(oai, grpc_client, model, token_text):
    ids = prompt_ids(grpc_client, PROMPT_TEXT)
    done = oai.completions.create(
        model=MODEL, prompt=PROMPT_TEXT, max_tokens=5, echo=True, logprobs=2, temperature=0, extra_body=IGNORE_EOS
    )
    [choice] = done.choices
    generated = hf_greedy(model, ids, 5)
    plain = oai.completions.create(model=MODEL, prompt=PROMPT_TEXT, max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    assert choice.text == PROMPT_TEXT + plain.choices[0].text
    reference = position_logprobs(model, ids + generated)
    assert_legacy_logprobs(choice.logprobs, ids + generated, [None, *reference], 2, token_text, first_is_prompt=True)
    # Without logprobs: the same text, no logprobs object.
    bare = oai.completions.create(
        model=MODEL, prompt=PROMPT_TEXT, max_tokens=5, echo=True, temperature=0, extra_body=IGNORE_EOS
    )
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_equal_the_whole_response(oai, echo):
    params = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, temperature=0, logprobs=2, echo=echo)
    whole = oai.completions.create(**params, extra_body=IGNORE_EOS).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(**params, stream=True, extra_body=IGNORE_EOS)]
    assert "".join(c.text for c in chunks) == whole.text
    pieces = [c.logprobs for c in chunks if c.logprobs is not None]
    assert len(pieces) > 1
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in pieces for x in getattr(p, name)] == getattr(whole.logprobs, name), name


def test_chat_logprobs_equal_transformers(oai, grpc_client, model, token_text, model_dir):
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    ids = prompt_ids(grpc_client, rendered)
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    done = oai.chat.completions.create(**params, extra_body=IGNORE_EOS)
    content = done.choices[0].logprobs.content
    generated = hf_greedy(model, ids, 6)
    reference = position_logprobs(model, ids + generated)[len(ids) - 1 :]
    assert [e.token for e in content] == [token_text(t) for t in generated]
    for entry, token_id, row in zip(content, generated, reference):
        assert abs(entry.logprob - row[token_id].item()) < LOGPROB_ATOL
        assert entry.bytes == list(entry.token.encode())
        values, best = row.topk(2)
        assert [t.token for t in entry.top_logprobs] == [token_text(i) for i in best.tolist()]
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, values.tolist())) < LOGPROB_ATOL
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    streamed = oai.chat.completions.create(**params, stream=True, extra_body=IGNORE_EOS)
    entries = [
        e
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in content]
    # logprobs false: none.
    assert oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].logprobs is None


CONTROLS = {
    "frequency_penalty": 1.0,
    "presence_penalty": 1.5,
    "logit_bias": {"100": 10.0},
    "seed": 3,
}
EXTRA = {"repetition_penalty": 1.5, "min_tokens": 4, "stop_token_ids": [2]}


def test_sampling_controls_pass_through(oai, grpc_client, model):
    want = grpc_client.generate(
        prompt_token_ids=PROMPT_IDS,
        max_tokens=10,
        temperature=0.0,
        frequency_penalty=1.0,
        presence_penalty=1.5,
        logit_bias={100: 10.0},
        seed=3,
        repetition_penalty=1.5,
        min_tokens=4,
        stop_token_ids=[2],
        logprobs=0,
        timeout=WAIT_S,
    )
    reference, _ = reference_greedy(
        model,
        PROMPT_IDS,
        10,
        eos_ids=[2],
        presence=1.5,
        frequency=1.0,
        repetition=1.5,
        logit_bias={100: 10.0},
        min_tokens=4,
        stop_token_ids=[2],
    )
    assert want.token_ids == reference
    done = oai.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=10, temperature=0, logprobs=0, extra_body=EXTRA, **CONTROLS
    )
    assert done.choices[0].text == want.text and done.choices[0].finish_reason == want.finish_reason
    assert done.choices[0].logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-6)
    plain = oai.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=10, temperature=0)
    assert plain.choices[0].text != done.choices[0].text


def test_chat_passes_the_controls_too(oai):
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={**EXTRA, **IGNORE_EOS})
    controlled = oai.chat.completions.create(**params, **CONTROLS).choices[0].message.content
    again = oai.chat.completions.create(**params, **CONTROLS).choices[0].message.content
    plain = oai.chat.completions.create(**params).choices[0].message.content
    assert controlled == again and controlled != plain


@pytest.mark.parametrize(
    "params, param",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
        ({"logit_bias": {"5": -101}}, "logit_bias.5"),
        ({"extra_body": {"repetition_penalty": 3}}, "repetition_penalty"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(oai, params, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=PROMPT_IDS, **params)
    assert err.value.body["param"] == param, err.value.body


def test_token_ids_outside_the_vocabulary_are_400_with_the_schedulers_message(oai):
    with pytest.raises(openai.BadRequestError, match="logit_bias: token id 100000 is outside the vocabulary"):
        oai.completions.create(model=MODEL, prompt=PROMPT_IDS, logit_bias={"100000": 1.0})
    with pytest.raises(openai.BadRequestError, match="stop_token_ids: token id 9999"):
        oai.completions.create(model=MODEL, prompt=PROMPT_IDS, extra_body={"stop_token_ids": [9999]})
