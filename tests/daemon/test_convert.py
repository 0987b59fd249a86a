"""Request fields into engine values (h3d.daemon.convert.sampling_from), checked before the engine
sees them."""

from __future__ import annotations

import pytest

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.convert import sampling_from
from h3d.engine.sampling import SamplingParams
from h3d.errors import InvalidRequest


def test_grpc_sampling_carries_the_penalties() -> None:
    base = SamplingParams(max_tokens=500)
    got = sampling_from(base, pb.SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0), 100)
    assert (got.presence_penalty, got.frequency_penalty) == (0.5, -1.0)
    assert got.max_tokens == 100  # unset: the default, capped at the limit
    unset = sampling_from(SamplingParams(presence_penalty=1.0), pb.SamplingParams(), 100)
    assert unset.presence_penalty == 1.0  # an unset field keeps the session's value
    for bad in (pb.SamplingParams(presence_penalty=2.5), pb.SamplingParams(frequency_penalty=-3)):
        with pytest.raises(InvalidRequest, match=r"penalty must be within -2\.\.2"):
            sampling_from(base, bad, 100)
    with pytest.raises(InvalidRequest, match="max_tokens_limit"):
        sampling_from(base, pb.SamplingParams(max_tokens=101), 100)
