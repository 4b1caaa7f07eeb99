"""Compute: ragspeed's C kernels (cpu_kernels), the quantized linear kinds (quant), attention
and its metadata, the step's buffers, the decode threads and what the CPU has. The lowest
layer: it imports no other layer of the native engine."""
