#!/usr/bin/env python3
"""Runs TRL's real ``GRPOTrainer.train`` (and ``SFTTrainer.train``) on a tiny Llama built from a config with a
tokenizer built in-process (CPU, generation by ``model.generate``, no vLLM, no downloads), each configuration
twice from the same seed — with the lossguard adapter (``lossguard_capture.trl``) attached and without — and
writes what tests/trainers/test_trl_trainer.py compares.

    python tests/trainers/trl_driver.py --out DIR --configs grpo,dapo,dapo-spg4,...      # one process
    torchrun --standalone --nproc-per-node 2 tests/trainers/trl_driver.py --out DIR --configs ...

A config is a name of :data:`CONFIGS` (a GRPO ``loss_type`` and the options that matter), or ``sft``
(SFTTrainer on prompt/completion pairs, completion-only loss).  Every run: 2 completions (``num_generations``)
per prompt, 2 per device and micro-batch, gradient accumulation 2, ``max_completion_length`` 8, SGD, no
clipping, 2 optimizer steps (both captured).  Per config and run (``DIR/<config>/{adapter,plain}/``):

* ``losses-rank{r}.pt`` — every micro-batch's ``training_step`` return value (detached), in order;
* ``grads-step{n}-rank{r}.pt`` — every parameter's ``.grad`` at ``on_pre_optimizer_step`` (after backward and
  DDP, before the optimizer);
* ``params-step{n}-rank{r}.pt`` — the parameters the step's forward used;
* ``captures/step{n:06d}/`` (adapter runs) — the adapter's capture files;
* ``want-step{n}-rank{r}.pt`` (adapter runs) — this rank's ``sum_k sum_t w^k_t grad(l^k_t)``: the captured
  weights ``w_t = token_weight_t * grad_scale`` of every term (the main one; GRPO's entropy bonus) times the
  gradient of the trainer's own per-token losses, recomputed in float64 on the step's parameters from the
  micro-batch's inputs (GRPO: the trainer's own ``_compute_loss`` on a float64 copy of the model, its
  ``per_token_loss`` and ``entropies``; SFT: ``-log_softmax`` of the captured tokens);
* ``meta-rank{r}.json`` — versions, the resolved GRPO sizes, in-run audit results.

On a TRL whose SFTTrainer the adapter refuses (< ``lossguard_capture.trl.SFT_SINCE``), config ``sft`` only
attaches: the error attach raises goes to ``DIR/sft/refused-rank{r}.json`` and nothing is trained.

``--hf-on-sft``: attach ``lossguard_capture.hf`` (the plain Trainer adapter) to an SFTTrainer and write the
error it raises to ``DIR/hf-on-sft.json``.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from packaging.version import Version  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import lossguard_capture as lc  # noqa: E402
import lossguard_capture.trl as ltrl  # noqa: E402

TRL = Version(trl.__version__)
#: TRL 1.15 patches the model's forward with its fused LM head (GRPO and SFT, trl/trainer/utils.py
#: add_fused_lm_head); before, GRPO scores completions from the full logits and the helper does not exist.
FUSED_LM_HEAD = TRL >= Version("1.15.0")
#: Whether the adapter measures SFTTrainer on this TRL (below it, attach refuses: lossguard_capture.trl.SFT_SINCE).
SFT_MEASURED = TRL >= Version(ltrl.SFT_SINCE)
if FUSED_LM_HEAD:
    from trl.trainer.utils import add_fused_lm_head

SEED = 1234
BS = 2                    # per_device_train_batch_size
GA = 2                    # gradient_accumulation_steps
GENS = 2                  # num_generations
MAX_COMPLETION = 8        # max_completion_length
STEPS = 2                 # optimizer steps per run (both captured)
ENT_COEF = 0.05           # entropy_coef of the -entropy configs (enters the loss as -ENT_COEF * entropy_loss)
WORDS = ["<pad>", "<eos>", "<unk>"] + [chr(ord("a") + i) for i in range(13)]
PAD, EOS = 0, 1
VOCAB = len(WORDS)

#: GRPO configurations: GRPOConfig overrides.  Every loss_type of TRL 1.16 at least once.
CONFIGS = {
    "grpo": dict(loss_type="grpo"),
    "grpo-trunc": dict(loss_type="grpo", mask_truncated_completions=True),     # completions with m_i = 0
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),      # per_token_loss [B, 1]
    "sapo": dict(loss_type="sapo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", per_device_train_batch_size=3),      # B = 6 per step: not M*M
    "dapo": dict(loss_type="dapo"),
    "dapo-beta": dict(loss_type="dapo", beta=0.1),                             # + beta * KL in per_token_loss
    "dapo-spg4": dict(loss_type="dapo", steps_per_generation=4),               # generation batch = 2 steps
    "dapo-spg1": dict(loss_type="dapo", steps_per_generation=1),               # generation batch = 1 micro-batch
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "vespo": dict(loss_type="vespo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "luspo-token": dict(loss_type="luspo"),
    "dapo-bf16": dict(loss_type="dapo", bf16=True),                            # TRL's default mixed precision
    "dapo-entropy": dict(loss_type="dapo", entropy_coef=ENT_COEF),             # + the entropy bonus, a term of its own
    "bnpo-entropy": dict(loss_type="bnpo", entropy_coef=ENT_COEF),
}
PROMPTS = ["a b", "c d e", "f", "g h i j", "k l", "m a b c d", "e f g", "h", "i j k", "l m", "a", "b c d e f g",
           "d e", "f g h", "i", "j k l m"]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS (whitespace-separated), built in-process."""
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")          # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=PAD, bos_token_id=None, eos_token_id=EOS, tie_word_embeddings=False)


