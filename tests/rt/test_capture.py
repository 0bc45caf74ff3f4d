"""What stops a decode step from replaying one CUDA graph (measure/capture.py): each kind of break found in hand-made
steps, none in two equal ones, and the real steps under fake CUDA held to what they break today, so that a change
that adds a break to the step fails here."""

from __future__ import annotations

import pytest
import torch

from infinigen_rt.measure.capture import breaks, two_steps
from infinigen_rt.measure.fakecuda import available
from infinigen_rt.measure.projection import Op

OUT, OTHER = 1 << 20, 2 << 20  # addresses of buffers from outside the step


def t(shape, where=OUT, dtype="torch.float16"):
    return ("tensor", shape, dtype, where)


def kernel(name, *detail, stream="s"):
    return Op("kernel", name, stream, detail=tuple(detail))


def step(n=4096, table=OUT):
    return [kernel("embedding", t((10, 8)), t((1, 1), table)),
            kernel("paged_decode", t((1, 8, 1, 64), "step"), t((1, 64), table), n // 16 + 1),
            Op("copy", "Memcpy HtoD", "s", pcie_bytes=8, detail=(t((1,), OUT, "torch.int64"), t((1,), OUT + 64)))]


def test_two_equal_steps_replay_one_graph():
    assert breaks(step(), step()) == []
    assert breaks(step(4096), step(4097)) == []  # the same block count: nothing read changes on the host


def test_each_kind_of_break_is_named_with_its_count():
    assert breaks(step(4096), step(4112)) == ["paged_decode: a scalar argument changes with the context (x1)"]
    assert breaks(step(), step(table=OTHER)) == [
        "embedding: a buffer from outside the step is another one (or is made in it) the next step (x1)",
        "paged_decode: a buffer from outside the step is another one (or is made in it) the next step (x1)"]
    grown = step()
    grown[1] = kernel("paged_decode", t((1, 8, 1, 64), "step"), t((1, 65)), 257)
    assert breaks(step(), grown) == ["paged_decode: a tensor's shape or dtype changes with the context (x1)"]
    synced = step() + [Op("sync", "item", streams=("s",))]
    assert breaks(step(), synced) == ["a host sync inside the step (item) (x1)"]
    fresh = step()
    fresh[2] = Op("copy", "Memcpy HtoD", "s", pcie_bytes=8, detail=(t((1,), OUT), t((1,), "step")))
    assert breaks(fresh, fresh) == ["a copy to the device from a host buffer made in the step, or pageable (x2)"]
    assert breaks(step(), step()[:2])[0] == "the steps launch 3 and 2 ops (x1)"
    swapped = step()
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert breaks(step(), swapped)[0].startswith("the ops differ from here: embedding on s against paged_decode")


# what the real steps break today (a graph needs none of it), by policy and prompt length (the steps recorded hold
# 68 and 69 tokens; 528 and 529, across a block's edge, within one bucket: store.bucket_end): the kind of
# break and the op. A fix removes its line here; a change that adds one to the step fails
TODAY = {
    ("full", 64): set(),
    ("full", 524): set(),
    ("infinigen", 64): set(),  # its step sized for the bucket, each row's counts on the device
    ("infinigen", 524): set(),
}


@pytest.mark.skipif(available() is not None, reason=f"fake CUDA: {available()}")
@pytest.mark.parametrize(("policy", "context"), list(TODAY))
def test_the_decode_step_breaks_no_more_than_it_does_today(policy, context):
    """`full`'s step replays one graph within its bucket (store.bucket_end): its token ids, positions, slots and
    tables go up into the same buffers every step (runner.py, system.Staging), its table and split sized for the
    bucket (kv/store.py)."""
    from infinigen_rt.measure.bench import Variant

    a, b = two_steps("smollm2-4l", torch.float32, Variant(policy, None, None), 2, context)
    assert len(a) == len(b) and a
    found = {line.rsplit(" (x", 1)[0] for line in breaks(a, b)}
    assert found <= TODAY[policy, context], found - TODAY[policy, context]
