#!/usr/bin/env python3
"""A real DP x CP trainer (Gloo on CPU) that records lossguard audit captures (docs/semantics.md §10) of its own
loss normalisation, correct or with one of several known bugs.

    torchrun --standalone --nproc-per-node $((DP*CP)) tests/audit/mini_trainer.py \
        --out DIR --dp DP --cp CP --microbatches M --bug none --seed 0 --steps K \
        [--empty-step [K]] [--sparse-step K] [--check-grad] [--no-capture]

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

With several bugs (--bug a,b or --bug all) each runs from the same initial model into DIR/<bug>/.
Captures: DIR/step{k:06d}-rank{r:05d}.safetensors.  With --check-grad also
DIR/grad-step{k}-rank{r}.pt (the final all-reduced, scaled gradient, by parameter name) and
DIR/params-step{k}-rank{r}.pt (the parameters the step's forward used).  --no-capture trains the same way
without a recorder (no capture file; for bench/capture_overhead.py).
"""
import argparse
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


class TinyLM(torch.nn.Module):
    """Embedding + causal prefix mean + tanh + linear head: logits[p] depends on tokens[0..p]."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:      # [T] -> [T, VOCAB]
        e = self.emb(tokens)
        n = torch.arange(1, tokens.numel() + 1, dtype=e.dtype)[:, None]
        return self.head(torch.tanh(e + e.cumsum(0) / n))


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


def make_model(seed: int, dtype=torch.float32) -> TinyLM:
    torch.manual_seed(1000 + seed)
    return TinyLM().to(dtype)


def make_batch(seed: int, step: int, n_samples: int, empty: bool = False, sparse: bool = False):
    """A deterministic batch: list of dicts {tokens [T] int64, T, R, mask [R] int64}.  Sample 1 has an
    empty response, sample 2 a fully masked one, sample 3 is SFT (R == T, mask pre-shifted: last entry 0),
    sample 6 has T = 0.  `empty`: every mask is 0.  `sparse`: every mask is 0 except sample 0's last
    response token (owned by exactly one CP rank)."""
    g = torch.Generator().manual_seed(7919 * seed + 104729 * step + 1)

    def ri(lo, hi):          # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for i in range(n_samples):
        P, R = ri(1, 6), ri(1, 10)
        if i == 1:
            R = 0
        if i == 3:
            P, R = 0, ri(3, 10)
        if i == 6:
            P, R = 0, 0
        T = P + R
        tokens = torch.randint(0, VOCAB, (T,), generator=g, dtype=torch.int64)
        mask = (torch.rand(R, generator=g) < 0.75).to(torch.int64)
        if i == 2:
            mask.zero_()
        if i == 3 and R > 0:
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


def run_step(args, bug, model, opt, step, out_dir, rank, world, dp_rank, cp_rank, dp_group):
    dp, cp, M = args.dp, args.cp, args.microbatches
    empty = args.empty_step is not None and (args.empty_step == "all" or int(args.empty_step) == step)
    sparse = args.sparse_step is not None and args.sparse_step == step
    batch = make_batch(args.seed, step, args.samples, empty=empty, sparse=sparse)
    mbs = placement(len(batch), dp, M)[dp_rank]
    if args.check_grad:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, f"params-step{step}-rank{rank}.pt"))

    capture = not getattr(args, "no_capture", False)
    rec = lc.Recorder(out_dir, step, rank, world, tp=1, pp=1, cp=cp, dp=dp, tp_rank=0, pp_rank=0,
                      cp_rank=cp_rank, dp_rank=dp_rank, cp_layout="zigzag", reduce="per-token") if capture else None
    opt.zero_grad()
    count_local = 0          # the trainer's own count (sum of its num_tokens)
    owned_local = 0          # docs/semantics.md §3 fixed count on this rank
    loss_sum = torch.zeros((), dtype=torch.float64)
    for k, idx in enumerate(mbs):
        samples = [batch[i] for i in idx]
        if not samples:      # uneven split: a dummy micro-batch that carries no loss
            if capture:
                rec.microbatch([], [], [], [], [], cp_size=cp, num_tokens=0, dummy=True)
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
        if capture:
            h = rec.microbatch(idx, [s["tokens"] for s in samples], [s["T"] for s in samples],
                               [s["R"] for s in samples], [s["mask"] for s in samples], cp_size=cp,
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
        if capture:
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
    at = 0
    for p in params:
        p.grad.copy_(flat[at:at + p.numel()].view_as(p))
        at += p.numel()

    skipped = (owned_local == 0) if bug == "local-skip" else (n_used == 0)
    if skipped:
        grad_norm = 0.0
    else:
        grad_norm = float(flat.to(torch.float64).norm())
        opt.step()
    if args.check_grad:
        torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, f"grad-step{step}-rank{rank}.pt"))
    if not capture:
        return
    denom = n_fixed if bug == "microbatch-mean" else (num_tokens_reduced if num_tokens_reduced is not None else n_used)
    rec.finish(grad_scale, num_tokens_reduced=num_tokens_reduced, skipped=skipped, grad_norm=grad_norm,
               global_batch_size=len(batch), metrics_values=torch.stack([torch.tensor(float(denom), dtype=torch.float64), loss_sum]),
               metrics_keys=["nll"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--bug", default="none", help="one of %s, a comma list, or 'all'" % ", ".join(BUGS))
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
    args = ap.parse_args(argv)
    bugs = BUGS if args.bug == "all" else args.bug.split(",")
    for b in bugs:
        if b not in BUGS:
            ap.error(f"unknown --bug {b!r}; choose from {', '.join(BUGS)}")

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
            model = make_model(args.seed, dtype)
            opt = SGD(model.parameters(), lr=0.1)
            for step in range(args.steps):
                run_step(args, bug, model, opt, step, out_dir, rank, world, dp_rank, cp_rank, dp_group)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
