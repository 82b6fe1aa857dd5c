#!/usr/bin/env python3
"""A real DP x CP trainer (Gloo on CPU) that records lossguard audit captures (docs/semantics.md §10) of its own
loss normalisation, correct or with one of several known bugs.

    torchrun --standalone --nproc-per-node $((DP*CP)) tests/audit/mini_trainer.py \
        --out DIR --dp DP --cp CP --microbatches M --bug none --seed 0 --steps K \
        [--empty-step [K]] [--sparse-step K] [--check-grad] [--no-capture] [--terms [--equal-lengths]]

Ranks are ordered CP fastest (rank = dp_rank*cp + cp_rank: Megatron's tp-cp-ep-dp-pp with TP = PP = 1).
Each step draws a new deterministic batch; DP rank d takes the d-th contiguous block of samples and cuts
it into M contiguous micro-batches (docs/semantics.md §7 placement); CP rank c computes the per-token NLL of the
response tokens it owns under docs/semantics.md §2's zig-zag rule (logits of the whole sequence are computed — the
model is tiny — but only owned tokens enter the loss), hooks the per-token loss tensor with the
recorder, backpropagates each micro-batch (gradient accumulation), all-reduces the gradients over all
DP x CP ranks, scales them by grad_scale, and steps SGD (lr 0.1) unless it skips.

--bug (the per-token objective is claimed in every case; w_t = token_weight_t * grad_scale, the weight
of token t's loss in the final gradient; n_{d,c,k} = CP rank c's owned mask count in micro-batch k of DP
rank d; N = global fixed count; m_i = sample mask sums):
  none               Megatron per-token: L_k = sum owned m_t l_t, num_tokens = n_{d,c,k}, gradients
                     SUM over DP x CP then x 1/max(N,1).  w_t = m_t / max(N, 1).
  microbatch-mean    HF gradient accumulation bug: L_k = sum m_t l_t / n_{d,c,k} / M (NaN value, zero
                     gradient when n = 0), DDP mean grad_scale = 1/(dp*cp).
                     w_t = m_t / (n_{d,c,k} * M * dp * cp).
  count-dp-only      the count all-reduced over the DP group only: N_dp(c) = sum_{d,k} n_{d,c,k}; each
                     rank scales its local gradient by 1/max(N_dp(c),1) BEFORE the DP x CP all-reduce
                     (so replicas stay identical).  w_t = m_t / max(N_dp(c_t), 1).
  full-sample-count  every CP rank counts the full mask sums of its micro-batch's samples:
                     num_tokens = sum_{i in mb} m_i, N' = cp*N.  w_t = m_t / max(cp*N, 1).
  clamp-cp1          Relax before PR #285: at cp == 1 each sample counts max(m_i, 1); cp > 1 as none.
                     w_t = m_t / sum_i max(m_i, 1) at cp == 1.  Skip iff that count is 0 (never, with samples).
  missing-cp-scale   slime's per-token count (full sample, max(m_i,1) per sample, on every CP rank)
                     without its x cp on the loss.  w_t = m_t / (cp * sum_i max(m_i, 1)).  Never skips.
  local-skip         weights as none, but each rank skips from its own count (sum_k n_{d,c,k} == 0):
                     ranks disagree when some own no effective token.
All but local-skip skip iff the trainer's own count all-reduced over DP x CP is 0.

--terms: a multi-term objective (docs/semantics.md §10 terms).  The model gets a second head (MTP); besides
the main per-token NLL l_t, three terms are computed over the rank's owned response tokens, in the same
local order, each hooked separately (h.hook(l, term=NAME)) and declared in Capture(terms=...):
  kl   per-token, coef 0.1,  mask loss:    l_kl_t  = 0.5 (lp_t - ref_lp_t)^2, lp_t = -l_t, ref_lp_t the
       target's log-prob under a frozen copy of the initial model (detached);
  mtp  per-token, coef 0.3,  mask shift:1: l_mtp_t = NLL of the MTP head at the same logit position against
       the target of response index t+1 (0 for the last index: finite, its mask is 0);
       m^mtp_t = m_t m_{t+1} for t+1 < R, else 0;
  aux  per-token, coef 0.01, mask all:     l_aux_t = logsumexp(z_t)^2 (z the main logits) for every owned
       response token, masked or not.
Counts are all-reduced (SUM over DP x CP) BEFORE backward: N = sum of m, N_mtp = sum of m^mtp, A = the
owned response tokens, every rank's summed; the loss is divided inside and grad_scale = 1:
  L_k = sum m l / max(N,1) + 0.1 sum m l_kl / max(N,1) + 0.3 sum m^mtp l_mtp / max(N_mtp,1)
        + 0.01 sum l_aux / max(A,1)
so w^main = m/N, w^kl = 0.1 m/N, w^mtp = 0.3 m^mtp/N_mtp, w^aux = 0.01/A.  Every sample is an RL sample
(sample 3 gets a prompt: an SFT sample's last index is owned by no CP rank, see §2).  --equal-lengths: every
sample has P = 3, R = 6 and an all-ones mask.  --bug (the main term is always correct):
  none                correct.
  kl-microbatch-mean  the KL term divided by the micro-batch's own owned count n_{d,c,k} (max 1):
                      w^kl = 0.1 m / max(n_{d,c,k}, 1).
  mtp-main-count      the MTP term divided by N: w^mtp = 0.3 m^mtp / max(N, 1) (its recorded num_tokens is
                      the loss-mask count it used).
  aux-no-cp           every CP rank counts the full response lengths of its micro-batch's samples (recorded
                      as its aux num_tokens), summed over DP x CP = cp*A, without the x cp:
                      w^aux = 0.01 / (cp*A).
  aux-undeclared      correct weights, but aux is not declared to the recorder while it is hooked.
Recorded per term and micro-batch: token_weight, token_loss, num_tokens (the count the trainer computed:
its owned count under the term's mask, except as noted above).

With several bugs (--bug a,b or --bug all) each runs from the same initial model into DIR/<bug>/.
Captures: DIR/step{k:06d}-rank{r:05d}.safetensors.  With --check-grad also
DIR/grad-step{k}-rank{r}.pt (the final all-reduced, scaled gradient, by parameter name) and
DIR/params-step{k}-rank{r}.pt (the parameters the step's forward used).  --no-capture trains the same way
without recording (Capture(steps=()): no capture file; for bench/capture_overhead.py).
"""
import argparse
import copy
import math
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import lossguard_capture as lc
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
    import lossguard_capture as lc

