"""An example third-party pagedserve platform, "example_cpu": plain torch on the CPU.

It uses only pagedserve's public plugin API (`pagedserve.platforms.api`, `hookspecs.hookimpl`
and `AttentionMetadata`), so it doubles as a template for new platforms. See docs/plugins.md.
"""
