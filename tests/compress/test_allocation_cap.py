"""rank_keep(cap=): no layer (no KV head, per head) keeps more than the cap, protected entries
counted; the budget the cap leaves goes to the next best entries of the other layers."""

from __future__ import annotations

import torch

from kvedit.compress.allocation import rank_keep


def test_a_cap_passes_the_budget_on_to_the_other_layers():
    scores = {0: torch.tensor([[9.0, 8, 7, 6, 5, 4]]), 1: torch.tensor([[3.0, 2, 1, 0, -1, -2]])}
    must = {
        0: torch.tensor([True, False, False, False, False, False]),
        1: torch.zeros(6, dtype=torch.bool),
    }
    cost = {0: 1.0, 1: 1.0}
    free = rank_keep(scores, must, 6, cost)
    assert free[0].sum() == 6 and free[1].sum() == 0  # one ranking: layer 0 takes all
    capped = rank_keep(scores, must, 6, cost, cap=4)
    assert capped[0].tolist() == [True, True, True, True, False, False]  # the must counted
    assert capped[1].tolist() == [True, True, False, False, False, False]


def test_a_cap_per_kv_head():
    scores = {0: torch.tensor([[9.0, 8, 7, 6], [1.0, 0.5, 0.2, 0.1]])}
    must = {0: torch.zeros(2, 4, dtype=torch.bool)}
    kept = rank_keep(scores, must, 2.0, {0: 1.0}, per_head=True, cap=2)  # 4 head entries
    assert kept[0].sum(dim=1).tolist() == [2, 2]
    assert rank_keep(scores, must, 2.0, {0: 1.0}, per_head=True)[0].sum(dim=1).tolist() == [4, 0]
