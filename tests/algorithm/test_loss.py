"""The registered losses against naive float64 loops: every loss type, every KL estimator,
clipping, metrics."""

import math

import pytest
import torch
from support.losses import loss_of, random_batch

from grpokit.algorithm.loss import LOSSES

LOSS_TYPES = ["grpo", "dapo", "dr_grpo"]  # the clipped objective, three normalizations
ESTIMATORS = ["k1", "k2", "k3"]


def naive_loss(logps, old, ref, adv, mask, loss_type, beta, eps, eps_high, est, Lmax, n_seq, n_tok,
               sampling=None, cap=2.0):
    """Token by token, in Python floats."""
    B, T = logps.shape
    total = 0.0
    for i in range(B):
        seq_sum, seq_len = 0.0, 0.0
        for t in range(T):
            if not mask[i][t]:
                continue
            lp = float(logps[i][t])
            ratio = math.exp(lp - (lp if old is None else float(old[i][t])))
            a = float(adv[i])
            clipped = min(max(ratio, 1 - eps), 1 + eps_high)
            term = -min(ratio * a, clipped * a)
            if sampling is not None:  # truncated importance weight, old policy vs sampler
                term *= min(math.exp((lp if old is None else float(old[i][t])) - float(sampling[i][t])), cap)
            if beta > 0:
                r = float(ref[i][t])
                kl = {"k1": lp - r, "k2": (lp - r) ** 2 / 2, "k3": math.exp(r - lp) - (r - lp) - 1}[est]
                term += beta * kl
            seq_sum += term
            seq_len += 1
        if loss_type == "grpo":
            total += seq_sum / max(1.0, seq_len) / n_seq
        elif loss_type == "dapo":
            total += seq_sum / n_tok
        else:
            total += seq_sum / (n_seq * Lmax)
    return total


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("est", ESTIMATORS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_matches_naive_reference(loss_type, est, beta):
    logps, old, ref, adv, mask = random_batch()
    loss, _ = loss_of(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=beta, epsilon=0.2,
        epsilon_high=0.28, kl_estimator=est, max_completion_length=9,
    )
    expected = naive_loss(logps, old, ref, adv, mask, loss_type, beta, 0.2, 0.28, est, 9, 6, mask.sum().item())
    assert abs(loss.item() - expected) < 1e-12


@pytest.mark.parametrize("loss_type", list(LOSSES))
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_micro_batches_add_up_to_the_full_batch(loss_type, beta):
    """Loss, gradient and metrics of micro-batches given the full batch's counts sum to the full batch's."""
    logps, old, ref, adv, mask = random_batch(B=8, seed=1)
    kw = dict(loss_type=loss_type, beta=beta, epsilon_high=0.28, max_completion_length=7)
    full_in = logps.clone().requires_grad_(True)
    full, full_m = loss_of(full_in, old, ref, adv, mask, **kw)
    full.backward()
    part_in = logps.clone().requires_grad_(True)
    total, metrics = 0.0, {}
    for s in (slice(0, 3), slice(3, 4), slice(4, 8)):
        loss, m = loss_of(
            part_in[s], old[s], ref[s], adv[s], mask[s], num_sequences=8, num_tokens=mask.sum().item(), **kw
        )
        loss.backward()
        total = total + loss
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    assert abs(total.item() - full.item()) < 1e-12
    torch.testing.assert_close(part_in.grad, full_in.grad, rtol=0, atol=1e-14)
    for k, v in full_m.items():
        assert abs(metrics[k].item() - v.item()) < 1e-12, k


@pytest.mark.parametrize("seed", range(5))
def test_grpo_loss_is_zero_on_policy_with_beta_zero(seed):
    """With beta 0 and ratio 1, the per-sequence loss is exactly the mean advantage, 0 (group advantages sum to 0)."""
    from grpokit.algorithm.advantages import group_advantages

    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(16, generator=g) * 10
    adv = group_advantages(rewards, 4)
    logps = -torch.rand(16, 11, generator=g)
    lengths = torch.randint(1, 12, (16,), generator=g)
    mask = (torch.arange(11)[None, :] < lengths[:, None]).long()
    loss, _ = loss_of(logps, None, None, adv, mask, loss_type="grpo")
    assert abs(loss.item()) < 1e-6
    # ... which the global token mean (TRL's old normalization) is not, with unequal lengths.
    dapo, _ = loss_of(logps, None, None, adv, mask, loss_type="dapo")
    assert abs(dapo.item()) > 1e-3


def test_gradient_on_policy_is_the_policy_gradient():
    """old_logps=None: ratio 1 but d(loss)/d(logp) = -A / len / B for grpo."""
    logps = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = loss_of(logps, None, None, adv, mask)
    loss.backward()
    expected = torch.tensor([[-1 / 2 / 2, -1 / 2 / 2, 0], [2 / 3 / 2] * 3], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected)


def test_clip_metrics_on_hand_made_ratios():
    old = torch.zeros(1, 6, dtype=torch.float64)
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.1, 1.5, 1.5]], dtype=torch.float64)
    logps = ratios.log()
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    # A > 0: only ratio 1.5 (> 1 + 0.2) is clipped high; the masked 1.5 does not count.
    _, m = loss_of(logps, old, None, torch.tensor([1.0]), mask, epsilon=0.2)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert m["clip_ratio/low_mean"].item() == 0
    assert m["clip_ratio/region_mean"].item() == pytest.approx(1 / 5)
    # A < 0: only ratio 0.5 (< 1 - 0.2) is clipped low.
    _, m = loss_of(logps, old, None, torch.tensor([-1.0]), mask, epsilon=0.2)
    assert m["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert m["clip_ratio/high_mean"].item() == 0
    # A wider upper range (DAPO's clip-higher) stops clipping 1.5.
    _, m = loss_of(logps, old, None, torch.tensor([1.0]), mask, epsilon=0.2, epsilon_high=0.6)
    assert m["clip_ratio/high_mean"].item() == 0


def test_clipped_tokens_carry_no_gradient():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logps = torch.tensor([[math.log(1.5), math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    loss, _ = loss_of(logps, old, None, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), loss_type="dapo")
    loss.backward()
    assert logps.grad[0, 0] == 0
    assert logps.grad[0, 1] == pytest.approx(-1.1 / 2)


def test_kl_metric_and_estimators():
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    for est, per_token in {
        "k1": [0.5, -1.0],
        "k2": [0.125, 0.5],
        "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1],
    }.items():
        _, m = loss_of(logps, None, ref, torch.zeros(1), mask, beta=0.1, kl_estimator=est)
        assert m["kl"].item() == pytest.approx(sum(per_token) / 2)
    _, m = loss_of(logps, None, None, torch.zeros(1), mask, beta=0.0)
    assert "kl" not in m


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_type"):
        loss_of(x, None, None, torch.zeros(1), x, loss_type="bnpo2")
    with pytest.raises(ValueError, match="kl_estimator"):
        loss_of(x, None, None, torch.zeros(1), x, kl_estimator="k4")
    with pytest.raises(ValueError, match="ref_logps"):
        loss_of(x, None, None, torch.zeros(1), x, beta=0.1)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("on_policy", [True, False])
def test_importance_sampling_correction_matches_naive_reference(loss_type, beta, on_policy):
    logps, old, ref, adv, mask = random_batch(seed=3)
    g = torch.Generator().manual_seed(4)
    sampling = (logps if on_policy else old) + 0.4 * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    old = None if on_policy else old
    loss, metrics = loss_of(logps, old, ref, adv, mask, loss_type=loss_type, beta=beta, epsilon_high=0.28,
                              max_completion_length=9, sampling_logps=sampling, is_cap=1.5)
    expected = naive_loss(logps, old, ref, adv, mask, loss_type, beta, 0.2, 0.28, "k3", 9, 6, mask.sum().item(),
                          sampling=sampling, cap=1.5)
    assert abs(loss.item() - expected) < 1e-12
    weights = [min(math.exp(float((logps if old is None else old)[i][t]) - float(sampling[i][t])), 1.5)
               for i in range(6) for t in range(7) if mask[i][t]]
    assert metrics["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(sum(weights) / len(weights), abs=1e-12)
    assert metrics["sampling/importance_sampling_ratio/max"].item() == pytest.approx(max(weights), abs=1e-12)
    assert max(weights) == 1.5  # the cap binds somewhere in this batch


def test_importance_weights_scale_the_policy_gradient_and_carry_none():
    """dapo, beta 0: the gradient of each token is its weight times the uncorrected one."""
    logps, old, _, adv, mask = random_batch(seed=5)
    sampling = old - 0.3
    a = logps.clone().requires_grad_(True)
    loss_of(a, old, None, adv, mask, loss_type="dapo", sampling_logps=sampling, is_cap=10.0)[0].backward()
    b = logps.clone().requires_grad_(True)
    loss_of(b, old, None, adv, mask, loss_type="dapo")[0].backward()
    torch.testing.assert_close(a.grad, b.grad * torch.exp(old - sampling), rtol=1e-12, atol=0)
    # Sampler identical to the old policy: weight 1, nothing changes.
    c = logps.clone().requires_grad_(True)
    loss_of(c, old, None, adv, mask, loss_type="dapo", sampling_logps=old)[0].backward()
    torch.testing.assert_close(c.grad, b.grad, rtol=0, atol=0)


def test_zero_advantage_rows_add_nothing():
    """The trainer skips zero-advantage completions when beta is 0: loss and gradient are unchanged
    (to float64 rounding: a sum over fewer rows may round otherwise in its last bit, as SAPO's did
    by 7e-18 on one draw of the suite's random state; each loss now draws from its own seed)."""
    for i, loss_type in enumerate(LOSSES):
        g = torch.Generator().manual_seed(i)
        logps = torch.randn(4, 3, dtype=torch.float64, generator=g).requires_grad_(True)
        old = logps.detach() + 0.1
        adv = torch.tensor([0.5, 0.0, -0.5, 0.0], dtype=torch.float64)
        mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
        full, full_m = loss_of(logps, old, None, adv, mask, loss_type=loss_type)
        full.backward()
        kept = torch.tensor([0, 2])
        sub = logps.detach().clone().requires_grad_(True)
        part, part_m = loss_of(
            sub[kept], old[kept], None, adv[kept], mask[kept], loss_type=loss_type, num_sequences=4, num_tokens=9
        )
        part.backward()
        assert abs(part.item() - full.item()) < 1e-15
        torch.testing.assert_close(sub.grad, logps.grad, rtol=1e-13, atol=1e-16)
        assert all(abs(part_m[k] - full_m[k]) < 1e-15 for k in full_m)