VOCAB = 32
DIM = 16
BUGS = ["none", "microbatch-mean", "count-dp-only", "full-sample-count", "clamp-cp1", "missing-cp-scale",
        "local-skip"]
TERM_BUGS = ["none", "kl-microbatch-mean", "mtp-main-count", "aux-no-cp", "aux-undeclared"]
#: --terms: the declared terms (reduce, coef, mask), as Capture(terms=...) takes them
TERMS = {"kl": dict(reduce="per-token", coef=0.1, mask="loss"),
         "mtp": dict(reduce="per-token", coef=0.3, mask="shift:1"),
         "aux": dict(reduce="per-token", coef=0.01, mask="all")}


class TinyLM(torch.nn.Module):
    """Embedding + causal prefix mean + tanh + linear head: logits[p] depends on tokens[0..p]."""

    def __init__(self, mtp: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)
        if mtp:          # --terms: a second head predicting one token further (created last: same init above)
            self.mtp_head = torch.nn.Linear(DIM, VOCAB)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:       # [T] -> [T, DIM]
        e = self.emb(tokens)
        n = torch.arange(1, tokens.numel() + 1, dtype=e.dtype)[:, None]
        return torch.tanh(e + e.cumsum(0) / n)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:      # [T] -> [T, VOCAB]
        return self.head(self.hidden(tokens))


class SGD:
    """Plain SGD (no momentum, no weight decay): p -= lr * grad.  torch.optim.SGD computes the same
    update, but importing torch.optim pulls in torch._dynamo (~4 s per process on this machine)."""

    def __init__(self, params, lr: float):
        self.params, self.lr = list(params), lr

    def zero_grad(self):
        for p in self.params:
            p.grad = torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        for p in self.params:
            p.add_(p.grad, alpha=-self.lr)


def make_model(seed: int, dtype=torch.float32, mtp: bool = False) -> TinyLM:
    torch.manual_seed(1000 + seed)
    return TinyLM(mtp=mtp).to(dtype)


