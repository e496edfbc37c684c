"""grpo.py: every formula against hand-computed values, the DDP token-mean invariance, and the batched
response log-probs against a naive per-row computation with the embedded SmolLM2 model."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import rollout  # noqa: E402


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=0)


# ----------------------------------------------------------------------------- rewards and advantages

def test_row_rewards_invalid_penalty():
    r = grpo.row_rewards([10.0, 10.0, 0.0, 1.0], [True, False, False, True], penalty=0.1)
    assert close(r, [10.0, 9.9, -0.1, 1.0])


def test_group_advantages_hand_computed():
    # group 7: rows 1, 2, 3 (interleaved with group 3) -> mean 2, unbiased std 1 -> A = (r - 2) / (1 + 1e-6)
    # group 3: rows 5, 5 tie -> 0; group 9: a single row -> 0
    rewards = [1.0, 5.0, 2.0, 5.0, 3.0, 4.0]
    groups = [7, 3, 7, 3, 7, 9]
    adv = grpo.group_advantages(rewards, groups)
    s = 1.0 + 1e-6
    assert close(adv, [-1 / s, 0.0, 0.0, 0.0, 1 / s, 0.0])
    # unbiased std: rows [0, 0, 0, 10] -> mean 2.5, std sqrt(75 / 3) = 5
    adv = grpo.group_advantages([0.0, 0.0, 0.0, 10.0], [0, 0, 0, 0])
    assert close(adv, [-0.5, -0.5, -0.5, 1.5], tol=1e-5)


def test_tied_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point; a tied group must still give exactly 0, never r-mean / eps noise
    adv = grpo.group_advantages([0.1, 0.1, 0.1, 9.9, 9.9], [0, 0, 0, 1, 1])
    assert torch.equal(adv, torch.zeros(5))


def test_mean_norm_drops_the_std():
    adv = grpo.group_advantages([1.0, 2.0, 6.0, 4.0, 4.0], [0, 0, 0, 1, 1], norm="mean_norm")
    assert close(adv, [-2.0, -1.0, 3.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        grpo.group_advantages([1.0], [0], norm="max")


def test_trajectory_level_counts_each_episode_once():
    # one group, episodes A (3 steps, R=10), B (1 step, R=0), C (2 steps, R=0)
    rewards = [10.0, 10.0, 10.0, 0.0, 0.0, 0.0]
    groups = [0] * 6
    episodes = ["A", "A", "A", "B", "C", "C"]
    traj = grpo.group_advantages(rewards, groups, episode_ids=[{"A": 0, "B": 1, "C": 2}[e] for e in episodes])
    mean, std = 10 / 3, math.sqrt(((20 / 3) ** 2 + 2 * (10 / 3) ** 2) / 2)      # over the 3 episodes
    a, b = (10 - mean) / (std + 1e-6), (0 - mean) / (std + 1e-6)
    assert close(traj, [a, a, a, b, b, b], tol=1e-5)
    assert abs(a - 1.1547) < 1e-4
    # step level weights A's three rows: mean 5, std sqrt(30) -> a different number
    step = grpo.group_advantages(rewards, groups)
    assert close(step, [5 / (math.sqrt(30) + 1e-6)] * 3 + [-5 / (math.sqrt(30) + 1e-6)] * 3, tol=1e-5)
    # an episode's value is the mean of its rows (penalized rows pull it down), mean_norm works too
    traj = grpo.group_advantages([10.0, 9.9, 0.0, 0.0], [0, 0, 0, 0], norm="mean_norm", episode_ids=[0, 0, 1, 1])
    assert close(traj, [4.975, 4.975, -4.975, -4.975], tol=1e-5)


# ----------------------------------------------------------------------------- policy loss, KL, entropy

def _pg(log_ratio, adv, **kw):
    lp = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    loss = grpo.policy_loss(lp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                            torch.ones(1, 1, dtype=torch.float64), **kw)
    loss.sum().backward()
    return loss.item(), lp.grad.item()


def test_policy_loss_hand_computed():
    ln = math.log
    # A > 0: ratio 1.5 is clipped at 1.2 (no gradient); ratio 0.5 is not clipped (max picks -0.5)
    assert _pg(ln(1.5), 1.0) == pytest.approx((-1.2, 0.0))
    assert _pg(ln(0.5), 1.0) == pytest.approx((-0.5, -0.5))
    # A < 0: ratio 0.5 clipped at 0.8; ratio 2 unclipped; ratio 5 hits the dual clip 3 (no gradient)
    assert _pg(ln(0.5), -1.0) == pytest.approx((0.8, 0.0))
    assert _pg(ln(2.0), -1.0) == pytest.approx((2.0, 2.0))
    assert _pg(ln(5.0), -1.0) == pytest.approx((3.0, 0.0))
    assert _pg(ln(5.0), -2.0) == pytest.approx((6.0, 0.0))
    # separate clip ranges (clip-higher)
    assert _pg(ln(1.5), 1.0, clip_high=0.28)[0] == pytest.approx(-1.28)
    assert _pg(ln(0.7), -1.0, clip_low=0.1)[0] == pytest.approx(0.9)
    # log-ratio clamp: a huge ratio stays finite, its gradient too
    for adv in (1.0, -1.0):
        v, g = _pg(50.0, adv)
        assert math.isfinite(v) and math.isfinite(g)
    assert _pg(50.0, 1.0)[0] == pytest.approx(-1.2) and _pg(50.0, -1.0)[0] == pytest.approx(3.0)
    assert _pg(-50.0, 1.0)[0] == pytest.approx(-math.exp(-20))


def test_policy_loss_masks_padding_and_broadcasts_advantage():
    lp = torch.tensor([[0.0, 0.1, 7.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = grpo.policy_loss(lp, torch.zeros_like(lp), torch.tensor([1.0, -2.0]), mask)
    assert close(loss, [[-1.0, -math.exp(0.1), 0.0], [2.0, 0.0, 0.0]])


def test_kl_k3_hand_computed_and_clamped():
    lp = torch.zeros(1, 5)
    ref = torch.tensor([[math.log(2.0), 0.0, -1.0, 30.0, -30.0]])
    kl = grpo.kl_k3(lp, ref)
    expect = [2 - math.log(2) - 1, 0.0, math.exp(-1) + 1 - 1, 10.0, 10.0]   # the last two hit the clamp
    assert close(kl, [expect], tol=1e-6)
    lp = torch.tensor([[-40.0]], requires_grad=True)                        # exp would overflow unclamped
    grpo.kl_k3(lp, torch.tensor([[0.0]])).sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_entropy_from_logits():
    assert close(grpo.entropy_from_logits(torch.zeros(4)), math.log(4))
    z = torch.randn(3, 7, dtype=torch.float64)
    p = torch.softmax(z, -1)
    assert close(grpo.entropy_from_logits(z), -(p * p.log()).sum(-1), tol=1e-10)


# ----------------------------------------------------------------------------- token means and DDP

def test_masked_mean_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert grpo.masked_mean(x, mask).item() == pytest.approx(7 / 3)
    assert grpo.masked_mean(x, mask, num_tokens=7).item() == pytest.approx(1.0)
    assert grpo.masked_mean(x, torch.zeros_like(mask)).item() == 0.0          # no tokens: 0, not NaN


def _toy_loss(theta, rows, mask, num_tokens):
    """A joint loss of the real terms, over rows whose log-probs come from parameters theta."""
    logits = theta[rows]                                                   # [rows, R, V]
    tok = torch.arange(mask.shape[1]) % logits.shape[-1]
    lp = torch.log_softmax(logits, -1)[..., tok].diagonal(dim1=-2, dim2=-1)   # [rows, R]
    old, ref = lp.detach() - 0.05 * (rows[:, None] % 3), lp.detach() + 0.1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[rows]
    pg = grpo.policy_loss(lp, old, adv, mask)
    loss, _ = grpo.joint_loss({"pg": pg, "kl": grpo.kl_k3(lp, ref), "entropy": grpo.entropy_from_logits(logits)},
                              mask, num_tokens=num_tokens)
    return loss


def test_masked_mean_two_ranks_equals_one_process():
    torch.manual_seed(0)
    theta = torch.randn(6, 5, 4, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([5, 1, 3, 2, 4, 1])
    mask = (torch.arange(5)[None] < lens[:, None]).double()                # [6, 5]: uneven token counts
    rows = torch.arange(6)
    one = _toy_loss(theta, rows, mask, None)
    g_one, = torch.autograd.grad(one, theta)
    total = mask.sum()                                                     # the global token count
    # rank 0 holds rows 0-3 in two micro-batches, rank 1 holds rows 4-5; gradients are summed
    parts = [rows[:2], rows[2:4], rows[4:]]
    losses = [_toy_loss(theta, p, mask[p], total) for p in parts]
    g_split = sum(torch.autograd.grad(l, theta)[0] for l in losses)
    assert abs(sum(l.item() for l in losses) - one.item()) < 1e-12
    assert torch.allclose(g_split, g_one, atol=1e-12)
    # the per-rank (local) token mean, averaged over ranks, is NOT the same: the global count matters
    local = [_toy_loss(theta, p, mask[p], None) for p in (rows[:4], rows[4:])]
    assert abs(sum(l.item() for l in local) / 2 - one.item()) > 1e-3


def test_joint_loss_hand_computed():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    pg, kl, ent = (torch.full((2, 2), v) for v in (1.0, 2.0, 3.0))
    opd = torch.tensor([[4.0, 6.0], [100.0, 100.0]])
    has_skill = torch.tensor([[1.0], [0.0]])
    loss, parts = grpo.joint_loss({"pg": pg, "kl": kl, "entropy": ent, "opd": opd}, mask, opd_mask=has_skill)
    # pg/kl/entropy over all 3 tokens; opd over the 2 skill tokens only: (4 + 6) / 2 (row 1 has no skill)
    assert parts == pytest.approx({"pg": 1.0, "kl": 2.0, "entropy": 3.0, "opd": 5.0})
    assert loss.item() == pytest.approx(1.0 + 0.01 * 2.0 - 0.001 * 3.0 + 0.01 * 5.0)
    loss, parts = grpo.joint_loss({"pg": None, "kl": kl, "opd": opd}, mask, {"kl": 0.5, "opd": 2.0}, has_skill)
    assert set(parts) == {"kl", "opd"} and loss.item() == pytest.approx(0.5 * 2.0 + 2.0 * 5.0)   # no pg term


def test_opd_term_is_the_mean_over_skill_tokens():
    """Half the rows have a skill: the OPD term is the mean over their tokens (the authors' opd_mask), not
    over all response tokens; split over two ranks with global counts / world it sums to the same value;
    no skill token at all gives 0."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])   # 9 tokens
    has_skill = torch.tensor([[1.0], [0.0], [1.0], [0.0]])                  # rows 0 and 2: 5 skill tokens
    opd = torch.tensor([[1.0, 2.0, 3.0], [50.0, 0.0, 0.0], [4.0, 5.0, 0.0], [60.0, 60.0, 60.0]])
    zero = torch.zeros(4, 3)
    _, parts = grpo.joint_loss({"pg": zero, "opd": opd}, mask, opd_mask=has_skill)
    assert parts["opd"] == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)          # = 3, not 15 / 9
    loss, _ = grpo.joint_loss({"pg": zero, "opd": opd}, mask, {"opd": 0.5}, has_skill)
    assert loss.item() == pytest.approx(0.5 * 3.0)
    # two ranks (rows 0-1 and 2-3), each dividing by the global counts / world: the shares sum to one mean
    shares = [grpo.joint_loss({"pg": zero[r], "opd": opd[r]}, mask[r], opd_mask=has_skill[r], num_tokens=9 / 2,
                              opd_tokens=5 / 2)[1]["opd"] for r in ([0, 1], [2, 3])]
    assert shares == pytest.approx([6 / 2.5, 9 / 2.5]) and sum(shares) / 2 == pytest.approx(3.0)
    _, parts = grpo.joint_loss({"pg": zero, "opd": opd}, mask, opd_mask=torch.zeros(4, 1))
    assert parts["opd"] == 0.0


