"""The GRPO family against naive float64 loops written from each paper's formula: values and
gradients, clipping regions, rollout importance-weight modes, the top-entropy mask; the advantage
estimators and reward aggregations; the learning-rate schedules; dynamic sampling's group filter."""

import math

import pytest
import torch
from support.losses import loss_of, random_batch

from grpokit.algorithm.advantages import advantages, normalized_sum, rloo_advantages
from grpokit.algorithm.loss import IS_MAX, IS_MEAN, IS_OUTSIDE
from grpokit.algorithm.masks import high_entropy_tokens, loss_mask
from grpokit.algorithm.schedule import lr_multiplier

sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731


def naive(logps, old, ref, adv, mask, *, objective, norm, level="token", beta=0.0, eps=0.2, eps_high=0.28, delta=None,
          tau_pos=1.0, tau_neg=1.05, sampling=None, is_level="token", is_mode="truncate", cap=3.0, is_min=None,
          policy_mask=None, Lmax=9, entropies=None, entropy_coef=0.0, teacher=None, distill_coef=1.0):
    """The loss token by token, each term a float64 scalar tensor (so autograd gives the naive
    gradient), from the papers' formulas."""
    B, T = logps.shape
    n_seq, n_tok = B, float(mask.sum())
    old = logps.detach() if old is None else old
    total = 0.0
    for i in range(B):
        tokens = [t for t in range(T) if mask[i][t]]
        a = float(adv[i])
        if level == "sequence":  # GSPO: the geometric mean of the token ratios
            seq_ratio = torch.exp(sum(logps[i, t] - old[i, t] for t in tokens) / max(1, len(tokens)))
        if sampling is not None and is_level == "sequence":
            seq_rho = math.exp(sum(float(old[i, t] - sampling[i, t]) for t in tokens))
        seq_sum = 0.0
        for t in tokens:
            if teacher is not None:  # on-policy distillation: minus the reverse KL's estimate on the token
                a = float(adv[i]) - distill_coef * (float(old[i, t]) - float(teacher[i, t]))
            r = seq_ratio if level == "sequence" else torch.exp(logps[i, t] - old[i, t])
            if objective == "clipped":
                clipped = torch.clamp(r, 1 - eps, 1 + eps_high)
                term = -torch.minimum(r * a, clipped * a)
                if delta is not None and a < 0:  # dual-clip PPO (Ye et al. 2020): the loss is at most -delta A
                    term = -torch.maximum(torch.minimum(r * a, clipped * a), torch.tensor(delta * a, dtype=r.dtype))
            elif objective == "cispo":  # MiniMax-M1: sg(clip(r)) A log pi
                term = -min(float(r.detach()), 1 + eps_high) * a * logps[i, t]
            else:  # SAPO: a sigmoid gate, 4/tau so that its slope at r = 1 is 1
                tau = tau_pos if a > 0 else tau_neg
                term = -(4 / tau) * sig(tau * (r - 1)) * a
            if sampling is not None:
                rho = seq_rho if is_level == "sequence" else math.exp(float(old[i, t] - sampling[i, t]))
                low = -math.inf if is_min is None else is_min
                if is_mode == "truncate":
                    w = min(max(rho, low), cap)
                else:
                    w = rho if low <= rho <= cap else 0.0
                term = term * w
            if policy_mask is not None and not policy_mask[i][t]:
                term = term * 0.0
            if beta > 0:
                d = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            if entropy_coef > 0:  # the entropy bonus: minus c times the policy's entropy at the token
                term = term - entropy_coef * entropies[i, t]
            seq_sum = seq_sum + term
        if norm == "seq":
            total = total + seq_sum / max(1, len(tokens)) / n_seq
        elif norm == "tok":
            total = total + seq_sum / n_tok
        else:
            total = total + seq_sum / (n_seq * Lmax)
    return total


NORM = {"grpo": "seq", "dapo": "tok", "dr_grpo": "const", "cispo": "tok", "sapo": "seq"}
OBJECTIVE = {"grpo": "clipped", "dapo": "clipped", "dr_grpo": "clipped", "cispo": "cispo", "sapo": "sapo"}


