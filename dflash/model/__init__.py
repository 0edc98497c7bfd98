"""The models: the frozen target and the DFlash drafter, and what ties them together.

Imports: torch, transformers, csp, and dflash's leaf modules (:mod:`dflash.messages`,
:mod:`dflash.seeding`, :mod:`dflash.errors`); nothing from the other rooms, so a model can be
built, run and tested without data, a trainer or a run directory. Modules::

    target_config.py     the [target] table and the transformers config it builds (presets, overrides, dtype)
    target.py            the frozen target: build, hidden-state capture, the shared head loaded alone
    target_engine.py     the target as an inference engine: fp8 Linears, varlen attention, compiled layers
    document_mask.py     the target's document-causal mask over packed rows, per attention path
    layer_ids.py         which target layers feed the drafter (the public default, or checked ids)
    shared_head.py       the target's frozen embedding and LM head, which the drafter shares
    features.py          target hidden states -> the drafter's input: the feature noise, DrafterInput
    drafter_config.py    the [drafter] table: shape, variant, switches, resolved against the target
    variants.py          one declaration per drafter variant: its keys, modules, drafting and export
    drafter.py           the DFlash drafter nn.Module, with the public parameter names; a variant's parts
    attention.py         block attention: the layout of blocks and their masks (SDPA, flex)
    dflash2.py           DFlash2's grouped dynamic causal convolution and candidate selector
    xpress.py            XPress's causal low-rank refiner on the DFlash backbone
    resblock.py          the "resblock" variant: a Medusa-style residual block before the shared LM head
    confidence_head.py   DSpark's confidence head: predicted acceptance from the drafter's hidden state
    drafter_kernels.py   the drafter on fused kernels (Liger's RMSNorm and SwiGLU) and torch.compile
    drafter_fp8.py       the drafter's backbone matmuls in float8 while it trains
    build_lock.py        one module build at a time per process (transformers builds under global patches)
    answers.py           the target's answers to many contexts (padded batches, continuous batching, or slots)
    slots.py             many answers over one static KV cache, the step a CUDA graph, rows refilled as answers end
    cuda_graph.py        one fixed-shape step replayed as a CUDA graph, or run eagerly where it cannot be
    public_layout.py     a public-layout drafter directory read back: config.json as a DrafterConfig, its weights
    modeling_dflash.py   the standalone transformers model shipped with an export (trust_remote_code)
    modeling_resblock.py the "resblock" variant's transformers model, shipped beside modeling_dflash.py
"""
