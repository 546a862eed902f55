"""The import path of `AttentionMetadata` before plugin API 1.15, kept for plugins written against
it: the type is the plugin contract's and lives in `pagedserve.platforms.attention_metadata`."""

from pagedserve.platforms.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