def make_batch(seed: int, step: int, n_samples: int, empty: bool = False, sparse: bool = False,
               sft: bool = True, equal: bool = False):
    """A deterministic batch: list of dicts {tokens [T] int64, T, R, mask [R] int64}.  Sample 1 has an
    empty response, sample 2 a fully masked one, sample 3 is SFT (R == T, mask pre-shifted: last entry 0),
    sample 6 has T = 0.  `empty`: every mask is 0.  `sparse`: every mask is 0 except sample 0's last
    response token (owned by exactly one CP rank).  `sft=False`: sample 3 is an RL sample (P >= 1) like the
    others.  `equal`: every sample has P = 3, R = 6 and an all-ones mask (no edge cases)."""
    g = torch.Generator().manual_seed(7919 * seed + 104729 * step + 1)
    if equal:
        return [{"tokens": torch.randint(0, VOCAB, (9,), generator=g, dtype=torch.int64), "T": 9, "R": 6,
                 "mask": torch.ones(6, dtype=torch.int64)} for _ in range(n_samples)]

    def ri(lo, hi):          # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for i in range(n_samples):
        P, R = ri(1, 6), ri(1, 10)
        if i == 1:
            R = 0
        if i == 3:
            P, R = (0 if sft else 1), ri(3, 10)
        if i == 6:
            P, R = 0, 0
        T = P + R
        tokens = torch.randint(0, VOCAB, (T,), generator=g, dtype=torch.int64)
        mask = (torch.rand(R, generator=g) < 0.75).to(torch.int64)
        if i == 2:
            mask.zero_()
        if i == 3 and R > 0 and sft:
            mask[-1] = 0
        if empty or sparse:
            mask.zero_()
        if sparse and i == 0:
            mask[-1] = 1
        out.append({"tokens": tokens, "T": T, "R": R, "mask": mask})
    return out


def split_contiguous(items, parts):
    """Contiguous blocks, the first len % parts of them one longer (docs/semantics.md §7 placement)."""
    base, extra = divmod(len(items), parts)
    out, at = [], 0
    for p in range(parts):
        n = base + (1 if p < extra else 0)
        out.append(items[at:at + n])
        at += n
    return out


def placement(n_samples: int, dp: int, microbatches: int):
    """placement[d][k] = the global sample indices of micro-batch k of DP rank d."""
    return [split_contiguous(block, microbatches) for block in split_contiguous(list(range(n_samples)), dp)]


def owned_positions_targets(tokens, T, R, owned):
    """Logit positions and targets of owned response indices: RL index j is predicted by logit P-1+j
    (target tokens[P+j]); an SFT sample's index j is logit j (target tokens[j+1]; the last has none:
    label 0, as Relax)."""
    if R == T:
        pos = list(owned)
        tgt = [int(tokens[j + 1]) if j + 1 < T else 0 for j in owned]
    else:
        P = T - R
        pos = [P - 1 + j for j in owned]
        tgt = [int(tokens[P + j]) for j in owned]
    return pos, tgt


def per_token_nll(model, tokens, T, R, owned):
    """l_t = -log_softmax(logits[pos])[target] for the owned response indices, in order."""
    pos, tgt = owned_positions_targets(tokens, T, R, owned)
    logits = model(tokens)
    lp = torch.log_softmax(logits[torch.tensor(pos, dtype=torch.int64)], dim=-1)
    return -lp.gather(1, torch.tensor(tgt, dtype=torch.int64)[:, None])[:, 0]


