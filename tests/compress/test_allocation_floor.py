"""rank_keep's floor: a share of the budget each layer keeps of its own best entries first, so
one ranking across layers cannot starve a layer whose scores run low."""

from __future__ import annotations

import pytest
import torch

from kvedit.compress.allocation import rank_keep
from kvedit.errors import InvalidInputError


def _two_layers():
    scores = {
        0: torch.tensor([[9.0, 8, 7, 6, 5, 4]]),
        1: torch.tensor([[1.0, 0.5, 0.4, 0.3, 0.2, 0.1]]),
    }
    must = {0: torch.zeros(6, dtype=torch.bool), 1: torch.zeros(6, dtype=torch.bool)}
    return scores, must, {0: 1.0, 1: 1.0}


def test_without_a_floor_one_ranking_starves_the_low_scored_layer():
    scores, must, cost = _two_layers()
    kept = rank_keep(scores, must, 4, cost)
    assert kept[0].sum() == 4 and kept[1].sum() == 0


def test_a_floor_gives_each_layer_its_part_and_ranks_the_rest_together():
    scores, must, cost = _two_layers()
    kept = rank_keep(scores, must, 4, cost, floor=0.5)  # 2 shared out: one entry a layer
    assert kept[0].tolist() == [True, True, True, False, False, False]
    assert kept[1].tolist() == [True, False, False, False, False, False]
    kept = rank_keep(scores, must, 4, cost, floor=1.0)
    assert kept[0].sum() == 2 and kept[1].sum() == 2 and kept[1][:2].all()


def test_what_a_layer_must_keep_counts_towards_its_floor():
    scores, must, cost = _two_layers()
    must[1] = torch.tensor([False, False, False, False, True, True])
    kept = rank_keep(scores, must, 4, cost, floor=1.0)  # layer 1's part is its two musts
    assert kept[1].tolist() == [False, False, False, False, True, True]
    assert kept[0].sum() == 2


def test_a_floor_per_head_still_spends_at_most_the_budget():
    scores = {0: torch.rand(2, 8) + 5, 1: torch.rand(2, 8)}
    must = {0: torch.zeros(2, 8, dtype=torch.bool), 1: torch.zeros(2, 8, dtype=torch.bool)}
    kept = rank_keep(scores, must, 6, {0: 2.0, 1: 2.0}, per_head=True, floor=0.5)
    assert int(kept[0].sum() + kept[1].sum()) == 6
    assert int(kept[1].sum()) >= 1


@pytest.mark.parametrize("floor", [-0.1, 1.5])
def test_a_floor_out_of_range_is_refused(floor):
    scores, must, cost = _two_layers()
    with pytest.raises(InvalidInputError, match="floor"):
        rank_keep(scores, must, 4, cost, floor=floor)


def test_a_floor_never_spends_past_the_budget_when_one_layer_must_keep_more_than_its_part():
    scores, must, cost = _two_layers()
    must[0] = torch.tensor([True, True, True, True, True, False])  # 5 of a budget of 6
    kept = rank_keep(scores, must, 6, cost, floor=0.9)  # each layer's part: 2.7
    assert int(kept[0].sum() + kept[1].sum()) <= 6
    assert kept[0][:5].all() and int(kept[1].sum()) == 1  # the one entry left goes to layer 1


def test_a_floor_keeps_no_layer_past_the_position_cap():
    scores, must, cost = _two_layers()
    kept = rank_keep(scores, must, 8, cost, floor=1.0, cap=3)  # each layer's part: 4
    assert int(kept[0].sum()) == 3 and int(kept[1].sum()) == 3
