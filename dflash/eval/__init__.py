"""``python -m dflash.eval``: a trained drafter measured by real draft-and-verify decoding.

Imports: :mod:`dflash.model`, :mod:`dflash.data` (prompts built as training builds contexts),
:mod:`dflash.checkpoint` (the drafter on disk), :mod:`dflash.train.acceptance` and
:mod:`dflash.observe.runlog`; never :mod:`dflash.run`. This ``__init__`` imports nothing, so
``--help`` answers before torch loads. Modules::

    __main__.py        python -m dflash.eval: runs cli.py
    cli.py             the command: load, measure, report
    args.py            its parser (imports no torch, so --help is quick)
    inputs.py          its inputs, checked before any model loads
    config.py          the [eval] table: held-out tau measured while training
    decode.py          plain greedy decoding, and draft-and-verify with a drafter proposing blocks
    proposers.py       what drafts a block in draft-and-verify: the proposer protocols, the drafter's
    selector.py        DFlash2's proposer: blocks drafted by the candidate selector's walk
    xpress.py          XPress's proposer: the backbone drafts, the refiner resolves the block
    tree.py            tree verification teacher-forced: the B most probable prefixes of a block's marginals
    tree_decode.py     greedy decoding with a tree verified in one target forward (a tree attention mask)
    static_target.py   the target's decode step at a fixed shape, replayed as a CUDA graph
    static_drafter.py  the drafter's step at a fixed shape over a fixed-capacity cache, as a CUDA graph
    static_tree.py     the target's tree verify step at a fixed shape, as a CUDA graph
    explain.py         why the measured and simulated figures differ (the lines under the table)
    measure.py         decode each prompt for real, score the same text teacher-forced, time the target alone
    pooled.py          the figures of many decodes pooled: overall, per category or length bucket, the speed
    lengths.py         context-length buckets: tau by how long the prompt was
    progress.py        an evaluation's progress while it runs, for a person waiting on it
    sets.py            the field's evaluation sets (prompts with a category)
    turns.py           multi-turn prompts: the next turn asked after the target's answer
    projection.py      the projected speedup on an 8B-class target, from the measured tau
    report.py          the result types and the printed table
    grouped.py         the tables per category and per context length, and the speedup lines
"""
