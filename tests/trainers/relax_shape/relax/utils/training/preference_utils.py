"""Stand-in for relax.utils.training.preference_utils (redai-studio/Relax): the names the real loss.py @36882ca
imports for its ``dpo`` and ``rm`` losses, which lossguard_capture.relax refuses at init (a sum of per-pair
losses: no per-token loss to weigh) and the tests never run."""


def _preference(*_, **__):
    raise NotImplementedError("Relax's dpo and rm losses are refused by lossguard_capture.relax")


build_preference_pair_indices = dpo_pair_loss = dpo_rewards = masked_sequence_sums = _preference
preference_accuracy = reward_model_pair_loss = select_packed_sequence_scores = _preference
