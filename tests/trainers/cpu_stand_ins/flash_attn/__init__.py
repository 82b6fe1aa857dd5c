"""Test-only stand-in, NOT flash-attn: see ../README.md.  Only ``flash_attn.bert_padding`` exists, so that
verl <= 0.9.0's ``verl.utils.attention_utils`` imports on a CPU machine; anything else (``flash_attn.ops``,
the attention kernels) raises ImportError as on a machine without flash-attn."""

LOSSGUARD_CPU_STAND_IN = True