def test_tied_groups_hand_computed():
    """Groups whose rewards all tie (GRPO's gradient is zero there): group 0 (1, 1) and group 2 (2, 2) of three."""
    assert grpo.tied_groups([1.0, 1.0, 0.0, 3.0, 2.0, 2.0], [0, 0, 1, 1, 2, 2]) == (2, 3)
    assert grpo.tied_groups(grpo.group_advantages([1.0, 1.0, 0.0, 3.0], [0, 0, 1, 1]), [0, 0, 1, 1]) == (1, 2)


def _naive(model, prompt, response):
    """Per-row, unpadded, full logits: the obvious computation."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    return lp, grpo.entropy_from_logits(logits)


def test_response_logprobs_equals_naive_per_row(smol):
    model, tok = smol
    g = torch.Generator().manual_seed(0)
    prompts = [rollout.chat_ids(tok, "Your task is to: put a clean apple in the fridge. " * k) for k in (1, 4, 2)]
    responses = [torch.randint(200, 40000, (n,), generator=g).tolist() for n in (6, 1, 13)]
    lp, mask, ent = grpo.response_logprobs(model, prompts, responses, tok.pad_token_id, entropy=True)
    assert lp.shape == mask.shape == ent.shape == (3, 13)
    assert mask.sum(1).tolist() == [6, 1, 13]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ref_lp, ref_ent = _naive(model, p, r)
        assert (lp[i, :len(r)].double() - ref_lp).abs().max() < 1e-4
        assert (ent[i, :len(r)].double() - ref_ent).abs().max() < 1e-4
        assert (lp[i, len(r):] == 0).all() and (ent[i, len(r):] == 0).all()
    assert not lp.requires_grad


def test_response_logprobs_gradient(smol):
    model, tok = smol
    prompts = [rollout.chat_ids(tok, "Your task is to: look at the book."), rollout.chat_ids(tok, "Hi")]
    responses = [[504, 3250, 42], [2]]
    lp, mask, _ = grpo.response_logprobs(model, prompts, responses, tok.pad_token_id, grad=True)
    grpo.masked_mean(lp, mask).backward()
    w = model.model.embed_tokens.weight
    assert lp.requires_grad and w.grad is not None and w.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError):
        grpo.response_logprobs(model, [[]], [[1]], tok.pad_token_id)


def test_chunked_logprobs_equal_one_chunk_values_and_gradients(smol, monkeypatch):
    """The LM head over chunks of 3 response positions (checkpointed under grad) gives the values and
    the gradients of one chunk over all positions, within float32 rounding (2e-6 of the largest magnitude:
    a few ulps, as the chunked matmul may block differently; a misplaced chunk is off by whole nats)."""
    model, tok = smol
    g = torch.Generator().manual_seed(1)
    prompts = [rollout.chat_ids(tok, "Your task is to: heat some egg. " * k) for k in (1, 3)]
    responses = [torch.randint(200, 40000, (n,), generator=g).tolist() for n in (11, 7)]
    vocab = model.get_output_embeddings().weight.shape[0]
    params = [model.model.embed_tokens.weight, model.model.layers[-1].mlp.down_proj.weight, model.model.norm.weight]

    def run(chunk_positions):
        monkeypatch.setattr(grpo, "LOGITS_CHUNK_BYTES", chunk_positions * len(prompts) * vocab * 4)
        lp, mask, ent = grpo.response_logprobs(model, prompts, responses, tok.pad_token_id, grad=True, entropy=True)
        (grpo.masked_mean(lp, mask) - 0.1 * grpo.masked_mean(ent, mask)).backward()
        grads = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        return lp.detach(), ent.detach(), grads

    lp1, ent1, g1 = run(11)          # one chunk: the whole response
    lp3, ent3, g3 = run(3)           # four chunks of 3, 3, 3, 2 positions
    tol = lambda x: 2e-6 * max(1.0, float(x.abs().max()))                      # noqa: E731
    assert (lp1 - lp3).abs().max() <= tol(lp1) and (ent1 - ent3).abs().max() <= tol(ent1)
    for a, b in zip(g1, g3):
        assert a.abs().max() > 0 and (a - b).abs().max() <= 5 * tol(a)


def test_masked_mean_clamps_the_global_count_before_the_world():
    """3 global skill tokens on 8 ranks: each rank divides by 3 / 8 (the ranks' averaged gradients then give
    the mean over the 3 tokens), not by max(3 / 8, 1) = 1, which made the OPD term 3/8 of its size; a global
    count of 0 is clamped to 1 before the division, so the term stays 0, never NaN."""
    x, mask = torch.tensor([[2.0, 4.0]]), torch.tensor([[1.0, 0.0]])
    assert grpo.masked_mean(x, mask, num_tokens=3, world=8).item() == pytest.approx(2.0 * 8 / 3)
    assert grpo.masked_mean(x, torch.zeros_like(mask), num_tokens=0, world=8).item() == 0.0
    assert grpo.masked_mean(x, mask, num_tokens=0.5, world=8).item() == pytest.approx(2.0 * 8)
    # ranks 0-2 hold one skill token of value 2.0 each, ranks 3-7 none: DDP's average is the true mean, 2.0
    shares = [grpo.joint_loss({"pg": x * 0, "opd": x}, mask if r < 3 else mask * 0, {"opd": 1.0}, torch.ones(1, 1),
                              num_tokens=3, opd_tokens=3, world=8)[1]["opd"] for r in range(8)]
    assert sum(shares) / 8 == pytest.approx(2.0)


def test_trajectory_level_keeps_the_invalid_action_penalty():
    """--adv_level trajectory: an episode's invalid steps lower its return (R minus the penalty over its share
    of invalid steps), so of two won episodes the one with an invalid step gets the lower advantage."""
    from types import SimpleNamespace as NS
    step = lambda valid: NS(valid=valid, prompt_ids=[1], response_ids=[2], engine_logprobs=[-0.5])
    eps = [NS(steps=[step(True), step(True)], reward=10.0, group_id=0, skill=None),
           NS(steps=[step(True), step(False)], reward=10.0, group_id=0, skill=None)]
    steps = [s for ep in eps for s in ep.steps]
    cfg = NS(adv_level="trajectory", adv_norm="std")
    rows, _ = grpo.make_rows(eps, steps, 0.1, cfg)
    assert rows.adv[0] == rows.adv[1] > 0 > rows.adv[2] == rows.adv[3]


def test_cpu_autocast_only_when_bf16_is_asked():
    """--dtype bfloat16 on a CPU runs the trainer's matmuls in bf16 (the demo's choice where the CPU has bf16
    units); float32 (--dtype auto on a CPU) leaves them in float32, and the weights stay float32 either way."""
    import parallel
    layer, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    with parallel.autocast(torch.device("cpu"), "bfloat16"):
        y = layer(x)
    with parallel.autocast(torch.device("cpu"), "float32"):
        z = layer(x)
    assert y.dtype == torch.bfloat16 and z.dtype == torch.float32 and layer.weight.dtype == torch.float32
    assert torch.allclose(y.float(), z, atol=0.05)