def run_step(args, bug, model, opt, step, cap, out_dir, rank, dp_rank, cp_rank, dp_group):
    """One step of the single-term objective; records it through `cap` (lc.Capture) when it selects the step."""
    dp, cp, M = args.dp, args.cp, args.microbatches
    empty = args.empty_step is not None and (args.empty_step == "all" or int(args.empty_step) == step)
    sparse = args.sparse_step is not None and args.sparse_step == step
    batch = make_batch(args.seed, step, args.samples, empty=empty, sparse=sparse)
    mbs = placement(len(batch), dp, M)[dp_rank]
    if args.check_grad:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, f"params-step{step}-rank{rank}.pt"))

    opt.zero_grad()
    count_local = 0          # the trainer's own count (sum of its num_tokens)
    owned_local = 0          # docs/semantics.md §3 fixed count on this rank
    loss_sum = torch.zeros((), dtype=torch.float64)
    with cap.step(step) as rec:      # --no-capture: an inactive step; `rec.active` skips building the records
        for k, idx in enumerate(mbs):
            samples = [batch[i] for i in idx]
            if not samples:      # uneven split: a dummy micro-batch that carries no loss
                if rec.active:
                    rec.microbatch(sample_indices=[], tokens=[], total_lengths=[], response_lengths=[],
                                   loss_masks=[], cp_size=cp, num_tokens=0, dummy=True)
                continue
            pieces, masks = [], []
            for s in samples:
                owned = lc.zigzag_owned(s["T"], s["R"], cp, cp_rank)
                if owned:
                    pieces.append(per_token_nll(model, s["tokens"], s["T"], s["R"], owned))
                    masks.append(s["mask"][torch.tensor(owned, dtype=torch.int64)])
            if pieces:
                l = torch.cat(pieces)
                m = torch.cat(masks).to(l.dtype)
            else:                # owns nothing here: an empty per-token loss still on the graph
                l = model.head.bias[:0] * 1.0
                m = torch.zeros(0, dtype=l.dtype)
            n_owned = int(sum(int(x.sum()) for x in masks))
            m_full = [int(s["mask"].sum()) for s in samples]
            clamped = sum(max(x, 1) for x in m_full)
            if bug == "full-sample-count":
                num_tokens = sum(m_full)
            elif bug == "missing-cp-scale" or (bug == "clamp-cp1" and cp == 1):
                num_tokens = clamped
            else:
                num_tokens = n_owned
            if rec.active:
                h = rec.microbatch(sample_indices=idx, tokens=[s["tokens"] for s in samples],
                                   total_lengths=[s["T"] for s in samples],
                                   response_lengths=[s["R"] for s in samples],
                                   loss_masks=[s["mask"] for s in samples], cp_size=cp,
                                   num_tokens=torch.tensor(num_tokens, dtype=torch.int64))
                h.hook(l)
            summed = (l * m).sum()
            if bug == "microbatch-mean":
                if n_owned > 0:
                    L = summed / n_owned / M
                else:            # a mean over zero tokens: NaN value, zero gradient (as cross_entropy's mean)
                    L = summed * 0.0 + float("nan")
            else:
                L = summed
            if rec.active:
                h.loss(L)
            L.backward()
            count_local += num_tokens
            owned_local += n_owned
            loss_sum += summed.detach().to(torch.float64)

        counts = torch.tensor([count_local, owned_local], dtype=torch.int64)
        dist.all_reduce(counts)
        n_used, n_fixed = int(counts[0]), int(counts[1])
        dist.all_reduce(loss_sum)
        num_tokens_reduced = n_used
        if bug == "microbatch-mean":
            grad_scale = 1.0 / (dp * cp)
            num_tokens_reduced = None
        elif bug == "count-dp-only":
            n_dp = torch.tensor(count_local, dtype=torch.int64)
            dist.all_reduce(n_dp, group=dp_group)
            num_tokens_reduced = int(n_dp)
            grad_scale = 1.0 / max(num_tokens_reduced, 1)
        else:
            grad_scale = 1.0 / max(n_used, 1)

        params = list(model.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if bug == "count-dp-only":   # per-rank scale: applied before the sum keeps replicas identical
            flat.mul_(grad_scale)
            dist.all_reduce(flat)
        else:
            dist.all_reduce(flat)
            flat.mul_(grad_scale)
        skipped = (owned_local == 0) if bug == "local-skip" else (n_used == 0)
        grad_norm = apply_step(model, params, flat, opt, skipped, args, out_dir, step, rank)
        if rec.active:
            denom = n_fixed if bug == "microbatch-mean" else (num_tokens_reduced if num_tokens_reduced is not None
                                                               else n_used)
            rec.finish(grad_scale=grad_scale, num_tokens_reduced=num_tokens_reduced, skipped=skipped,
                       grad_norm=grad_norm, global_batch_size=len(batch),
                       metrics_values=torch.stack([torch.tensor(float(denom), dtype=torch.float64), loss_sum]),
                       metrics_keys=["nll"])


def term_targets(tokens, T, R, owned):
    """Logit positions, main targets and MTP targets of owned response indices: the MTP head at the
    logit predicting index t predicts index t+1's target (one token further; 0 for the last index, whose
    m^mtp is 0)."""
    pos, tgt = owned_positions_targets(tokens, T, R, owned)
    nxt = [owned_positions_targets(tokens, T, R, [j + 1])[1][0] if j + 1 < R else 0 for j in owned]
    return pos, tgt, nxt


def owned_term_masks(s, owned):
    """The owned tokens' loss mask m_t and MTP mask m_t * m_{t+1} (0 where t+1 >= R), local order."""
    m, R = s["mask"].tolist(), s["R"]
    return [m[j] for j in owned], [m[j] * m[j + 1] if j + 1 < R else 0 for j in owned]


def per_token_terms(model, ref, tokens, T, R, owned):
    """(l, l_kl, l_mtp, l_aux) for the owned response indices, in order (--terms)."""
    pos, tgt, nxt = term_targets(tokens, T, R, owned)
    pos = torch.tensor(pos, dtype=torch.int64)
    tgt = torch.tensor(tgt, dtype=torch.int64)[:, None]
    h = model.hidden(tokens)[pos]
    z = model.head(h)
    lp = torch.log_softmax(z, dim=-1).gather(1, tgt)[:, 0]
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(tokens)[pos], dim=-1).gather(1, tgt)[:, 0]
    l_kl = 0.5 * (lp - ref_lp) ** 2
    l_mtp = -torch.log_softmax(model.mtp_head(h), dim=-1).gather(1, torch.tensor(nxt, dtype=torch.int64)[:, None])[:, 0]
    l_aux = torch.logsumexp(z, dim=-1) ** 2
    return -lp, l_kl, l_mtp, l_aux