def make_model(path=None) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    m = LlamaForCausalLM(model_config())
    if path is not None:          # the reference model of beta != 0 is loaded from the policy's name_or_path
        m.save_pretrained(path)
        m.config._name_or_path = path
    return m


def reward(completions, **kw):
    """A deterministic reward: the number of 'a' and 'b' in the completion, plus a little for its length."""
    return [float(sum(w in ("a", "b") for w in c.split()) + 0.1 * len(c.split())) for c in completions]


class RecordingMixin:
    """Keeps what training_step returns, and (``keep_inputs``) every training micro-batch's prepared inputs."""

    def _init_recording(self, keep_inputs):
        self.step_losses = []
        self.kept_inputs = [] if keep_inputs else None

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_losses.append(loss.detach().clone())
        return loss

    def _prepare_inputs(self, inputs):
        out = super()._prepare_inputs(inputs)
        if self.kept_inputs is not None and self.model.training and len(self.kept_inputs) < STEPS * GA:
            self.kept_inputs.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                     for k, v in out.items()})
        return out


class RecordingGRPOTrainer(RecordingMixin, GRPOTrainer):
    def __init__(self, *a, keep_inputs=False, **k):
        super().__init__(*a, **k)
        self._init_recording(keep_inputs)


class RecordingSFTTrainer(RecordingMixin, SFTTrainer):
    def __init__(self, *a, keep_inputs=False, **k):
        super().__init__(*a, **k)
        self._init_recording(keep_inputs)


class GradDump(TrainerCallback):
    """Saves the parameters at a step's start and the gradients the optimizer is about to apply."""

    def __init__(self, out, rank):
        self.out, self.rank = out, rank

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step < STEPS:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                       os.path.join(self.out, f"params-step{state.global_step}-rank{self.rank}.pt"))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step < STEPS:
            torch.save({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                        for n, p in model.named_parameters()},
                       os.path.join(self.out, f"grads-step{state.global_step}-rank{self.rank}.pt"))


def common_args(out, world):
    return dict(output_dir=os.path.join(out, "trl-out"), per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                max_steps=STEPS, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no",
                logging_strategy="no", eval_strategy="no", seed=SEED, data_seed=SEED, dataloader_num_workers=0,
                disable_tqdm=True, ddp_backend="gloo" if world > 1 else None, ddp_find_unused_parameters=False,
                bf16=False)


def grpo_trainer(config, out, world, keep_inputs=False):
    over = dict(CONFIGS[config])
    args = GRPOConfig(**{**common_args(out, world), **over}, num_generations=GENS, max_completion_length=MAX_COMPLETION)
    model = make_model(os.path.join(out, "init-model") if over.get("beta") else None)
    return RecordingGRPOTrainer(model=model, reward_funcs=reward, args=args,
                                train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer(),
                                keep_inputs=keep_inputs)


