"""Model weights on disk, shared by training (``ckpt.init_from``, eval of a model directory),
upcycling, conversion and export: safetensors files (one, or shards with an index) and our
model's weights in them, experts by global index so each rank reads only its rows.

Below every command layer (train, hf, upcycle); above the model and the MoE layer it reads into.
"""
from .output_dir import OutputDirectory, check_tokenizer_named, read_record
from .records import RECORDS, check_complete
from .model_weights import DTYPES, has_model_weights, load_model_weights, output_dtype, save_model_weights
from .safetensors_io import INDEX, SINGLE, SafetensorsCheckpoint, ShardedWriter

__all__ = ["has_model_weights", "output_dtype", "load_model_weights", "save_model_weights", "DTYPES", "SafetensorsCheckpoint",
           "ShardedWriter", "SINGLE", "INDEX", "RECORDS", "OutputDirectory", "check_complete",
           "check_tokenizer_named", "read_record"]
