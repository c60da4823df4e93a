"""tests/helpers/run_dir.py's ``assert_curve_matches``: what the multi-node tests compare a job's curve
with 1 process's by. It must fail on a loss that differs while the routing still agrees, on routing that
parts from the first steps, and on a curve that runs away after the routing parted."""
from __future__ import annotations

import pytest

from helpers.run_dir import assert_curve_matches


def _rows(losses, counts):
    return [{"step": i + 1, "loss": loss, "moe": {"0": {"expert_counts": c}}} for i, (loss, c) in
            enumerate(zip(losses, counts))]


LOSSES = [6.0, 5.5, 5.2, 5.1, 5.0, 4.9, 4.8]
COUNTS = [[4, 4], [5, 3], [3, 5], [4, 4], [6, 2], [2, 6], [4, 4]]


def test_the_same_curve_to_rounding_matches_and_nothing_parted():
    rounded = [x * (1 + 3e-7) for x in LOSSES]
    assert assert_curve_matches(_rows(rounded, COUNTS), _rows(LOSSES, COUNTS)) is None


def test_a_loss_off_while_the_routing_agrees_fails():
    off = LOSSES[:3] + [LOSSES[3] * (1 + 2e-5)] + LOSSES[4:]
    with pytest.raises(AssertionError):
        assert_curve_matches(_rows(off, COUNTS), _rows(LOSSES, COUNTS))


def test_after_the_routing_parted_the_curve_may_drift_a_little_not_far():
    parted = COUNTS[:5] + [[3, 7], [5, 3]]
    near = LOSSES[:5] + [x * (1 + 2e-4) for x in LOSSES[5:]]
    assert assert_curve_matches(_rows(near, parted), _rows(LOSSES, COUNTS)) == 6
    far = LOSSES[:5] + [x * 1.01 for x in LOSSES[5:]]
    with pytest.raises(AssertionError):
        assert_curve_matches(_rows(far, parted), _rows(LOSSES, COUNTS))


def test_routing_that_parts_within_the_first_steps_fails():
    parted = [[4, 4], [3, 5]] + COUNTS[2:]
    with pytest.raises(AssertionError, match="parted at step 2"):
        assert_curve_matches(_rows(LOSSES, parted), _rows(LOSSES, COUNTS))


def test_rows_of_other_steps_fail():
    with pytest.raises(AssertionError):
        assert_curve_matches(_rows(LOSSES, COUNTS)[1:], _rows(LOSSES, COUNTS)[:-1])