def run_terms_step(args, bug, model, ref, opt, step, cap, out_dir, rank):
    """One step of the multi-term objective (--terms; module docstring)."""
    dp, cp, M = args.dp, args.cp, args.microbatches
    dp_rank, cp_rank = divmod(rank, cp)
    batch = make_batch(args.seed, step, args.samples, sft=False, equal=args.equal_lengths)
    mbs = placement(len(batch), dp, M)[dp_rank]
    if args.check_grad:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, f"params-step{step}-rank{rank}.pt"))
    # every count the loss divides by, all-reduced over DP x CP before any backward
    plan = []
    for idx in mbs:
        samples = [batch[i] for i in idx]
        owned = [lc.zigzag_owned(s["T"], s["R"], cp, cp_rank) for s in samples]
        m, m_mtp = [], []
        for s, o in zip(samples, owned):
            a, b = owned_term_masks(s, o)
            m += a
            m_mtp += b
        plan.append({"samples": samples, "owned": owned, "m": m, "m_mtp": m_mtp, "n": sum(m),
                     "n_mtp": sum(m_mtp), "n_all": len(m), "full": sum(s["R"] for s in samples)})
    n_aux = [p["full"] if bug == "aux-no-cp" else p["n_all"] for p in plan]        # the aux count it computes
    n_mtp = [p["n"] if bug == "mtp-main-count" else p["n_mtp"] for p in plan]       # the MTP count it uses
    counts = torch.tensor([sum(p["n"] for p in plan), sum(n_mtp), sum(n_aux)], dtype=torch.int64)
    dist.all_reduce(counts)
    N, N_mtp, A = (int(x) for x in counts)

    opt.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float64)
    coef = {name: d["coef"] for name, d in TERMS.items()}
    with cap.step(step) as rec:
        for k, (idx, p) in enumerate(zip(mbs, plan)):
            if not idx:      # uneven split: a dummy micro-batch that carries no loss
                rec.microbatch(sample_indices=[], tokens=[], total_lengths=[], response_lengths=[],
                               loss_masks=[], cp_size=cp, num_tokens=0, dummy=True)
                continue
            pieces = [per_token_terms(model, ref, s["tokens"], s["T"], s["R"], o)
                      for s, o in zip(p["samples"], p["owned"]) if o]
            if pieces:
                l, l_kl, l_mtp, l_aux = (torch.cat(parts) for parts in zip(*pieces))
            else:            # owns nothing here: empty per-token losses still on the graph
                l, l_kl, l_mtp, l_aux = (model.head.bias[:0] * 1.0 for _ in range(4))
            m = torch.tensor(p["m"], dtype=l.dtype)
            m_mtp = torch.tensor(p["m_mtp"], dtype=l.dtype)
            h = rec.microbatch(sample_indices=idx, tokens=[s["tokens"] for s in p["samples"]],
                               total_lengths=[s["T"] for s in p["samples"]],
                               response_lengths=[s["R"] for s in p["samples"]],
                               loss_masks=[s["mask"] for s in p["samples"]], cp_size=cp,
                               num_tokens=torch.tensor(p["n"], dtype=torch.int64))
            h.hook(l)
            for name, x, n in (("kl", l_kl, p["n"]), ("mtp", l_mtp, n_mtp[k]), ("aux", l_aux, n_aux[k])):
                h.hook(x, term=name)
                h.set(num_tokens=torch.tensor(n, dtype=torch.int64), term=name)
            d_kl = max(p["n"], 1) if bug == "kl-microbatch-mean" else max(N, 1)
            summed = (l * m).sum()
            L = (summed / max(N, 1) + coef["kl"] * (l_kl * m).sum() / d_kl
                 + coef["mtp"] * (l_mtp * m_mtp).sum() / max(N_mtp, 1) + coef["aux"] * l_aux.sum() / max(A, 1))
            h.loss(L)
            L.backward()
            loss_sum += summed.detach().to(torch.float64)
        dist.all_reduce(loss_sum)
        params = list(model.parameters())
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        dist.all_reduce(flat)            # SUM over DP x CP; the counts were divided inside: grad_scale = 1
        skipped = N == 0
        grad_norm = apply_step(model, params, flat, opt, skipped, args, out_dir, step, rank)
        rec.finish(grad_scale=1.0, num_tokens_reduced=N, skipped=skipped, grad_norm=grad_norm,
                   global_batch_size=len(batch),
                   metrics_values=torch.stack([torch.tensor(float(N), dtype=torch.float64), loss_sum]),
                   metrics_keys=["nll"])


