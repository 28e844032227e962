"""The connector's settings resolution: what the code passes wins over the launch configuration, where both
may be given; conflicts and unknown values are refused with the fix."""

import pytest

from hasten.connector import resolve_settings
from hasten.exceptions import ConfigurationError


@pytest.mark.parametrize("kwargs,launch,expected", [
    ({}, {}, ("no", 1, "NO")),
    ({"mixed_precision": "bf16"}, {}, ("bf16", 1, "NO")),
    ({}, {"mixed_precision": "fp16"}, ("fp16", 1, "NO")),
    ({"mixed_precision": "bf16"}, {"mixed_precision": "no"}, ("bf16", 1, "NO")),
    ({}, {"distributed_type": "DEEPSPEED", "deepspeed_config": {"gradient_accumulation_steps": 4}}, ("no", 4, "NO")),
    ({"gradient_accumulation_steps": 2}, {"distributed_type": "DEEPSPEED",
                                          "deepspeed_config": {"gradient_accumulation_steps": 4}}, ("no", 2, "NO")),
    ({}, {"deepspeed_config": {"gradient_accumulation_steps": 4}}, ("no", 1, "NO")),  # not a DeepSpeed launch
    ({}, {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, ("no", 1, "INDUCTOR")),
    ({"dynamo_backend": "eager"}, {}, ("no", 1, "EAGER")),
])
def test_connector_precedence(kwargs, launch, expected):
    settings = resolve_settings(kwargs, launch)
    assert (settings.mixed_precision, settings.gradient_accumulation_steps, settings.dynamo_backend) == expected


@pytest.mark.parametrize("kwargs,launch,message", [
    ({"mixed_precision": "fp16"}, {"mixed_precision": "bf16"}, "conflicts with the launch configuration"),
    ({"mixed_precision": "fp32"}, {}, "Unknown mixed_precision 'fp32'"),
    ({"gradient_accumulation_steps": 0}, {}, "must be at least 1"),
    ({"dynamo_backend": "eager", "dynamo_plugin": object()}, {}, "pass only one"),
    ({"dynamo_backend": "turbo"}, {}, "Unknown dynamo_backend 'turbo'"),
])
def test_connector_rejects_conflicts(kwargs, launch, message):
    with pytest.raises(ConfigurationError, match=message):
        resolve_settings(kwargs, launch)
