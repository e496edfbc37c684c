"""The RL half of the SEED objective: GRPO with per-step rows and the joint objective (Section 3.3;
coefficients Appendix B.4), as restated in docs/design-notes.md#formulas.

Every per-token tensor is RESPONSE-ALIGNED: `[rows, R]`, R = the longest response in the batch, column k of
row i is response token k of row i, and `mask[i, k] = 1` for k < len(response i). A row is one step of an
episode (the prompt the actor saw and the response it sampled).

    r_i   = R_episode(i) - penalty * (1 - valid_i)                           (invalid-action penalty)
    A_i   = (r_i - mean_G(r)) / (std_G(r) + eps)   over the rows of group G  (unbiased std; ties -> 0)
    ratio = exp(clamp(lp - lp_old, -20, 20))
    pg    = max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)),  A < 0: min(pg, -A c)      (dual clip)
    kl    = clamp(exp(lp_ref - lp) - (lp_ref - lp) - 1, -10, 10)       (k3 estimator)
    L     = <pg> + beta_kl <kl> - c_ent <H> + lambda_opd <opd>_skill   (<.> = global token mean; <.>_skill =
                                                                         mean over the tokens of rows with a skill)

`response_logprobs` is the one place a batch's token log-probs are computed (old, reference, skill-context
and the training forward all go through it); `batch_logprobs` is the one no-grad pass over many rows
(micro-batches, FSDP filler forwards, autocast, trimming): log pi_old, log pi_ref and opd's re-scoring.
`make_rows` turns an update's episodes into its training `Rows` (one per step, with its advantage).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import vision
from parallel import autocast, chunked, reshard


# ----------------------------------------------------------------------------- log-probs of a batch

LOGITS_CHUNK_BYTES = 48 * 2 ** 20   # one float32 copy of a chunk's logits [rows, chunk, V]; its peak is ~4-5 copies


def response_logprobs(model, prompts, responses, pad_id, grad=False, entropy=False):
    """Log-probs of each response token given its prompt, for a batch of rows in one forward.

    prompts, responses: lists of token-id lists (one per row). The batch is laid out as
    [left-padded prompt | right-padded response] of width P + R, position ids follow the attention
    mask (so padding never shifts positions). The model's forward (through its DDP / FSDP wrapper)
    yields the final hidden states; the LM head then runs on chunks of the R response positions,
    so vocab-sized float32 logits exist for one chunk at a time (LOGITS_CHUNK_BYTES), never for
    [rows, R, V] at once. With grad, each chunk is checkpointed: its logits are recomputed in the
    backward instead of kept. Rows whose prompt is a vision.ImagePrompt bring their images: the batch's
    pixel values and image grids go into the same forward (Appendix C.3's visual agents).
    -> (logp [rows, R], mask [rows, R], ent [rows, R] or None); zeros where mask == 0.
    """
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need one prompt per response, got {len(prompts)} and {len(responses)}")
    if min(len(p) for p in prompts) == 0:
        raise ValueError("every row needs a non-empty prompt")
    rows, dev = len(prompts), model.device
    P, R = max(len(p) for p in prompts), max(len(r) for r in responses)
    if R == 0:
        z = torch.zeros(rows, 0, device=dev)
        return z, z.clone(), (z.clone() if entropy else None)
    ids = torch.full((rows, P + R), pad_id, dtype=torch.long)       # [rows, P+R]
    attn = torch.zeros(rows, P + R, dtype=torch.long)               # [rows, P+R]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[i, P:P + len(r)] = torch.tensor(list(r), dtype=torch.long)
        attn[i, P - len(p):P + len(r)] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                        # [rows, P+R] positions from the mask
    lens = torch.tensor([len(r) for r in responses], device=dev)
    mask = (torch.arange(R, device=dev)[None, :] < lens[:, None]).float()   # [rows, R]
    base = getattr(model, "module", model)                          # DDP keeps the model in .module
    visual = vision.pixel_inputs(prompts, dev)                      # {} unless rows carry images
    if visual:   # a VL model builds its 3-D rotary positions from the ids, image grids and mask itself
        pos = None
        visual["mm_token_type_ids"] = (ids == base.config.image_token_id).int()   # [rows, P+R]
    head, seen = base.get_output_embeddings(), []
    hook = base.get_decoder().register_forward_hook(lambda m, i, o: seen.append(o[0]))
    try:
        with torch.set_grad_enabled(grad):
            model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=1, use_cache=False,
                  **visual)
    finally:
        hook.remove()
    hidden = seen[-1][:, P - 1:P + R - 1]                           # [rows, R, H]: position P-1+k predicts token k
    step = max(1, LOGITS_CHUNK_BYTES // (rows * head.weight.shape[0] * 4))   # response positions per chunk
    lps, ents = [], []
    with torch.set_grad_enabled(grad):
        for c in range(0, R, step):
            args = (head, hidden[:, c:c + step], ids[:, P + c:P + c + step], entropy)
            if grad:
                lp, ent = torch.utils.checkpoint.checkpoint(_chunk_stats, *args, use_reentrant=False)
            else:
                lp, ent = _chunk_stats(*args)
            lps.append(lp)
            ents.append(ent)
    logp = torch.cat(lps, 1) * mask                                 # [rows, R]
    ent = torch.cat(ents, 1) * mask if entropy else None            # [rows, R]
    return logp, mask, ent


def _chunk_stats(head, hidden, tokens, entropy):
    """LM head on one chunk: hidden [rows, c, H], tokens [rows, c] -> (log p(token) [rows, c], H or an
    empty placeholder)."""
    logits = head(hidden).float()                                   # [rows, c, V]
    lp = logits.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)   # [rows, c]
    return lp, (entropy_from_logits(logits) if entropy else lp.new_zeros(lp.shape[0], 0))


def entropy_from_logits(logits):
    """H = logsumexp(z) - sum_v softmax(z)_v z_v.   [..., V] -> [...]
    z is shifted by its (detached) max first: H does not change, float32 cancellation does."""
    z = logits - logits.max(dim=-1, keepdim=True).values.detach()              # [..., V]
    return torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(-1)


# ----------------------------------------------------------------------------- no-grad passes over an update's rows

def trim(lp, lengths):
    """[rows, R] -> list of 1-D cpu tensors, one per row, of its response length."""
    lp = lp.detach().float().cpu()
    return [lp[i, :n].clone() for i, n in enumerate(lengths)]


def by_length(idx, prompts, responses):
    """Rows sorted by (prompt, response) length: the [left-padded prompt | right-padded response] layout
    pads the two parts separately, so this key leaves the least padding in each micro-batch
    (bench/RESULTS.md: 0.094 -> 0.015 padded/real tokens on 256 ALFWorld rows)."""
    return sorted(idx, key=lambda i: (len(prompts[i]), len(responses[i])))


@torch.no_grad()
def batch_logprobs(model, rows, pad_id, micro_batch=8, fsdp=False, dtype="float32", order=None):
    """The one no-grad pass over many rows: log pi_old, log pi_ref (seed.py) and lp_skill (opd.rescore, rescore_rows).
    rows: anything with .prompts and .responses (Rows); `order`: the rows to score, in the order they are chunked
    (default: every row, by_length); `micro_batch` rows per forward under autocast(dtype); with `fsdp` every rank
    runs as many forwards (FSDP all-gathers in each), a rank with no rows left a filler forward of row 0, dropped.
    -> one 1-D cpu tensor per row, its response length (None for a row not in `order`)."""
    out = [None] * len(rows)
    order = by_length(range(len(rows)), rows.prompts, rows.responses) if order is None else list(order)
    for idx in chunked(len(order), micro_batch, fsdp):
        batch = [order[j] for j in idx] if idx else [0]   # FSDP filler forward; result dropped
        with autocast(model.device, dtype):
            lp, _, _ = response_logprobs(model, [rows.prompts[i] for i in batch],
                                         [rows.responses[i] for i in batch], pad_id)   # [mb, R]
        if idx:
            for i, t in zip(batch, trim(lp, [len(rows.responses[i]) for i in batch])):
                out[i] = t
    reshard(model)   # FSDP2: the root group (embeddings, LM head) would stay gathered after a no-grad pass
    return out


# ----------------------------------------------------------------------------- rewards and advantages

def row_rewards(episode_rewards, valid, penalty):
    """Row reward: each step row gets its episode's reward minus `penalty` if its action was invalid.
    episode_rewards [rows] (the reward of the row's episode), valid [rows] bool -> [rows] float."""
    r = torch.as_tensor(episode_rewards, dtype=torch.float64)                  # [rows]
    v = torch.as_tensor(valid, dtype=torch.bool)                                # [rows]
    return (r - penalty * (~v).double()).float()                                # [rows]


def group_advantages(rewards, group_ids, eps=1e-6, norm="std", episode_ids=None):
    """GRPO's group advantage: normalize rewards inside each group (same task). -> adv [rows] (float32).

    Step level (default, the official code): every row of the group counts, A = (r - mean) / (std + eps),
    std unbiased. Trajectory level (the paper's formula): pass `episode_ids` [rows]; each episode counts
    once with the mean of its rows' rewards (pass the episode reward R on every row to get R itself), and
    its advantage is broadcast to all its steps. norm="mean_norm" drops the std (A = r - mean).
    A group whose values all tie (or that has one member) gets A = 0 exactly.
    """
    if norm not in ("std", "mean_norm"):
        raise ValueError(f"norm must be 'std' or 'mean_norm', got {norm!r}")
    r = torch.as_tensor(rewards, dtype=torch.float64)                           # [rows]
    g = torch.as_tensor(group_ids)                                              # [rows]
    if episode_ids is not None:                                                 # trajectory level
        e = torch.as_tensor(episode_ids)
        _, ep = torch.unique(e, return_inverse=True)                            # [rows] -> episode index
        n_ep = int(ep.max()) + 1
        cnt = torch.zeros(n_ep, dtype=torch.float64).index_add_(0, ep, torch.ones_like(r))
        ep_r = torch.zeros(n_ep, dtype=torch.float64).index_add_(0, ep, r) / cnt     # [episodes]
        ep_g = torch.zeros(n_ep, dtype=g.dtype).index_copy_(0, ep, g)                # [episodes]
        return group_advantages(ep_r, ep_g, eps, norm)[ep]                      # [rows]
    _, gi = torch.unique(g, return_inverse=True)                                # [rows] -> group index
    n = int(gi.max()) + 1
    cnt = torch.zeros(n, dtype=torch.float64).index_add_(0, gi, torch.ones_like(r))   # [groups]
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, gi, r) / cnt              # [groups]
    dev = r - mean[gi]                                                          # [rows]
    var = torch.zeros(n, dtype=torch.float64).index_add_(0, gi, dev ** 2) / (cnt - 1).clamp(min=1)
    hi = torch.full((n,), -float("inf"), dtype=torch.float64).scatter_reduce(0, gi, r, "amax")
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, gi, r, "amin")
    tied = (hi == lo)[gi]                                                       # [rows]
    adv = dev / (var.sqrt()[gi] + eps) if norm == "std" else dev                # [rows]
    return torch.where(tied, torch.zeros_like(adv), adv).float()


