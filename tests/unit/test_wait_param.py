"""`?wait=S` / `Prefer: wait=S`: how long a caller may wait, and a 400 that says what is wrong otherwise."""

from __future__ import annotations

import pytest

from gateway.api import ApiRequest, BadRequest
from gateway.parsing import parse_wait


def wait_of(query: str | None = None, prefer: str | None = None, cap: float = 60.0) -> float:
    req = ApiRequest("GET", "/v1/requests/x", query={"wait": query} if query is not None else {},
                     headers={"prefer": prefer} if prefer is not None else {})
    return parse_wait(req, cap)


@pytest.mark.parametrize("query, prefer, expected", [
    (None, None, 0.0), ("0", None, 0.0), ("2.5", None, 2.5), ("600", None, 60.0), ("1e3", None, 60.0),
    (None, "wait=7", 7.0), (None, 'respond-async, wait="3"', 3.0), ("4", "wait=9", 4.0),
])
def test_a_wait_is_its_seconds_capped_at_the_gateways_maximum(query, prefer, expected):
    assert wait_of(query, prefer) == expected


@pytest.mark.parametrize("query, says", [
    ("abc", "a number of seconds"), ("", "a number of seconds"), ("inf", "finite"), ("-inf", "finite"),
    ("nan", "finite"), ("1e400", "finite"), ("-1", "non-negative"), ("-0.5", "non-negative"),
    ("٣", "a number of seconds"), ("1_0", "a number of seconds"),
])
def test_a_wait_that_is_no_time_is_a_400_saying_why(query, says):
    with pytest.raises(BadRequest) as err:
        wait_of(query)
    assert err.value.code == "invalid_wait" and says in err.value.message
