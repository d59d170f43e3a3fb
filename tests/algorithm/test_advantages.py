"""group_advantages against a naive float64 loop, and its defining properties."""

import math

import pytest
import torch

from grpokit.algorithm.advantages import group_advantages


def naive(rewards, G, scale, eps):
    r = [float(x) for x in rewards]
    n = len(r)
    batch_mean = sum(r) / n
    batch_std = math.sqrt(sum((x - batch_mean) ** 2 for x in r) / (n - 1))
    out = []
    for start in range(0, n, G):
        group = r[start : start + G]
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
        for x in group:
            if all(y == group[0] for y in group):
                out.append(0.0)
            elif scale == "group":
                out.append((x - mean) / (std + eps))
            elif scale == "batch":
                out.append((x - mean) / (batch_std + eps))
            else:
                out.append(x - mean)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("G", [2, 3, 8])
def test_matches_naive_reference(scale, G):
    torch.manual_seed(G)
    rewards = torch.randn(5 * G, dtype=torch.float64)
    rewards[:G] = 0.7  # one constant group
    got = group_advantages(rewards, G, scale, eps=1e-4)
    torch.testing.assert_close(got, naive(rewards, G, scale, 1e-4), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_groups_sum_to_zero_and_constant_group_is_zero(scale):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, 4, scale)
    assert adv.view(-1, 4).sum(1).abs().max() < 1e-12
    assert torch.equal(adv[4:8], torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, -2.3e-5])
def test_constant_group_is_exactly_zero_whatever_the_value(value):
    adv = group_advantages(torch.full((16,), value, dtype=torch.float32), 8, "group")
    assert torch.equal(adv, torch.zeros(16))


def test_group_scale_is_unbiased_std():
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2, "group", eps=0.0)
    # mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5], dtype=torch.float64) / math.sqrt(0.5))


def test_bad_shapes_and_scale():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="shape"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 2, "median")


def naive_with_missing(rewards, G, scale, eps):
    """None = not scored: left out of every statistic, advantage 0; so is a group with < 2 scored."""
    scored_all = [x for x in rewards if x is not None]
    m = sum(scored_all) / len(scored_all)
    batch_std = math.sqrt(sum((x - m) ** 2 for x in scored_all) / (len(scored_all) - 1))
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start : start + G]
        scored = [x for x in group if x is not None]
        if len(scored) < 2 or all(x == scored[0] for x in scored):
            out += [0.0] * G
            continue
        mean = sum(scored) / len(scored)
        std = math.sqrt(sum((x - mean) ** 2 for x in scored) / (len(scored) - 1))
        div = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out += [0.0 if x is None else (x - mean) / div for x in group]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_are_left_out(scale):
    rewards = [1.0, None, 0.0, 0.5,   None, None, None, None,   2.0, None, None, None,   3.0, 3.0, None, 1.0]
    got = group_advantages(torch.tensor([math.nan if x is None else x for x in rewards], dtype=torch.float64), 4, scale)
    torch.testing.assert_close(got, naive_with_missing(rewards, 4, scale, 1e-4), rtol=1e-12, atol=1e-12)
    assert not torch.isnan(got).any()
    assert got[:4].sum().abs() < 1e-12  # the scored members of a group still sum to zero