# ----------------------------------------------------------------------------- the training rows

@dataclass
class Rows:
    """The training rows of one update on one rank: one per step. Per-token fields are
    lists of 1-D tensors (response length each), re-padded per micro-batch."""
    prompts: list        # prompt token ids the actor saw
    responses: list      # sampled response token ids
    adv: torch.Tensor = None         # [rows] GRPO group advantage
    has_skill: torch.Tensor = None   # [rows] 1.0 where the row has a teacher context (re-scored, distilled)
    old: list = None     # log pi_old per token
    ref: list = None     # log pi_ref per token
    lp_skill: list = None   # log pi_old per token under the skill-augmented context
    engine: list = None  # log-prob per token as the rollout engine sampled it (Step.engine_logprobs)

    def __len__(self):
        return len(self.prompts)

    def take(self, idx):
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]
        return Rows([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.adv[idx],
                    self.has_skill[idx], pick(self.old), pick(self.ref), pick(self.lp_skill), pick(self.engine))


def pad(seqs, R):
    """list of 1-D tensors -> [rows, R], zero right-padding."""
    out = torch.zeros(len(seqs), R)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s[:R]
    return out


def make_rows(episodes, steps, penalty, cfg, teachers=None):
    """GRPO's inputs: step rows, rewards with the invalid-action penalty, group-normalized advantages; `teachers`
    (opd.row_teachers, where the algo re-scores) marks the rows that have a teacher context (has_skill; else none).
    -> (Rows, row_episode: the index in `episodes` of each row's episode)."""
    row_episode = [e for e, ep in enumerate(episodes) for _ in ep.steps]           # the episode of each row
    r = row_rewards([episodes[e].reward for e in row_episode], [s.valid for s in steps], penalty)   # [rows]
    trajectory = row_episode if cfg.adv_level == "trajectory" else None            # each episode counts once
    adv = group_advantages(r, [episodes[e].group_id for e in row_episode], norm=cfg.adv_norm,
                           episode_ids=trajectory)                                 # [rows]
    has = torch.tensor([1.0 if k else 0.0 for k in teachers or [None] * len(steps)])   # [rows]
    rows = Rows([s.prompt_ids for s in steps], [list(s.response_ids) for s in steps], adv, has,   # ImagePrompts kept
                engine=[torch.tensor(s.engine_logprobs, dtype=torch.float32) for s in steps])
    return rows, row_episode


# ----------------------------------------------------------------------------- per-token loss terms

def policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0):
    """GRPO's clipped surrogate with separate low/high clip and dual clip for A < 0.
    logp, old_logp, mask [rows, R]; adv [rows] -> per-token loss [rows, R] (0 on padding)."""
    A = adv[:, None].to(logp.dtype)                                             # [rows, 1]
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))                # [rows, R]
    pg1 = -A * ratio                                                            # [rows, R]
    pg2 = -A * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)              # [rows, R]
    pg = torch.maximum(pg1, pg2)                                                # [rows, R]
    pg = torch.where(A < 0, torch.minimum(pg, -A * dual_clip), pg)              # [rows, R] dual clip
    return pg * mask


