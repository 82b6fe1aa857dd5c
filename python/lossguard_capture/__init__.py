"""lossguard-capture: record a trainer's own loss-normalisation numbers for `lossguard audit` (docs/semantics.md §10)."""

from .recorder import SCHEMA, MicroBatch, Recorder, capture_filename
from .zigzag import (owned_count, zigzag_chunk_size, zigzag_local_logit_index, zigzag_owned,
                     zigzag_owned_logit_positions, zigzag_slices)

__version__ = "0.1.0"

__all__ = [
    "Recorder", "MicroBatch", "SCHEMA", "capture_filename",
    "zigzag_owned", "zigzag_slices", "zigzag_chunk_size", "zigzag_owned_logit_positions", "zigzag_local_logit_index",
    "owned_count",
]
