"""Advantages, policy losses and AQN schedules against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_pipe.rl.algo.advantages import group_advantages, soft_overlong_penalty, zero_variance_groups
from qerl_pipe.rl.algo.aqn import AqnError, AqnSchedule, clear_noise, draw_noise, noisy_norms
from qerl_pipe.rl.algo.losses import LossNorm, PolicyLossConfig, k3_kl, policy_loss


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # two groups of 3
    # group 1: mean 1/3, unbiased std sqrt(1/3); group 2: mean 2/3, same std
    s = math.sqrt(1 / 3) + 1e-4
    want = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]) / s
    torch.testing.assert_close(group_advantages(r, 3, "group"), want)
    torch.testing.assert_close(group_advantages(r, 3, "none"), want * s)
    batch_std = float(r.std()) + 1e-4
    torch.testing.assert_close(group_advantages(r, 3, "batch"), want * s / batch_std)
    # A zero-variance group gets zero advantage (no NaN), and is flagged for dynamic sampling.
    same = torch.tensor([1.0, 1.0, 0.0, 1.0])
    # group 2: mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(group_advantages(same, 2), torch.tensor([0.0, 0.0, -0.5, 0.5]) / (math.sqrt(0.5) + 1e-4))
    assert zero_variance_groups(same, 2).tolist() == [True, False]
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.zeros(6), 1)


def test_soft_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # max 16, buffer 4: free up to 12, then -(L - 12) / 4, -1 at 16 and beyond
    assert soft_overlong_penalty(lengths, 16, 4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]


def _case():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -0.1], [-0.3, -1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, old, adv, mask


def _per_token_by_hand(logp, old, adv, lo, hi):
    out = []
    for i in range(2):
        row = []
        for t in range(3):
            rho = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            row.append(-min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a))
        out.append(row)
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_policy_loss_aggregations_by_hand(loss_type):
    logp, old, adv, mask = _case()
    cfg = PolicyLossConfig(loss_type=loss_type, eps_low=0.2, eps_high=0.28, max_response_len=5)
    loss, metrics = policy_loss(logp, adv, mask, cfg, old_logp=old)
    pt = _per_token_by_hand(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28)
    rows = [pt[0][:3], pt[1][:2]]  # masked token dropped
    if loss_type == "grpo":
        want = (sum(rows[0]) / 3 + sum(rows[1]) / 2) / 2
    elif loss_type == "dapo":
        want = (sum(rows[0]) + sum(rows[1])) / 5
    else:
        want = (sum(rows[0]) + sum(rows[1])) / (2 * 5)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    # A token is clipped when the clipped term is the smaller objective (the bound is active).
    clipped = 0
    for i, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        rho = math.exp(logp[i, t].item() - old[i, t].item())
        a = adv[i].item()
        clipped += rho * a > min(max(rho, 0.8), 1.28) * a
    assert metrics["clip_fraction"] == pytest.approx(clipped / 5)
    loss.backward()
    assert logp.grad[1, 2] == 0  # masked token gets no gradient


def test_micro_batches_add_up_to_the_full_batch():
    torch.manual_seed(0)
    logp = torch.randn(6, 5)
    old = logp + 0.1 * torch.randn(6, 5)
    adv = torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        cfg = PolicyLossConfig(loss_type=loss_type, max_response_len=5)
        full, _ = policy_loss(logp, adv, mask, cfg, old_logp=old)
        norm = LossNorm.of(mask)
        parts = sum(policy_loss(logp[s], adv[s], mask[s], cfg, old_logp=old[s], norm=norm)[0]
                    for s in (slice(0, 2), slice(2, 6)))
        assert float(parts) == pytest.approx(float(full), rel=1e-6), loss_type


def test_on_policy_gradient_is_advantage_weighted_score():
    # ratio == 1 (old = this policy): d loss / d logp = -A / normaliser per token (dapo).
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.ones(2, 2)
    loss, _ = policy_loss(logp, adv, mask, PolicyLossConfig("dapo"))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))


def test_k3_kl_and_tis():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.0]])
    kl = k3_kl(logp, ref)
    assert kl[0, 0] == 0 and kl[0, 1] == pytest.approx(math.e - 1 - 1)
    cfg = PolicyLossConfig("dapo", kl_coef=0.5)
    loss, m = policy_loss(logp, torch.tensor([0.0]), torch.ones(1, 2), cfg, ref_logp=ref)
    assert float(loss) == pytest.approx(0.5 * (math.e - 2) / 2) and m["kl"] == pytest.approx((math.e - 2) / 2)
    # TIS: per-token weight min(exp(old - rollout), cap), here exp(1) capped at 2.
    cfg = PolicyLossConfig("dapo", tis_cap=2.0)
    base, _ = policy_loss(logp, torch.tensor([1.0]), torch.ones(1, 2), PolicyLossConfig("dapo"))
    weighted, _ = policy_loss(logp, torch.tensor([1.0]), torch.ones(1, 2), cfg, rollout_logp=logp - 1.0)
    assert float(weighted) == pytest.approx(2.0 * float(base))


def test_bad_loss_configs():
    with pytest.raises(ValueError, match="unknown"):
        PolicyLossConfig("ppo")
    with pytest.raises(ValueError, match="max_response_len"):
        PolicyLossConfig("dr_grpo")


def test_aqn_exponential_at_every_stage_boundary():
    s = AqnSchedule("exponential", 1e-2, 1e-4, 10)
    total = 100  # 10 steps per stage
    for k in range(10):
        for step in (10 * k, 10 * k + 9):  # first and last step of stage k
            want = 0.0 if k == 0 else 1e-2 * (1e-4 / 1e-2) ** ((k - 1) / 8)
            assert s.sigma(step, total) == pytest.approx(want, rel=1e-12)
    assert s.sigma(10, total) == pytest.approx(1e-2) and s.sigma(99, total) == pytest.approx(1e-4)


@pytest.mark.parametrize("kind", ["linear", "cosine", "log"])
def test_other_schedules_run_from_start_to_end_monotonically(kind):
    s = AqnSchedule(kind, 1e-2, 5e-4, 6)
    sig = [s.sigma(step, 60) for step in range(60)]
    assert sig[0] == 0 and sig[10] == pytest.approx(1e-2) and sig[59] == pytest.approx(5e-4)
    assert all(a >= b - 1e-15 for a, b in zip(sig[10:], sig[11:]))
    if kind == "linear":
        assert s.sigma(30, 60) == pytest.approx(1e-2 + (5e-4 - 1e-2) * 2 / 4)


def test_aqn_schedule_errors():
    with pytest.raises(AqnError, match="swap"):
        AqnSchedule("exponential", 1e-4, 1e-2)
    with pytest.raises(AqnError, match="unknown"):
        AqnSchedule("step")
    with pytest.raises(AqnError, match="num_stages"):
        AqnSchedule(num_stages=2)
    assert AqnSchedule("none", 0, 0).sigma(5, 10) == 0.0


def test_noise_reaches_the_logits_by_the_expected_amount(tiny_llama):
    from qerl_pipe.model.load import load_model

    model = load_model(tiny_llama, "bf16", dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        clean = model.logits(ids)
        norms = noisy_norms(model)
        assert len(norms) == 2 * model.config.num_layers
        assert draw_noise(model, 0.0) == len(norms)
        assert torch.equal(model.logits(ids), clean)  # sigma 0 changes nothing
        deltas = []
        for sigma in (1e-3, 1e-2):
            draw_noise(model, sigma, torch.Generator().manual_seed(0))
            assert float(norms[0].noise.std()) == pytest.approx(sigma, rel=0.5)
            deltas.append(float((model.logits(ids) - clean).abs().mean()))
        clear_noise(model)
        assert torch.equal(model.logits(ids), clean)
    # Same draw scaled 10x: to first order the logits move 10x as far.
    assert deltas[0] > 0 and deltas[1] / deltas[0] == pytest.approx(10, rel=0.2)


def test_train_plots_label_their_y_axis_and_the_length_plot_marks_the_token_cap():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from qerl_pipe.rl.loop.metrics import plot_figures

    records = [{"step": s, "reward_mean": 0.1 * s, "accuracy": 0.1 * s, "entropy": 1.0, "sigma": 0.01,
                "response_length_mean": 10.0 + s} for s in (1, 2, 3)]
    figures = dict(plot_figures(records, token_cap=16))
    assert set(figures) == {"reward_mean.png", "accuracy.png", "entropy.png", "sigma.png",
                            "response_length_mean.png"}
    for name, fig in figures.items():
        assert fig.axes[0].get_ylabel(), name
    caps = [line for line in figures["response_length_mean.png"].axes[0].get_lines()
            if list(line.get_ydata()) == [16, 16]]
    assert len(caps) == 1 and "max_new_tokens = 16" in caps[0].get_label()
    assert all(len(f.axes[0].get_lines()) == 1 for n, f in figures.items() if n != "response_length_mean.png")
    for fig in figures.values():
        plt.close(fig)
