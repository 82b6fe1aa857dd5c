"""Stand-in package for Megatron-LM's ``megatron.training`` (the training loop package of Megatron-LM; the
megatron-core wheel the tier runs over ships ``megatron.core`` only). Only the names slime's real modules import
at 624b824 are here: global_vars (set_args, get_args, _build_tokenizer), training (get_model), checkpointing
(load_checkpoint, save_checkpoint), arguments (core_transformer_config_from_args). See each module."""
