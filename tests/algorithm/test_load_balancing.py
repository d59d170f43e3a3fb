"""The load-balancing term (algorithm/load_balancing.py) against transformers' load_balancing_loss_func
over one sequence, and a float64 loop written from the formula."""

import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from grpokit.algorithm.load_balancing import sequence_balance


def naive(router_logits, mask, k):
    """b_i = E sum_e f_ie P_ie by loops: f_ie the share of (position, layer) that chose e among their top k."""
    L, B, T, E = router_logits.shape
    out = []
    for i in range(B):
        f, p, n = [0.0] * E, [0.0] * E, 0
        for layer in range(L):
            for t in range(T):
                if not mask[i, t]:
                    continue
                probs = torch.softmax(router_logits[layer, i, t].double(), -1)
                for e in probs.topk(k).indices.tolist():
                    f[e] += 1
                for e in range(E):
                    p[e] += probs[e].item()
                n += 1
        out.append(E * sum(f[e] / n * p[e] / n for e in range(E)))
    return torch.tensor(out, dtype=torch.float64)


def test_each_sequence_is_transformers_loss_of_it_alone_and_the_formula():
    g = torch.Generator().manual_seed(0)
    L, B, T, E, k = 3, 4, 6, 5, 2
    logits = torch.randn(L, B, T, E, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.arange(T) < torch.tensor([6, 3, 1, 4])[:, None]).long()
    balance, counts = sequence_balance(logits, mask, k)
    torch.testing.assert_close(balance, naive(logits.detach(), mask, k), rtol=1e-12, atol=1e-12)
    for i in range(B):  # one sequence, its real positions only: transformers' own loss
        n = int(mask[i].sum())
        alone = tuple(logits[layer, i, :n] for layer in range(L))
        theirs = load_balancing_loss_func(alone, E, k)  # (it computes in float32)
        torch.testing.assert_close(balance[i], theirs.double(), rtol=1e-6, atol=1e-6)
    assert counts.sum() == mask.sum() * L * k  # every trained position, every layer, k choices
    balance.sum().backward()  # the gradient reaches the routers' logits, none at untrained positions
    assert (logits.grad[:, mask == 0] == 0).all() and logits.grad[:, mask == 1].abs().sum() > 0


def test_balanced_routing_gives_k():
    E, k = 4, 2
    logits = torch.zeros(1, 1, 8, E, dtype=torch.float64)
    logits[0, 0, torch.arange(8), torch.arange(8) % E] = 1.0  # each expert first in turn, equal probabilities otherwise
    logits[0, 0, torch.arange(8), (torch.arange(8) + 1) % E] = 1.0
    balance, _ = sequence_balance(logits, torch.ones(1, 8), k)
    torch.testing.assert_close(balance, torch.tensor([float(k)], dtype=torch.float64))
