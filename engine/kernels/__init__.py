"""The CPU kernels: the direct decode step, decode attention, packed, int8 and stacked products, and the CPU's flags."""
