import math

import pytest

from voltserve.errors import InvalidRequestError
from voltserve.request import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", -0.1), ("temperature", 101.0),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0), ("repetition_penalty", 1e-300),
    ("repetition_penalty", math.inf), ("presence_penalty", 2.5), ("frequency_penalty", math.nan), ("n", 0),
    ("logprobs", 21), ("max_tokens", 0), ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]),
])
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.param == field


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-40).validate().is_greedy
    assert not SamplingParams(temperature=1e-3).validate().is_greedy


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=2, min_tokens=3).validate()
    assert info.value.param == "min_tokens"
