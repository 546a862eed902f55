"""Models: native implementations, the transformers fallback, and the loader the runner calls.

Entry points: `pagedserve.models.loader.load_model` (-> `LoadedModel(model, hf_config, spec,
source)`), `resolve_model_source`, `load_tokenizer`; the model interface is
`pagedserve.models.spec.PagedCausalLM` and its `ModelSpec`.
"""