def kl_k3(logp, ref_logp):
    """The KL term: k3 estimator of KL(pi || pi_ref) per token, clamped to [-10, 10]. [rows, R] -> [rows, R].
    The log-ratio is clamped to +-20 first so exp() stays finite."""
    d = torch.clamp(ref_logp - logp, -20.0, 20.0)                               # [rows, R]
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)                     # [rows, R]


def masked_mean(x, mask, num_tokens=None, world=1):
    """Token mean: sum(x * mask) / (max(num_tokens, 1) / world) (num_tokens default: mask.sum()).

    Under DDP pass the GLOBAL count so that every rank's loss is its share of one global token mean;
    summing the ranks' gradients then equals the single-process gradient, however rows are split over
    ranks and micro-batches. DDP *averages* gradients over the world, so pass world = world_size: the
    count is clamped to at least 1 first, then divided (3 global tokens on 8 ranks: 3 / 8, not 1)."""
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=x.dtype, device=x.device)
    return (x * mask).sum() / (torch.clamp(denom, min=1.0) / world)


def joint_loss(terms, mask, coefs=None, opd_mask=None, num_tokens=None, opd_tokens=None, world=1):
    """The joint objective (Section 3.3): L = <pg> + kl_coef <kl> - ent_coef <H> + lambda_opd <opd>_skill.
    terms: {"pg", "kl", "entropy", "opd"} -> per-token [rows, R] (a missing or None term is left out of L);
    coefs: {"kl", "entropy", "opd"} (default the paper's 0.01, 0.001, 0.01). <.> is a token mean over the
    (global) response-token count `num_tokens`; <opd>_skill a token mean over the tokens of rows with a skill
    only (opd_mask [rows, 1] or [rows, R]; their global count `opd_tokens`), as the authors' compute_opd_loss does,
    so lambda_opd does not shrink when analyses fail to parse. No skill token -> the OPD term is 0. `world`:
    the ranks that average the gradients (masked_mean). -> (loss, parts)."""
    coefs = {"kl": 0.01, "entropy": 0.001, "opd": 0.01} | (coefs or {})
    num_tokens = mask.sum() if num_tokens is None else num_tokens                # pg, kl, entropy
    parts = {k: masked_mean(terms[k], mask, num_tokens, world)
             for k in ("pg", "kl", "entropy") if terms.get(k) is not None}
    if terms.get("opd") is not None:
        skill = mask if opd_mask is None else mask * opd_mask                    # [rows, R]
        parts["opd"] = masked_mean(terms["opd"], skill, skill.sum() if opd_tokens is None else opd_tokens, world)
    loss = (parts.get("pg", 0.0) + coefs["kl"] * parts.get("kl", 0.0) - coefs["entropy"] * parts.get("entropy", 0.0)
            + coefs["opd"] * parts.get("opd", 0.0))
    return loss, {k: float(v.detach()) for k, v in parts.items()}


# ----------------------------------------------------------------------------- tied groups

def tied_groups(values, group_ids):
    """-> (groups whose values all tie, groups). On rewards: the groups where GRPO's gradient is zero; on
    group_advantages' output the same groups (a tied group's advantages are all 0, another's never are)."""
    r, g = torch.as_tensor(values, dtype=torch.float64), torch.as_tensor(group_ids)
    groups = torch.unique(g)
    return sum(bool((r[g == k] == r[g == k][0]).all()) for k in groups), len(groups)