def apply_step(model, params, flat, opt, skipped, args, out_dir, step, rank):
    """The step's end, both modes: the all-reduced, scaled gradient `flat` written back into every
    parameter, the optimizer stepped unless `skipped`, the gradient saved with --check-grad. Returns the
    norm reported (0.0 when skipped)."""
    at = 0
    for q in params:
        q.grad.copy_(flat[at:at + q.numel()].view_as(q))
        at += q.numel()
    if skipped:
        grad_norm = 0.0
    else:
        grad_norm = float(flat.to(torch.float64).norm())
        opt.step()
    if args.check_grad:
        torch.save({n: q.grad.detach().clone() for n, q in model.named_parameters()},
                   os.path.join(out_dir, f"grad-step{step}-rank{rank}.pt"))
    return grad_norm


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--bug", default="none", help="one of %s (with --terms: %s), a comma list, or 'all'"
                    % (", ".join(BUGS), ", ".join(TERM_BUGS)))
    ap.add_argument("--reduce", default="per-token", choices=["per-token"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--empty-step", nargs="?", const="all", default=None,
                    help="make every mask 0: on step K, or on every step without K")
    ap.add_argument("--sparse-step", type=int, default=None,
                    help="on step K every mask is 0 but sample 0's last response token")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--check-grad", action="store_true")
    ap.add_argument("--no-capture", action="store_true", help="train without recording (no capture files)")
    ap.add_argument("--terms", action="store_true", help="the multi-term objective: main + kl, mtp, aux")
    ap.add_argument("--equal-lengths", action="store_true",
                    help="with --terms: every sample P = 3, R = 6, all-ones mask")
    args = ap.parse_args(argv)
    known = TERM_BUGS if args.terms else BUGS
    bugs = known if args.bug == "all" else args.bug.split(",")
    for b in bugs:
        if b not in known:
            ap.error(f"unknown --bug {b!r}{' with --terms' if args.terms else ''}; choose from {', '.join(known)}")
    if args.equal_lengths and not args.terms:
        ap.error("--equal-lengths needs --terms")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.dp * args.cp:
        raise SystemExit(f"world size {world} != dp*cp = {args.dp * args.cp}")
    dp_rank, cp_rank = divmod(rank, args.cp)
    dp_group = None
    for c in range(args.cp):       # every rank creates every group, in the same order
        g = dist.new_group([d * args.cp + c for d in range(args.dp)])
        if c == cp_rank:
            dp_group = g
    dtype = getattr(torch, args.dtype)
    try:
        for bug in bugs:
            out_dir = os.path.join(args.out, bug) if len(bugs) > 1 else args.out
            os.makedirs(out_dir, exist_ok=True)
            model = make_model(args.seed, dtype, mtp=args.terms)
            opt = SGD(model.parameters(), lr=0.1)
            terms = None
            if args.terms:
                ref = copy.deepcopy(model).requires_grad_(False)       # frozen: the initial model
                terms = {n: d for n, d in TERMS.items() if not (bug == "aux-undeclared" and n == "aux")}
            # one per run: rank, world and the coordinates (cp_rank, dp_rank) found from the process group
            cap = lc.Capture(out_dir, reduce="per-token", cp=args.cp, terms=terms,
                             steps=() if args.no_capture else None)
            for step in range(args.steps):
                if args.terms:
                    run_terms_step(args, bug, model, ref, opt, step, cap, out_dir, rank)
                else:
                    run_step(args, bug, model, opt, step, cap, out_dir, rank, dp_rank, cp_rank, dp_group)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
