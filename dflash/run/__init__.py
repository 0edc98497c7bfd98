"""``python -m dflash.run GRAPH.toml``: the training graph, from the file to the running stages.

One pass, one module a step (``cli.py`` reads top to bottom): load the graph file, resolve it
against the target and its tokenizer, validate every rule once (each room's own checks), build
the csp graph, take the run directory, prepare the data and the resume state, and run. The top
floor of the training path: it may import every other room, and none imports it (the tools
:mod:`dflash.regenerate` and the benchmarks do). This ``__init__`` imports nothing, so ``--help``
answers before torch loads. Modules::

    __main__.py    python -m dflash.run: runs cli.py
    cli.py         the command, one step a line, in the order a run takes them
    args.py        its parser (imports no torch, so --help is quick)
    config.py      the graph file: csp's tables plus every room's own ([run] and the assembly)
    config_doc.py  python -m dflash.run.config_doc: docs/configuration.md from the config structs
    resolve.py     the file filled from the target and its tokenizer; each stage's options built
    options.py     each stage's frozen options (imports no stage)
    validate.py    every rule of a resolved run, checked once, before anything is read or written
    run_dir.py     the run directory: its lock, earlier segments' observability kept
    prepare.py     what must exist before the graph starts: the data, the sampler, the resume state
    app.py         what the stages share at run time (the Runtime's app)
    step_gate.py   steps that may compile run alone in the process; the others run side by side
    memory.py         each CUDA device's peak memory estimated from the settings; a run that will not fit stops first
    out_of_memory.py  a stage out of GPU memory: which settings to change, with their values
    stages/        the csp process kinds: prefetch -> target -> postprocess -> drafter -> monitor
"""
