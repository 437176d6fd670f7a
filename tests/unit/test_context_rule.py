"""The context rule, decided once (scheduler_svc/planning/validation.py) and applied
to every serving.v1 request, so to the gateway's too: prompt + max_tokens must fit
in max_model_len (vLLM's 400 naming the maximum context length); an unset
max_tokens means up to the context, within --default-max-tokens when set."""

from __future__ import annotations

import pytest

from scheduler_svc.planning.validation import RequestRejected, default_output_limit, output_limit


def test_an_explicit_max_tokens_must_fit_beside_the_prompt():
    assert output_limit(100, 156, 256) == 100  # exactly full
    with pytest.raises(RequestRejected) as err:
        output_limit(101, 156, 256)
    assert err.value.field == "max_tokens"
    assert "maximum context length is 256 tokens" in err.value.message and "257" in err.value.message
    with pytest.raises(RequestRejected):
        output_limit(2**31 - 1, 5, 256)  # "no limit" by a huge number is refused, as vLLM does


def test_unset_max_tokens_means_up_to_the_context():
    assert output_limit(None, 56, 256) == 200
    assert output_limit(None, 56, 256, default=16) == 16
    assert output_limit(None, 250, 256, default=16) == 6  # the default never makes a request fail
    with pytest.raises(RequestRejected) as err:
        output_limit(None, 256, 256)
    assert err.value.field == "prompt" and "maximum context length is 256 tokens" in err.value.message


def test_a_requests_default_caps_an_unset_max_tokens_within_the_schedulers():
    """A gateway's --default-max-tokens (serving.v1 default_max_tokens, issue 35): the smaller
    of it and the scheduler's own wins, and neither makes a request fail for its context."""
    assert default_output_limit(0, None) == 0
    assert default_output_limit(0, 64) == 64
    assert default_output_limit(16, 64) == 16 and default_output_limit(64, 16) == 16
    assert output_limit(None, 250, 256, default=default_output_limit(0, 64)) == 6
    with pytest.raises(RequestRejected) as err:
        default_output_limit(16, 0)
    assert err.value.field == "default_max_tokens"
