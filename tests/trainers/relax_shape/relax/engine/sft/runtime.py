"""Relax's SFT mode predicates (redai-studio/Relax relax/engine/sft/runtime.py @36882ca), restated: the objective
is SFT when ``--loss-type sft``; regular SFT with ``--sft-chunked-logits`` defers the main output layer into the
loss (``should_use_sft_chunked``), which the training step asks through ``should_bypass_main_output_layer``
(also true for ``--mtp-only-training``, which the adapter refuses)."""


def is_sft_mode(args):
    return getattr(args, "loss_type", None) == "sft"


def should_use_sft_chunked(args):
    return is_sft_mode(args) and bool(getattr(args, "sft_chunked_logits", False))


def should_bypass_main_output_layer(args):
    return bool(getattr(args, "mtp_only_training", False)) or should_use_sft_chunked(args)
