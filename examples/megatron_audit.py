#!/usr/bin/env python3
"""Megatron-core's real 1F1B pipeline schedule, audited by lossguard: two stages, a loss function over logits.

    torchrun --nproc-per-node 2 examples/megatron_audit.py --out captures [--bug] [--lossguard-bin BIN]
    lossguard audit captures/step000000

A tiny GPTModel (one layer per stage, CPU, Gloo), 2 micro-batches of 4 rows, the per-token loss. --bug: a mean
per micro-batch; audit FAILs step 0 and fail fast raises AuditFailed on both stages before the update.
Needs megatron-core 0.15.3 to 0.16.1 (scripts/setup-trainers.sh megatron: ~/.cache/lossguard/venv-megatron)."""
import argparse, os, sys  # noqa: E401
from functools import partial
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lossguard_capture.megatron_cpu import cuda_on_cpu, import_megatron_core  # noqa: E402
import_megatron_core()  # on a CPU machine, megatron-core 0.15's import-time CUDA build fails as it expects
from megatron.core import parallel_state as ps, tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # noqa: E402,E501
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
import lossguard_capture.megatron as lcm  # noqa: E402
from lossguard_capture import AuditFailed  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True), ap.add_argument("--lossguard-bin", default=None)
ap.add_argument("--bug", action="store_true", help="a mean per micro-batch instead of the per-token loss")
a = ap.parse_args()
dist.init_process_group("gloo")
ps.initialize_model_parallel(pipeline_model_parallel_size=2)
torch.manual_seed(0)
with cuda_on_cpu():          # without a GPU: the tensors megatron-core allocates on "cuda" by name go to the CPU
    config = TransformerConfig(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                               use_cpu_initialization=True, calculate_per_token_loss=True,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, batch_p2p_comm=False)
    spec = get_gpt_layer_local_spec()   # attention off: Megatron's local attention needs a CUDA RNG tracker
    spec.submodules.input_layernorm, spec.submodules.self_attention = IdentityOp, IdentityOp
    spec.submodules.self_attn_bda = IdentityFuncOp
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64,
                   max_sequence_length=8, pre_process=ps.is_pipeline_first_stage(),
                   post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False)
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, clip_grad=0.0), model)
    config.grad_scale_func, config.finalize_model_grads_func = optimizer.scale_loss, finalize_model_grads
    audit = lcm.attach(config, a.out, model=model, optimizer=optimizer, lossguard_bin=a.lossguard_bin)

    def loss_func(batch, logits):                       # the last stage: logits [b, s, V] -> per-token losses
        token_loss = audit.per_token(tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch["labels"]))
        mask = batch["loss_mask"]
        n = mask.sum().to(torch.int)
        loss = (token_loss * mask).sum() / (n.clamp(min=1) if a.bug else 1)
        return loss, (torch.ones_like(n) if a.bug else n), {"lm loss": loss.detach().view(1)}

    def forward_step(data_iterator, model):             # every stage; the model without labels returns logits
        batch = next(data_iterator)                     # the micro-batch's rows and their global indices
        return model(batch["tokens"], batch["position_ids"], None), audit.loss_func(
            partial(loss_func, batch), tokens=batch["tokens"], loss_mask=batch["loss_mask"],
            sample_indices=batch["sample_indices"])

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 64, (8, 8), generator=g)
    mask = (torch.rand(8, 8, generator=g) < 0.6).float()
    mask[:, -1] = 0                                     # a row's last position predicts nothing
    mask[1], mask[6] = 0, 1                             # an empty sample; a full one (the micro-batches differ)
    mask[6, -1] = 0
    rows = [dict(tokens=tokens[i:i + 4], labels=torch.roll(tokens[i:i + 4], -1, 1), loss_mask=mask[i:i + 4],
                 position_ids=torch.arange(8).expand(4, 8), sample_indices=torch.arange(i, i + 4)) for i in (0, 4)]
    try:
        with audit.step(0):
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(rows), model=model,
                                        num_microbatches=2, seq_length=8, micro_batch_size=4)
            optimizer.step()
        sys.stdout.write(f"rank {dist.get_rank()}: step 0 applied; audit {audit.verdicts}\n")   # one write a line
    except AuditFailed as e:
        sys.stdout.write(f"rank {dist.get_rank()}: AuditFailed before the update: {str(e).splitlines()[0]}\n")
ps.destroy_model_parallel()
dist.destroy_process_group()