def compare(loss_type, naive_kw, batch=None, **kw):
    """Value and gradient of the registered loss and of the naive loop, on `batch` (logps, old,
    ref, adv, mask), by default one whose ratios lie on both sides of every clip range."""
    if batch is None:
        logps, old, ref, adv, mask = random_batch(seed=11)
        old = logps + 0.5 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    else:
        logps, old, ref, adv, mask = batch
    a = logps.clone().requires_grad_(True)
    got, metrics = loss_of(a, old, ref, adv, mask, loss_type=loss_type, epsilon_high=0.28, max_completion_length=9, **kw)
    got.backward()
    b = logps.clone().requires_grad_(True)
    expected = naive(b, old, ref, adv, mask, objective=OBJECTIVE[loss_type], norm=NORM[loss_type], **naive_kw)
    expected.backward()
    assert abs(got.item() - expected.item()) < 1e-12
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
    return metrics, (logps, old, adv, mask)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_each_loss_at_each_level_matches_its_formula(loss_type, level, beta):
    compare(loss_type, dict(level=level, beta=beta), beta=beta, importance_sampling_level=level)


def test_the_ratios_cross_every_clip_range():
    """The batch of `compare` exercises the clip: some tokens on each side, of each sign of advantage."""
    metrics, (logps, old, adv, mask) = compare("grpo", {})
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    metrics, _ = compare("cispo", {})
    assert metrics["cispo_clip_ratio"] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_dual_clip_bounds_negative_advantage_tokens(loss_type):
    compare(loss_type, dict(delta=1.6), delta=1.6)
    # It binds: a negative-advantage token with ratio 3 has loss 1.6 |A| and no gradient.
    logps = torch.tensor([[math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    loss, _ = loss_of(logps, torch.zeros(1, 1, dtype=torch.float64), None, torch.tensor([-1.0], dtype=torch.float64),
                      torch.ones(1, 1), loss_type=loss_type, delta=1.6, max_completion_length=1)
    loss.backward()
    assert loss.item() == pytest.approx(1.6) and logps.grad.item() == 0
    without, _ = loss_of(logps.detach(), torch.zeros(1, 1, dtype=torch.float64), None,
                         torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1), loss_type=loss_type,
                         max_completion_length=1)
    assert without.item() == pytest.approx(3.0)


def test_sapo_temperatures_and_slope():
    compare("sapo", dict(tau_pos=2.0, tau_neg=0.5), sapo_temperature_pos=2.0, sapo_temperature_neg=0.5)
    # At ratio 1 SAPO's gradient is the policy gradient, -A per token (dapo-like single token here).
    logps = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    loss, _ = loss_of(logps, None, None, torch.tensor([0.7], dtype=torch.float64), torch.ones(1, 1), loss_type="sapo")
    loss.backward()
    assert logps.grad.item() == pytest.approx(-0.7, abs=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "sapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_with_one_token_per_sequence_is_the_token_level(loss_type, beta):
    logps, old, ref, adv, mask = random_batch(seed=2)
    mask = torch.zeros_like(mask)
    mask[:, 0] = 1
    values = []
    for level in ("token", "sequence"):
        x = logps.clone().requires_grad_(True)
        loss, _ = loss_of(x, old, ref, adv, mask, loss_type=loss_type, beta=beta, importance_sampling_level=level)
        loss.backward()
        values.append((loss.item(), x.grad))
    assert values[0][0] == pytest.approx(values[1][0], abs=1e-14)
    torch.testing.assert_close(values[0][1], values[1][1], rtol=0, atol=1e-14)


@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("is_mode", ["truncate", "mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_rollout_importance_weight_modes_match_their_formula(is_level, is_mode, loss_type):
    logps, old, ref, adv, mask = random_batch(seed=11)
    g = torch.Generator().manual_seed(13)
    # Per token spread 0.4 (token weights on both sides of the bounds), per sequence smaller (their products).
    spread = 0.4 if is_level == "token" else 0.15
    old = logps + 0.5 * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    sampling = old + spread * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    metrics, _ = compare(loss_type, dict(sampling=sampling, is_level=is_level, is_mode=is_mode, cap=1.3, is_min=0.8),
                         (logps, old, ref, adv, mask), sampling_logps=sampling, is_cap=1.3, is_level=is_level,
                         is_mode=is_mode, is_min=0.8)
    # The metrics: the weights' mean and max, and the share of tokens outside [0.8, 1.3].
    rhos = []
    for i in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[i][t]]
        seq = math.exp(sum(float(old[i, t] - sampling[i, t]) for t in tokens))
        rhos += [seq if is_level == "sequence" else math.exp(float(old[i, t] - sampling[i, t])) for t in tokens]
    outside = [not 0.8 <= r <= 1.3 for r in rhos]
    weights = [min(max(r, 0.8), 1.3) if is_mode == "truncate" else (0.0 if o else r) for r, o in zip(rhos, outside)]
    assert 0 < sum(outside) < len(rhos)  # the bounds bind on some tokens, not all
    assert metrics[IS_OUTSIDE[is_mode]].item() == pytest.approx(sum(outside) / len(rhos), abs=1e-12)
    assert metrics[IS_MEAN].item() == pytest.approx(sum(weights) / len(weights), abs=1e-12)
    assert metrics[IS_MAX].item() == pytest.approx(max(weights), abs=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
@pytest.mark.parametrize("is_level", ["token", "sequence"])
def test_tokens_of_three_versions_in_one_completion_are_weighed_each_by_its_own_sampler(loss_type, is_level):
    """Partial rollouts (sampling/partial.py): a completion carried over steps holds tokens sampled by
    two or three weights versions; each token's sampling log-prob is its own version's, and the
    importance weight is between the policy before the update and that token's sampler."""
    logps, old, ref, adv, mask = random_batch(seed=21)
    mask[:] = 1  # every row whole: its three stretches all trained
    g = torch.Generator().manual_seed(22)
    old = logps + 0.5 * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    # Versions 0, 1, 2 over a completion's thirds: each sampler its own distance from the old policy.
    version = torch.div(torch.arange(logps.shape[1]) * 3, logps.shape[1], rounding_mode="floor").expand_as(logps)
    drift = torch.tensor([0.5, 0.2, 0.0], dtype=torch.float64)[version] * 0.1  # the older, the further
    sampling = old + (drift + 0.1) * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    assert len(set(version[0].tolist())) == 3
    compare(loss_type, dict(sampling=sampling, is_level=is_level, cap=1.3), (logps, old, ref, adv, mask),
            sampling_logps=sampling, is_cap=1.3, is_level=is_level)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo"])
def test_policy_mask_drops_the_policy_term_only(loss_type):
    """top_entropy_quantile's mask: the policy term of unselected tokens goes, their KL stays, the
    normalizers are unchanged."""
    logps, old, ref, adv, mask = random_batch(seed=4)
    keep = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) < 0.4
    compare(loss_type, dict(beta=0.04, policy_mask=keep), (logps, old, ref, adv, mask), beta=0.04, policy_mask=keep)


# ---------------------------------------------------------------- advantages


def test_rloo_matches_its_formula():
    """A_i = r_i - (sum of the other members' rewards) / (G - 1)."""
    g = torch.Generator().manual_seed(0)
    for G in (2, 3, 8):
        rewards = torch.randn(4 * G, generator=g, dtype=torch.float64)
        rewards[:G] = 0.25  # an equal-reward group
        got = rloo_advantages(rewards, G)
        expected = [float(rewards[i]) - (float(rewards[p * G:(p + 1) * G].sum()) - float(rewards[i])) / (G - 1)
                    for p in range(4) for i in range(p * G, (p + 1) * G)]
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
        assert (got[:G] == 0).all()  # exactly
        assert got.view(4, G).sum(1).abs().max() < 1e-12


def test_rloo_leaves_unscored_completions_out():
    rewards = torch.tensor([1.0, math.nan, 3.0, 5.0, math.nan, 2.0, math.nan, math.nan], dtype=torch.float64)
    got = rloo_advantages(rewards, 4)
    # Group 0: scored 1, 3, 5: 1 - 4, 3 - 3, 5 - 2; group 1 has one scored member: nothing to compare.
    assert got.tolist() == [-3.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]


def test_rloo_scaled_by_the_group_std():
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.0], dtype=torch.float64)
    std = rewards.std().item()
    expected = [(r - (7 - r) / 3) / (std + 1e-4) for r in rewards.tolist()]
    torch.testing.assert_close(advantages(rewards, rewards[:, None], torch.ones(1), 4, "rloo", "group"),
                               torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    # The default scaling: grpo by the group's std, rloo none.
    torch.testing.assert_close(advantages(rewards, rewards[:, None], torch.ones(1), 4, "rloo"),
                               rloo_advantages(rewards, 4), rtol=0, atol=0)


def trl_normalize_then_sum(per_function, weights, G):
    """TRL's multi_objective_aggregation='normalize_then_sum', written out as a loop."""
    N, K = len(per_function), len(weights)
    sums = []
    for i in range(N):
        p = i // G
        total = 0.0
        for k in range(K):
            group = [per_function[j][k] for j in range(p * G, (p + 1) * G)]
            mean = sum(group) / G
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
            total += weights[k] * (per_function[i][k] - mean) / (std + 1e-4)
        sums.append(total)
    mean = sum(sums) / N
    std = math.sqrt(sum((x - mean) ** 2 for x in sums) / (N - 1))
    return [(x - mean) / (std + 1e-4) for x in sums]


def test_normalize_then_sum_matches_trl():
    g = torch.Generator().manual_seed(1)
    G = 4
    per_function = torch.stack([torch.randn(12, generator=g, dtype=torch.float64),
                                torch.randint(0, 2, (12,), generator=g).double() * 10], 1)  # (12, 2) on different scales
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    per_function[8:, 1] = 1.0  # group 2: the second function constant
    got = normalized_sum(per_function, weights, G)
    expected = trl_normalize_then_sum(per_function.tolist(), weights.tolist(), G)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    # Compared with sum_then_normalize, the 0-or-10 function no longer drowns the other.
    both_constant = per_function.clone()
    both_constant[:4] = 2.0
    assert (normalized_sum(both_constant, weights, G)[:4] == 0).all()  # exactly


# ---------------------------------------------------------------- learning-rate schedules


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_schedules_match_transformers(kind):
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    make = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}[kind]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    theirs = make(optimizer, num_warmup_steps=3, num_training_steps=20).lr_lambdas[0]
    # After the warm-up, the same multiplier (transformers' warm-up starts at 0, grpokit's at 1/W).
    for u in range(3, 20):
        assert lr_multiplier(kind, u, 3, 20) == pytest.approx(theirs(u), abs=1e-12), u
    assert [lr_multiplier(kind, u, 3, 20) for u in range(3)] == [1 / 3, 2 / 3, 1.0]
    assert lr_multiplier("constant", 19, 3, 20) == 1.0


# ---------------------------------------------------------------- dynamic sampling


def test_a_group_is_informative_by_its_advantages_not_its_summed_rewards():
    """Two rewards whose weighted sum is the same for every member: sum_then_normalize gives the
    group advantage 0 (dynamic sampling drops it), normalize_then_sum does not (it keeps it)."""
    f1 = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    per_function = torch.stack([f1, 2 * (1 - f1)], 1)  # (4, 2)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    summed = per_function @ weights  # all 1
    assert (advantages(summed, per_function, weights, 4) == 0).all()
    assert (advantages(summed, per_function, weights, 4, aggregation="normalize_then_sum") != 0).all()


def test_the_collector_keeps_informative_groups_in_order_then_fills():
    from grpokit.engines.batch import RolloutBatch
    from grpokit.sampling.dynamic_sampling import Collector, Round

    G = 2

    def round_of(tag: int, prompt_width: int):
        n = 3 * G
        batch = RolloutBatch(torch.arange(n) // G, torch.full((n, prompt_width), tag), torch.ones(n, prompt_width, dtype=torch.long),
                             torch.full((n, 2), tag), torch.ones(n, 2, dtype=torch.long), torch.zeros(n, 2), None,
                             ["stop"] * n)
        rewards = torch.arange(n, dtype=torch.float64) + 10 * tag
        return Round([f"r{tag}p{p}" for p in range(3)], batch, rewards, {"f": rewards}, [{"row": (tag, i)} for i in range(n)])

    collector = Collector(prompts_per_step=3, group_size=G)
    collector.add(round_of(1, 4), torch.tensor([False, True, False]))
    assert not collector.full
    collector.add(round_of(2, 6), torch.tensor([True, False, False]))
    examples, batch, rewards, per_function, samples = collector.batch()
    # The two informative groups in sampling order, then the first equal-reward group sampled.
    assert examples == ["r1p1", "r2p0", "r1p0"]
    assert rewards.tolist() == [12.0, 13.0, 20.0, 21.0, 10.0, 11.0] and torch.equal(per_function["f"], rewards)
    assert [s["row"] for s in samples] == [(1, 2), (1, 3), (2, 0), (2, 1), (1, 0), (1, 1)]
    assert batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    # Prompts left-padded to the widest round's (6), mask 0 on the padding.
    assert batch.prompt_ids.shape == (6, 6) and batch.prompt_mask.sum(1).tolist() == [4, 4, 6, 6, 4, 4]
    assert (batch.prompt_mask[:2, :2] == 0).all() and (batch.prompt_ids[2:4] == 2).all()
    assert collector.metrics() == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/prompts_sampled": 6.0,
                                   "dynamic_sampling/groups_found": 2.0, "dynamic_sampling/groups_kept": 2.0}


def test_sync_ref_model_mixes_the_reference_towards_the_policy(tmp_path):
    """Every ref_model_sync_steps updates: ref = alpha * policy + (1 - alpha) * ref, weight by weight."""
    from grpokit.config.loading import load_config
    from grpokit.training.trainer import Trainer

    config = load_config(None, ["model.name=tiny-random", "model.dtype=float64", "data.eval_size=0",
                                "train.prompts_per_step=2", "rollout.num_generations=2", "reward.functions=[length]",
                                "algorithm.beta=0.04", "algorithm.sync_ref_model=true", "algorithm.ref_model_sync_steps=2",
                                "algorithm.ref_model_mixup_alpha=0.25", "train.learning_rate=1e-2",
                                f"train.output_dir={tmp_path}/run"])
    trainer = Trainer(config, progress=False)
    initial = [p.detach().clone() for p in trainer.reference.parameters()]
    trainer.train_step(1)  # one update: not yet
    assert all(torch.equal(a, b) for a, b in zip(initial, trainer.reference.parameters()))
    trainer.train_step(2)  # the second: mixed
    for ref, start, policy in zip(trainer.reference.parameters(), initial, trainer.policy.parameters()):
        torch.testing.assert_close(ref, 0.25 * policy + 0.75 * start, rtol=0, atol=1e-15)
    assert any(not torch.equal(a, b) for a, b in zip(initial, trainer.reference.parameters()))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_entropy_bonus_of_each_loss_matches_its_formula_and_adds_up_over_micro_batches(loss_type, beta):
    """algorithm.entropy_coef: l_it gains -c H_it, normalized with the rest of the loss: value and
    gradients (towards the log-probs and the entropies) against the naive loop; micro-batches given
    the update's counts add up to the whole batch's, gradients included."""
    logps, old, ref, adv, mask = random_batch(seed=11)
    entropies = torch.rand(logps.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64) * 4
    kw = dict(loss_type=loss_type, beta=beta, epsilon_high=0.28, max_completion_length=9, entropy_coef=0.03)
    a, ea = logps.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
    got, _ = loss_of(a, old, ref, adv, mask, entropies=ea, **kw)
    got.backward()
    b, eb = logps.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
    expected = naive(b, old, ref, adv, mask, objective=OBJECTIVE[loss_type], norm=NORM[loss_type], beta=beta,
                     entropies=eb, entropy_coef=0.03)
    expected.backward()
    assert abs(got.item() - expected.item()) < 1e-12
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(ea.grad, eb.grad, rtol=1e-10, atol=1e-15)
    without, _ = loss_of(logps, old, ref, adv, mask, **{**kw, "entropy_coef": 0.0})
    assert got.item() < without.item()  # a bonus: more entropy, less loss
    parts, total = entropies.clone().requires_grad_(True), 0.0
    for s in (slice(0, 2), slice(2, 3), slice(3, 6)):
        loss, _ = loss_of(logps[s], old[s], ref[s], adv[s], mask[s], entropies=parts[s], num_sequences=6,
                          num_tokens=mask.sum().item(), **kw)
        loss.backward()
        total += loss.item()
    assert abs(total - got.item()) < 1e-12
    torch.testing.assert_close(parts.grad, ea.grad, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs entropies"):
        loss_of(logps, old, ref, adv, mask, **kw)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_teacher_s_signal_in_each_loss_matches_its_formula(loss_type, level):
    """distill.teacher: each token's advantage is A_i - coef (old_logp - teacher_logp), in every
    loss at either ratio level, with a KL term: value and gradient against the naive loop; the
    reverse KL metric is the token sum of old_logp - teacher_logp; micro-batches add up."""
    from grpokit.algorithm.loss import REVERSE_KL

    logps, old, ref, adv, mask = random_batch(seed=11)
    g = torch.Generator().manual_seed(14)
    old = logps + 0.5 * torch.randn(logps.shape, generator=g, dtype=torch.float64)
    teacher = logps + torch.randn(logps.shape, generator=g, dtype=torch.float64)
    kw = dict(beta=0.04, importance_sampling_level=level, distill_coef=0.7)
    metrics, _ = compare(loss_type, dict(level=level, beta=0.04, teacher=teacher, distill_coef=0.7),
                         batch=(logps, old, ref, adv, mask), teacher_logps=teacher, **kw)
    expected = float(((old - teacher) * mask).sum() / mask.sum())
    assert abs(metrics[REVERSE_KL].item() - expected) < 1e-12
    whole, _ = loss_of(logps, old, ref, adv, mask, teacher_logps=teacher, epsilon_high=0.28, max_completion_length=9,
                       loss_type=loss_type, **kw)
    parts = sum(loss_of(logps[s], old[s], ref[s], adv[s], mask[s], teacher_logps=teacher[s], num_sequences=6,
                        num_tokens=mask.sum().item(), epsilon_high=0.28, max_completion_length=9, loss_type=loss_type,
                        **kw)[0].item()
                for s in (slice(0, 1), slice(1, 4), slice(4, 6)))
    assert abs(parts - whole.item()) < 1e-12


def test_a_teacher_s_signal_moves_the_student_to_the_teacher():
    """The sign, on a categorical policy over 6 tokens (its logits the parameters): sampling 4096
    tokens a step, on-policy, the loss with the teacher's log-probs alone (advantages 0) brings the
    reverse KL(student || teacher) from over 1 nat to under 0.01; with the signal's sign flipped
    it grows."""
    teacher = torch.log_softmax(torch.tensor([3.0, 1.0, 0.0, -1.0, 0.5, -2.0], dtype=torch.float64), -1)

    def train(coef: float) -> float:
        theta = torch.zeros(6, dtype=torch.float64, requires_grad=True)
        g = torch.Generator().manual_seed(0)
        optimizer = torch.optim.SGD([theta], lr=1.0)
        for _ in range(100):
            student = torch.log_softmax(theta, -1)
            tokens = torch.multinomial(student.detach().exp(), 4096, replacement=True, generator=g)  # (N,)
            logps = student[tokens][:, None]  # (N, 1)
            loss, _ = loss_of(logps, None, None, torch.zeros(4096, dtype=torch.float64), torch.ones(4096, 1),
                              teacher_logps=teacher[tokens][:, None], distill_coef=coef)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        student = torch.log_softmax(theta.detach(), -1)
        return float((student.exp() * (student - teacher)).sum())

    start = float((torch.full((6,), 1 / 6, dtype=torch.float64) * (math.log(1 / 6) - teacher)).sum())
    assert start > 1 and train(1.0) < 0.01 and train(-1.0) > start


def trainer_on(tmp_path, *overrides):
    from grpokit.config.loading import load_config
    from grpokit.training.trainer import Trainer

    config = load_config(None, ["model.name=tiny-random", "data.eval_size=0", "train.prompts_per_step=2",
                                "rollout.num_generations=4", "reward.functions=[length]", "train.learning_rate=1e-2",
                                f"train.output_dir={tmp_path}/run", *overrides])
    return Trainer(config, progress=False)


def test_a_per_token_term_keeps_the_rows_whose_advantage_is_zero(tmp_path, monkeypatch):
    """Equal rewards everywhere (advantages 0): without a KL term the rows skip their pass and
    nothing moves; with an entropy bonus every row takes part, and the weights move."""
    from grpokit.rewards.reward_set import REWARD_FUNCTIONS

    monkeypatch.setitem(REWARD_FUNCTIONS, "constant", lambda completions, **columns: [1.0] * len(completions))
    for coef in (0.0, 0.1):
        trainer = trainer_on(tmp_path / str(coef), f"algorithm.entropy_coef={coef}", "reward.functions=[constant]")
        start = [p.detach().clone() for p in trainer.policy.parameters()]
        row = trainer.train_step(1)
        moved = not all(torch.equal(a, b) for a, b in zip(start, trainer.policy.parameters()))
        assert row["reward_std"] == 0 and moved == (coef > 0) and (row["grad_norm"] > 0) == (coef > 0)


def test_mask_truncated_completions_leave_the_loss(tmp_path):
    """A random model never samples EOS: every completion is cut by max_completion_length, so with
    mask_truncated_completions nothing is trained (and the metrics still count the completions)."""
    for masked in (False, True):
        trainer = trainer_on(tmp_path / str(masked), f"algorithm.mask_truncated_completions={masked}")
        start = [p.detach().clone() for p in trainer.policy.parameters()]
        row = trainer.train_step(1)
        assert row["completions/clipped_ratio"] == 1.0 and row["reward_std"] > 0
        unchanged = all(torch.equal(a, b) for a, b in zip(start, trainer.policy.parameters()))
        assert unchanged == masked and (row["loss"] == 0) == masked


def test_top_entropy_quantile_keeps_that_share_of_the_update_tokens(tmp_path):
    trainer = trainer_on(tmp_path, "algorithm.top_entropy_quantile=0.25")
    batch = trainer.sampler.sample(trainer.sampler.next_prompts())
    mask = loss_mask(batch.trained_mask, batch.finish_reasons, mask_truncated=False)
    rows = torch.arange(8)
    chosen = high_entropy_tokens(batch.entropies, mask, rows, 0.25)
    entropies = batch.entropies[mask.bool()]
    threshold = torch.quantile(entropies.double(), 0.75)
    assert chosen.sum() == (entropies.double() >= threshold).sum() and 0.2 <= chosen.sum() / mask.sum() <= 0.3
    assert (batch.entropies[chosen] >= batch.entropies[mask.bool() & ~chosen].max()).all()  # the highest ones


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo"])
def test_gspo_on_policy_is_grpo(loss_type):
    """Ratio 1 (one update per step): the sequence ratio's gradient is the mean of its tokens', so
    GSPO's update is the token level's, whatever the lengths and the normalization."""
    logps, _, ref, adv, mask = random_batch(seed=9)
    grads = []
    for level in ("token", "sequence"):
        x = logps.clone().requires_grad_(True)
        loss_of(x, None, ref, adv, mask, loss_type=loss_type, beta=0.04, importance_sampling_level=level)[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)
