"""Batch-1 decode: measured speed of the decoders (``speed.py``) and the projection of a measured
tau to real target sizes (``projection.py``).
"""
