"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter for one request. `lora_int_id` identifies the adapter inside the engine
    (its KV blocks, its slot): two requests with the same id must name the same adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        # 0 is reserved: it stands for "no adapter" in block hashes and the scheduler's counts.
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path must name a PEFT adapter folder")
