"""--speculative-config parses as vLLM's does and names what is wrong."""

from __future__ import annotations

import pytest

from services.common.speculative import SpeculativeConfig


def test_lookup_bounds_default_as_vllm():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    one = SpeculativeConfig.from_json('{"method": "ngram", "prompt_lookup_max": 3}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    both = SpeculativeConfig.from_dict({"num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                        "prompt_lookup_max": 4})
    assert (both.num_speculative_tokens, both.lookup_min, both.lookup_max) == (4, 2, 4)


@pytest.mark.parametrize("text, field", [
    ('{"method": "eagle"}', "method"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_max"),
    ('{"probe_interval": 0}', "probe_interval"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"speculative_tokens": 3}', "unknown fields"),
    ("[1]", "JSON object"),
    ("{", "not JSON"),
])
def test_bad_configs_name_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_json(text)
