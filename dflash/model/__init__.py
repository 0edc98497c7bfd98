"""The models: the frozen target and the DFlash drafter, and what ties them together.

Owns the drafter (:mod:`~dflash.model.drafter`: ``fc`` over the concatenated target features, the
block-diffusion layers), its attention layouts (:mod:`~dflash.model.attention`), the target wrapper
(:mod:`~dflash.model.target`: a transformers causal LM, packed documents under
:mod:`~dflash.model.document_mask`, the captured layers of :mod:`~dflash.model.layer_ids`, its
config in :mod:`~dflash.model.target_config`), the frozen embedding and LM head the drafter shares
(:mod:`~dflash.model.shared_head`), the target-to-drafter hand-off (:mod:`~dflash.model.features`)
and the standalone transformers modeling file shipped with exports
(:mod:`~dflash.model.modeling_dflash`). Imports: torch, transformers, csp, and dflash's leaf
modules (:mod:`dflash.messages`, :mod:`dflash.seeding`, :mod:`dflash.errors`); nothing from the
other rooms, so a model can be built, run and tested without data, a trainer or a run directory.
"""
