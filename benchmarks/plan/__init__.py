"""``dflash.plan``'s layout model applied to 8-64 GPUs on paper (``paper.py``).
"""
