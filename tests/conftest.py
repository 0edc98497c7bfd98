"""Suite-wide settings.

One intra-op thread per test process: the models here are tiny, so a second OpenMP thread buys
little, and on a machine with more runnable threads than cores the threads' spin-waits cost up to
50x (measured: 10 training steps of a 4-layer, 64-wide Qwen3 took 43 s with 2 threads at load 6 on
2 cores, 0.84 s with 1). Subprocesses the tests start keep torch's own default.
"""

import torch

torch.set_num_threads(1)
