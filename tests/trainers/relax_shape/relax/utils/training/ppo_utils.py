"""relax.utils.training.ppo_utils.compute_approx_kl, the k1 estimator only (what the tests use)."""


def compute_approx_kl(log_probs, log_probs_base, kl_loss_type="k1", importance_ratio=None):
    assert kl_loss_type == "k1"
    return log_probs - log_probs_base
