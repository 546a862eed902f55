"""Multi-LoRA serving: PEFT adapters applied per token beside the base model's linear layers."""