def sft_dataset():
    g = torch.Generator().manual_seed(SEED)
    rows = []
    for i in range(16):
        p = int(torch.randint(1, 5, (1,), generator=g))
        c = int(torch.randint(1, 7, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (p + c,), generator=g).tolist()
        # SFTTrainer tokenizes prompt + completion as one string: the completion starts with its separator
        rows.append({"prompt": " ".join(WORDS[t] for t in ids[:p]),
                     "completion": "".join(" " + WORDS[t] for t in ids[p:])})
    return Dataset.from_list(rows)


def sft_trainer(out, world, keep_inputs=False):
    args = SFTConfig(**common_args(out, world), max_length=32)
    return RecordingSFTTrainer(model=make_model(), args=args, train_dataset=sft_dataset(),
                               processing_class=tokenizer(), keep_inputs=keep_inputs)


def verify_grpo(trainer, out, rank):
    """want-step{n}: sum over this rank's micro-batches and terms of sum_t w_t grad(l_t), l_t the trainer's own
    per_token_loss (main) and entropies (term entropy) recomputed by GRPOTrainer._compute_loss on a float64 copy
    of the step's model — or, under bf16 autocast (the precision is then autocast's, not the model's), on a
    float32 copy as the run had it.

    The copy is made as the trainer made its model: TRL's fused LM head where this TRL adds one (1.15+, in
    GRPOTrainer.__init__), then the run's own ``accelerator.prepare_model`` (``evaluation_mode``: no DDP
    wrapper).  Under bf16 that wraps the forward in autocast and casts its outputs to float32, as ``train``
    did to the trainer's model; TRL < 1.15 calls the model with no autocast of its own (it computes the
    log-probabilities from these float32 logits), so without it the copy would score the tokens in float32
    where the run scored them from bf16 logits.  Without mixed precision it changes nothing."""
    trainer.model.train()
    dtype = torch.float32 if trainer.args.bf16 else torch.float64
    for n in range(STEPS):
        params = torch.load(os.path.join(out, f"params-step{n}-rank{rank}.pt"))
        model = LlamaForCausalLM(model_config())
        model.load_state_dict(params)
        model = model.to(dtype).train()
        if FUSED_LM_HEAD:
            add_fused_lm_head(model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
        model = trainer.accelerator.prepare_model(model, evaluation_mode=True)
        t = load_file(os.path.join(out, "captures", f"step{n:06d}", f"step{n:06d}-rank{rank:05d}.safetensors"))
        gs = t["grad_scale"].to(dtype)
        total = 0.0
        for k in range(GA):
            inputs = trainer.kept_inputs[n * GA + k]
            grab = ltrl._ReturnLocals(ltrl._GRPO_CODE, ("per_token_loss", "entropies"))
            with grab:
                GRPOTrainer._compute_loss(trainer, model, inputs)
            X = grab.found["per_token_loss"]
            B, C = inputs["completion_ids"].shape
            w = (t[f"mb.{k}.token_weight"].to(dtype) * gs).view(B, C)
            total = total + (w * X).sum()          # X [B, C], or [B, 1] broadcast over the sequence
            if f"mb.{k}.term.entropy.token_weight" in t:
                we = (t[f"mb.{k}.term.entropy.token_weight"].to(dtype) * gs).view(B, C)
                total = total + (we * grab.found["entropies"]).sum()
        names = [nm for nm, _ in model.named_parameters()]
        grads = torch.autograd.grad(total, [p for _, p in model.named_parameters()], allow_unused=True)
        torch.save({nm: (g if g is not None else torch.zeros_like(p)) for nm, g, p in
                    zip(names, grads, model.parameters())}, os.path.join(out, f"want-step{n}-rank{rank}.pt"))


def verify_sft(out, rank):
    """want-step{n}: sum_t w_t grad(l_t), l_t = -log_softmax(logits[j])[tokens[j+1]] in float64 from the
    captured tokens (right padding: a real position never attends to a pad)."""
    for n in range(STEPS):
        params = torch.load(os.path.join(out, f"params-step{n}-rank{rank}.pt"))
        model = LlamaForCausalLM(model_config())
        model.load_state_dict(params)
        model = model.double()
        t = load_file(os.path.join(out, "captures", f"step{n:06d}", f"step{n:06d}-rank{rank:05d}.safetensors"))
        gs = t["grad_scale"].double()
        total = 0.0
        for k in range(GA):
            L = int(t[f"mb.{k}.total_lengths"][0])
            toks = t[f"mb.{k}.tokens"].view(-1, L)
            w = (t[f"mb.{k}.token_weight"].double() * gs).view(-1, L - 1)
            logits = model(input_ids=toks).logits
            lt = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), toks[:, 1:].reshape(-1),
                                                   reduction="none").view(-1, L - 1)
            total = total + (w * lt).sum()
        total.backward()
        torch.save({nm: p.grad.clone() for nm, p in model.named_parameters()},
                   os.path.join(out, f"want-step{n}-rank{rank}.pt"))


