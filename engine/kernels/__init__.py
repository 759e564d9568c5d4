"""The CPU kernels, pure operations: decode attention, packed, int8, int4 and stacked products, the read ceiling."""
