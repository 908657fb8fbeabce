import torch

# The tests run tiny tensors: one thread is faster than two, and immune to a busy machine
# (two OpenMP pools spinning on two cores slow small ops down by orders of magnitude).
torch.set_num_threads(1)