def refused_sft(out, rank, world, lossguard_bin):
    """A TRL whose SFTTrainer the adapter does not measure: attach must refuse it; its message is kept."""
    os.makedirs(out, exist_ok=True)
    trainer = sft_trainer(out, world)
    err = None
    try:
        ltrl.attach(trainer, os.path.join(out, "captures"), steps=range(STEPS), lossguard_bin=lossguard_bin)
    except RuntimeError as e:
        err = str(e)
    with open(os.path.join(out, f"refused-rank{rank}.json"), "w") as f:
        json.dump({"error": err, "trl": trl.__version__}, f)
    if world > 1:
        torch.distributed.barrier()


def run(config, out, rank, world, adapter, fail_fast, lossguard_bin):
    os.makedirs(out, exist_ok=True)
    if config == "sft":
        trainer = sft_trainer(out, world, keep_inputs=adapter)
    else:
        trainer = grpo_trainer(config, out, world, keep_inputs=adapter)
    trainer.add_callback(GradDump(out, rank))
    cb = None
    if adapter:
        cb = ltrl.attach(trainer, os.path.join(out, "captures"), steps=range(STEPS), fail_fast=fail_fast,
                         lossguard_bin=lossguard_bin, timeout=60)
    try:
        trainer.train()
    except lc.AuditFailed as e:
        start = torch.load(os.path.join(out, f"params-step{trainer.state.global_step}-rank{rank}.pt"))
        unchanged = all(torch.equal(p.detach(), start[n]) for n, p in trainer.model.named_parameters())
        with open(os.path.join(out, f"failfast-rank{rank}.json"), "w") as f:
            json.dump({"global_step": trainer.state.global_step, "exit_code": e.exit_code, "text": e.text,
                       "message": str(e), "params_unchanged": unchanged}, f)
        raise
    finally:
        torch.save(trainer.step_losses, os.path.join(out, f"losses-rank{rank}.pt"))
    if adapter:
        if config == "sft":
            verify_sft(out, rank)
        else:
            verify_grpo(trainer, out, rank)
    a = trainer.args
    meta = {"config": config, "world": world, "reduce": cb.reduce if cb else None,
            "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "audit": {str(k): v.to_json() for k, v in (cb.results.items() if cb else [])}}
    if config != "sft":
        meta.update(loss_type=a.loss_type, steps_per_generation=a.steps_per_generation,
                    generation_batch_size=a.generation_batch_size, max_completion_length=a.max_completion_length,
                    num_generations=a.num_generations)
    with open(os.path.join(out, f"meta-rank{rank}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if world > 1:
        torch.distributed.barrier()


def hf_on_sft(out):
    """lossguard_capture.hf on an SFTTrainer: TRL's SFT loss does not call F.cross_entropy (1.15+: the fused LM
    head's log_probs; before: the default loss_type chunked_nll's F.nll_loss)."""
    import lossguard_capture.hf
    os.makedirs(out, exist_ok=True)
    trainer = sft_trainer(out, 1)
    # fail fast audits step 0: what the adapter cannot measure stops the run (record-only, it would be a warning)
    lossguard_capture.hf.attach(trainer, os.path.join(out, "hf-captures"), fail_fast=True)
    err = None
    try:
        trainer.train()
    except RuntimeError as e:
        err = str(e)
    with open(os.path.join(out, "hf-on-sft.json"), "w") as f:
        json.dump({"error": err}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="", help="comma-separated configs: each run with and without the adapter")
    ap.add_argument("--audit-in-run", default="", help="configs whose adapter run also audits step 0 (fail_fast)")
    ap.add_argument("--fail-fast", default=None, metavar="CONFIG", help="only CONFIG, adapter with fail_fast")
    ap.add_argument("--hf-on-sft", action="store_true")
    ap.add_argument("--lossguard-bin", default=None)
    a = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    if a.hf_on_sft:
        hf_on_sft(os.path.join(a.out, "hf-on-sft"))
    if a.fail_fast:
        run(a.fail_fast, os.path.join(a.out, a.fail_fast), rank, world, True, True, a.lossguard_bin)
        return
    in_run = set(c for c in a.audit_in_run.split(",") if c)
    for config in [c for c in a.configs.split(",") if c]:
        if config == "sft" and not SFT_MEASURED:
            refused_sft(os.path.join(a.out, config), rank, world, a.lossguard_bin)
            continue
        run(config, os.path.join(a.out, config, "adapter"), rank, world, True, config in in_run, a.lossguard_bin)
        run(config, os.path.join(a.out, config, "plain"), rank, world, False, False, None)


if __name__ == "__main__":
    main()
