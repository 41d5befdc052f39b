"""URLs as printed (``tabcohort._urls``): a URL's password is never echoed."""

from __future__ import annotations

import pytest

from tabcohort._urls import redact_url


@pytest.mark.parametrize("url,shown", [
    ("http://user:pw@127.0.0.1:18199", "http://user:***@127.0.0.1:18199"),
    ("http://token@h:1", "http://***@h:1"),                  # (a user name alone may be a token)
    ("redis://:secret@r:6379/0", "redis://:***@r:6379/0"),
    ("http://u:p@[::1", "http://u:***@[::1"),                 # (urlsplit refuses it: redacted all the same)
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://h/path@x", "http://h/path@x"),                   # (an "@" in the path is not user information)
    ("127.0.0.1:8080", "127.0.0.1:8080"),
])
def test_the_user_information_of_a_url_is_hidden(url, shown):
    assert redact_url(url) == shown
