"""Model configuration and HF checkpoint I/O shared by every backend (framework-free)."""

from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import CheckpointError, check_state_dict, expected_shapes, load_state_dict, save_state_dict

__all__ = ["ModelConfig", "CheckpointError", "check_state_dict", "expected_shapes", "load_state_dict", "save_state_dict"]
