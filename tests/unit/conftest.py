"""Fixtures the gateway's unit tests share: the fake serving.v1 scheduler
(tests/helpers/fake_scheduler.py), one per module, reset before each test that uses it."""

from __future__ import annotations

import pytest

from tests.helpers.fake_scheduler import serve_fake_scheduler


@pytest.fixture(scope="module")
def fake_scheduler():
    with serve_fake_scheduler() as servicer:
        yield servicer


@pytest.fixture(autouse=True)
def _fresh_fake(request):
    if "fake_scheduler" in request.fixturenames:
        request.getfixturevalue("fake_scheduler").reset()
