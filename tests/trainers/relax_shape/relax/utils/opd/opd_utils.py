"""Stand-in for relax.utils.opd.opd_utils (redai-studio/Relax): the five names the real loss.py @36882ca imports,
as they behave with on-policy distillation off (``--opd-kl-coef 0``, ``--opd-loss-coef 0``, no top-K token
selection; read at @02bf712: validate_opd_topk_gather L1005, resolve_opd_gather_topk_token_ids L1014,
apply_opd_to_advantages L1290, compute_policy_opd_loss L1383 — 36882ca's passes ``metric_reducer`` too). OPD
itself is refused by lossguard_capture.relax (``--opd-loss-coef``) and never runs in the tests."""


def validate_opd_topk_gather(args, gather_topk_token_ids):
    return None


def resolve_opd_gather_topk_token_ids(args, batch):
    return None


def compute_opd_topk_log_probs(logits_chunk, gather_topk_token_ids, sample_idx):
    raise NotImplementedError("on-policy distillation is not part of the tests")


def apply_opd_to_advantages(args, rollout_data, advantages):
    if float(getattr(args, "opd_kl_coef", 0.0) or 0.0) != 0.0:
        raise NotImplementedError("on-policy distillation is not part of the tests")


def compute_policy_opd_loss(*, args, batch, log_probs, old_log_probs, log_probs_and_entropy, metric_reducer=None):
    if float(getattr(args, "opd_loss_coef", 0.0) or 0.0) != 0.0:
        raise NotImplementedError("on-policy distillation is not part of the tests")
    return None, {}
