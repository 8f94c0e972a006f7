"""OpenAI logprobs are clamped at -9999.0 (vLLM's rule): a token of probability 0 has logprob -inf, which JSON
cannot carry (it was sent as null)."""

from __future__ import annotations

import json
import math

from tokenmill.entrypoints.openai.serving_engine import LOGPROB_FLOOR, token_logprobs
from tokenmill.outputs import Logprob


def test_minus_infinity_is_reported_as_the_floor():
    pos = {5: Logprob(logprob=-math.inf, rank=3, decoded_token="a"),
           6: Logprob(logprob=-0.25, rank=1, decoded_token="b"),
           7: Logprob(logprob=-math.inf, rank=2, decoded_token="c")}
    [(text, lp, top)] = token_logprobs(None, [pos], [5], num_top=3)
    assert text == "a" and lp == LOGPROB_FLOOR == -9999.0
    assert top == [("b", -0.25), ("a", -9999.0), ("c", -9999.0)]
    json.dumps([lp, top], allow_nan=False)  # every value is a JSON number
    [(_, lp, _)] = token_logprobs(None, [pos], [6], num_top=0)
    assert lp == -0.25  # finite values pass unchanged
