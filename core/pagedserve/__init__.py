"""pagedserve: a fast, hardware-portable LLM inference engine with platform plugins."""

__version__ = "0.1.0"
