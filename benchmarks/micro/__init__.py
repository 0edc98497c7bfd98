"""Small measurements that run on any machine: channels, batching, tokenizing, the CUDA hand-off
races, the non-finite sentinel, one DFlash2 step, NCCL across ranks.
"""
